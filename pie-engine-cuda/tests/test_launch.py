"""Launch configurations computed from shapes."""

from __future__ import annotations

import pytest
from pie_engine_cuda import launch
from pie_engine_cuda.sources import read_source


def test_constants_match_the_kernel_sources() -> None:
    gemm, attention = read_source("gemm.cu"), read_source("attention.cu")
    assert f"#define PIE_GEMV_ROWS {launch.GEMV_ROWS}" in gemm
    assert f"#define PIE_TILE_M {launch.TILE_M}" in gemm
    assert f"#define PIE_TILE_N {launch.TILE_N}" in gemm
    assert f"PIE_KERNEL(pie_gemv_f32, GemmArgs, {launch.GEMV_THREADS})" in gemm
    assert f"PIE_KERNEL(pie_gemm_f32, GemmArgs, {launch.SIMT_THREADS})" in gemm
    assert f"#define PIE_TC_THREADS {launch.TC_THREADS}" in gemm
    assert "PIE_KERNEL_BLOCKS(pie_gemm_tc_f32, GemmArgs, PIE_TC_THREADS, 2)" in gemm
    assert f"#define PIE_ATTN_THREADS {launch.ATTENTION_THREADS}" in attention
    assert f"#define PIE_PREFILL_SLOTS {launch.PREFILL_SLOTS}" in attention
    assert f"#define PIE_MAX_HEAD_DIM {launch.MAX_HEAD_DIM}" in read_source("common.cuh")


@pytest.mark.parametrize("n, blocks", [(1, 1), (256, 1), (257, 2), (17 * 128, 9), (10**9, 3906250)])
def test_elementwise_covers_every_element_once(n: int, blocks: int) -> None:
    config = launch.elementwise(n)
    assert config[:3] == (blocks, 1, 1) and config.block_x == 256
    assert config.grid_x * config.block_x >= n > (config.grid_x - 1) * config.block_x


def test_empty_and_oversized_grids_are_refused() -> None:
    with pytest.raises(launch.LaunchError):
        launch.elementwise(0)
    with pytest.raises(launch.LaunchError):
        launch.gemv(576, 8 * 70000, 32)  # grid.y > 65535


@pytest.mark.parametrize("warp, warps_per_block", [(32, 4), (64, 2)])
def test_gemv_gives_each_output_column_a_warp(warp: int, warps_per_block: int) -> None:
    config = launch.gemv(out_cols=49152, rows=1, warp_size=warp)
    assert config[:3] == (49152 // warps_per_block, 1, 1)
    assert config.block_x == launch.GEMV_THREADS
    assert launch.gemv(out_cols=577, rows=17, warp_size=warp)[:3] == (-(-577 // warps_per_block), 3, 1)


@pytest.mark.parametrize(
    "out_cols, rows, paired, grid",
    [(576, 1, False, (9, 1, 1)), (577, 65, False, (10, 2, 1)), (1536, 100, True, (48, 2, 1)), (80, 3, True, (3, 1, 1))],
)
def test_gemm_tiles(out_cols: int, rows: int, paired: bool, grid: tuple[int, int, int]) -> None:
    simt = launch.gemm(out_cols, rows, paired, tensor_cores=False)
    tc = launch.gemm(out_cols, rows, paired, tensor_cores=True)
    assert simt[:3] == tc[:3] == grid
    assert (simt.block_x, tc.block_x) == (launch.SIMT_THREADS, launch.TC_THREADS)


def test_row_rope_and_append_configs() -> None:
    assert launch.per_row(49)[:3] == (49, 1, 1)
    # SmolLM2: 9 heads of 64 -> 288 rotated pairs per token -> 3 blocks of 128
    assert launch.rope(tokens=5, heads=9, head_dim=64)[:3] == (5, 3, 1)
    assert launch.append_kv(tokens=7, width=3 * 64)[:3] == (7, 2, 1)


def test_page_copies_split_the_page_axis_at_the_grid_limit() -> None:
    chunks = launch.copy_pages(page_elems=6144, count=70000, layers=30)
    assert [first for first, _ in chunks] == [0, 65535]
    assert [c[:3] for _, c in chunks] == [(24, 65535, 30), (24, 70000 - 65535, 30)]


@pytest.mark.parametrize("head_dim", [16, 32, 64, 80, 100, 128, 129, 200, 256])
def test_prefill_tiles_fit_registers_and_shared_memory(head_dim: int) -> None:
    block_q, block_k, shared = launch.prefill_tiles(head_dim)
    assert block_q * head_dim <= launch.ATTENTION_THREADS * launch.PREFILL_SLOTS
    assert 1 <= block_q <= 32 and block_k in (16, 32)
    assert shared <= 48 * 1024
    config = launch.attention_items(items=7, num_heads=9, shared=shared)
    assert config[:3] == (7, 9, 1) and config.shared == shared


def test_prefill_tiles_refuse_huge_heads() -> None:
    with pytest.raises(launch.LaunchError):
        launch.prefill_tiles(512)


def test_grid_stride_caps_the_blocks_and_never_launches_none() -> None:
    assert launch.grid_stride(10, 528)[:3] == (1, 1, 1)
    assert launch.grid_stride(0, 528)[:3] == (1, 1, 1)
    assert launch.grid_stride(10**9, 528)[:3] == (528, 1, 1)
    assert launch.grid_stride(1000, 528).block_x == launch.ELEMENTWISE_THREADS
