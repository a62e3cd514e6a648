"""The engine end to end on the host emulator: the CUDA C kernels built by the host C++ compiler
and run as fibers, behind the same launchers, allocator and page hooks a GPU uses.

It runs the conformance kit with 32-lane warps (NVIDIA) and 64-lane wavefronts (AMD CDNA), and
the checks of ``cuda_checks`` (16-bit weights, weights read as stored, long contexts, small models against
the CPU engine).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import cuda_checks as checks
import numpy as np
import pytest
from pie import kernels
from pie.plugins import Device, EngineError, EngineRegistry
from pie.runtime.model_runner import ModelRunner
from pie.testing.conformance import ConformanceSuite
from pie.testing.models import random_weights, tiny_config
from emulator_api import SELECTED, EmulatorApi, HostCompiler, probe_emulator
from pie_engine_cuda.api import GpuError
from pie_engine_cuda.sources import read_source


class TestEmulatedConformance(ConformanceSuite):
    engine = "cuda"
    # A CUDA grid holds 2^31 - 1 blocks in x, so 262,144 outputs are no limit here (the check is Vulkan's and
    # WebGPU's 65,535), and the emulator takes about three minutes over them; a GPU runs them (test_gpu.py).
    test_linear_to_262_144_outputs = None
    test_linear_of_15_inputs_to_262_144_outputs = None
    # Nor a storage binding's size (CUDA kernels take pointers; the check is Vulkan's and WebGPU's 128 MiB), and 129
    # rows of 262,144 logits would be 32 times the emulated work of the test above, a 132 MiB weight's three rows 24.
    test_logits_of_more_rows_than_a_storage_binding_holds = None
    test_a_vocabulary_past_a_storage_binding_is_embedded_and_projected = None
    # Nor is there a cap on a thread's loop iterations (the check is software devices'); the tensor-core variant's
    # 16,384 steps along 262,144 inputs took the emulator 2.5 minutes of CI's test time. The 64-lane class runs the
    # other variants over them, test_tensor_core_projections_split_along_k the tensor cores over long inputs, and a
    # GPU all of it.
    test_linear_over_262_144_inputs = None

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _backend(cls, emulator: int) -> None:
        return None

    def test_the_emulator_is_the_device(self, device: Device) -> None:
        extra = dict(device.info.extra)
        assert extra["backend"] == "emulator" and extra["warp_size"] == "32"
        assert "tc" in device.kernels()["linear"]


class TestEmulatedWave64Conformance(ConformanceSuite):
    """AMD's 64-lane wavefronts: what hiprtc-compiled kernels see on CDNA GPUs."""

    engine = "cuda"
    emulator_warp = 64
    # The kit's model-level checks compose the same launchers and pass plans at any warp size, and run at
    # 32 lanes above; every kernel's 64-lane path is checked by the kernel-level tests of this class.
    test_tiny_stored_models_match_their_float32_copies = None
    test_pass_plans_change_no_logit = None
    test_linear_to_262_144_outputs = None
    test_linear_of_15_inputs_to_262_144_outputs = None
    test_logits_of_more_rows_than_a_storage_binding_holds = None
    test_a_vocabulary_past_a_storage_binding_is_embedded_and_projected = None

    @pytest.fixture(scope="class", autouse=True)
    @classmethod
    def _backend(cls, emulator: int) -> None:
        return None

    def test_the_wavefront_is_64_lanes_and_there_is_no_mma(self, device: Device) -> None:
        assert dict(device.info.extra)["warp_size"] == "64"
        assert "tc" not in device.kernels()["linear"]


@pytest.mark.parametrize("weights", ["float16", "bfloat16"])
@pytest.mark.parametrize("name", checks.PROJECTIONS)
def test_projections_with_16_bit_weights(emulated_device: Device, name: str, weights: str) -> None:
    checks.check_projection_with_16_bit_weights(emulated_device, name, weights)


@pytest.mark.parametrize("weight_type", checks.STORED_TYPES)
@pytest.mark.parametrize("name", checks.PROJECTIONS)
def test_projections_read_weights_as_stored(emulated_device: Device, name: str, weight_type: str) -> None:
    checks.check_projection_with_stored_weights(emulated_device, name, weight_type)


@pytest.mark.parametrize("weight_type", checks.STORED_TYPES)
def test_embedding_of_a_stored_table(emulated_device: Device, weight_type: str) -> None:
    checks.check_embedding_of_a_stored_table(emulated_device, weight_type)


@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_1"])
def test_a_stored_model_matches_its_float32_copy_on_the_cpu_engine(
    emulated_device: Device, tmp_path: Path, weight_type: str
) -> None:
    from pie.testing.models import make_gguf_model

    path = make_gguf_model(tmp_path / "m.gguf", weight_type, tie_word_embeddings=True)
    checks.check_stored_model_against_its_float32_copy_on_the_cpu_engine(emulated_device, path, (weight_type.lower(),))


def test_a_k_quant_model_matches_its_float32_copy_on_the_cpu_engine(emulated_device: Device, tmp_path: Path) -> None:
    """A Q4_K_M-like GGUF (Q4_K, Q5_K and Q6_K matrices) runs as stored, nothing converted at load."""
    from pie.testing.models import make_k_quant_model

    path = make_k_quant_model(tmp_path / "q4_k_m.gguf")
    checks.check_stored_model_against_its_float32_copy_on_the_cpu_engine(emulated_device, path, ("q4_k", "q5_k", "q6_k"))


def test_tensor_core_projections_split_along_k(emulated_device: Device) -> None:
    checks.check_tensor_core_projections_split_along_k(emulated_device)


def test_embedding_of_a_half_table(emulated_device: Device) -> None:
    checks.check_embedding_of_a_half_table(emulated_device)


@pytest.mark.parametrize("head_dim, heads, kv_heads", checks.ATTENTION_SHAPES)
def test_attention_on_long_contexts(emulated_device: Device, head_dim: int, heads: int, kv_heads: int) -> None:
    checks.check_attention_on_long_contexts(emulated_device, head_dim, heads, kv_heads)


def test_split_kv_attention_splits_a_long_decode_once(emulated_device: Device) -> None:
    checks.check_split_kv_attention_splits_a_long_decode_once(emulated_device)


def test_random_batches_across_variants(emulated_device: Device) -> None:
    checks.check_random_batches_across_variants(emulated_device)


def test_a_small_llama_matches_the_cpu_engine(emulated_device: Device) -> None:
    checks.check_small_llama_against_the_cpu_engine(emulated_device)


def test_a_head_dim_beyond_attention_is_refused_when_the_plan_is_built(emulated_device: Device) -> None:
    """The attention kernels hold at most 256 dims a row: such a model loaded whole, and its first step failed."""
    config = tiny_config(head_dim=320)
    with pytest.raises(EngineError, match=r"^engine 'cuda' runs attention with head_dim up to 256; this model's is "
                                          r"320 \(use --engine cpu or xla\)$"):
        ModelRunner(config, random_weights(config).items(), emulated_device, page_size=4, max_cached_tokens=64)


def test_weights_are_converted_once_when_the_engine_keeps_them_in_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    from pie_engine_cuda import plugin

    monkeypatch.setenv("PIE_CUDA_BACKEND", SELECTED)
    monkeypatch.setenv("PIE_CUDA_EMULATOR_WARP", "32")
    monkeypatch.setenv("PIE_CUDA_WEIGHT_DTYPE", "bfloat16")
    monkeypatch.setattr(plugin.engine, "_backends", {})
    device = EngineRegistry(env={}).engine("cuda").open(0)
    rng = np.random.default_rng(9)
    x, w = rng.standard_normal((2, 64)).astype(np.float32), rng.standard_normal((40, 64)).astype(np.float32)
    weight = device.upload(w)
    linear = device.compile("linear", "gemv")
    first = device.download(linear(device.upload(x), weight, None))
    assert weight.dtype == "bfloat16" and weight.nbytes == w.size * 2
    second = device.download(linear(device.upload(x), weight, None))
    np.testing.assert_array_equal(first, second)
    np.testing.assert_allclose(first, kernels.linear(x, checks.bf16_round(w)), rtol=1e-4, atol=1e-4)


class OneInt(ctypes.Structure):
    _fields_ = [("out", ctypes.c_uint64), ("n", ctypes.c_int32), ("pad", ctypes.c_int32)]


def test_the_emulator_reports_barrier_divergence_instead_of_hanging(emulated_device: Device) -> None:
    source = read_source("compat_host.cuh") + """
struct OneInt { int* out; int n; int pad; };
PIE_KERNEL(diverge, OneInt, 64) {
  if (threadIdx.x < 16) __syncthreads();
  args.out[threadIdx.x] = 1;
}
PIE_KERNEL(converge, OneInt, 64) {
  __shared__ int total;
  if (threadIdx.x == 0) total = 0;
  __syncthreads();
  if (threadIdx.x == 5) total = args.n;
  __syncthreads();
  args.out[threadIdx.x] = total + static_cast<int>(threadIdx.x);
}
"""
    api = EmulatorApi(probe_emulator()[0])
    module = api.load_module(HostCompiler().compile(source, "diverge", "host-warp32"))
    out = np.zeros(64, np.int32)
    args = OneInt(out.ctypes.data, 7, 0)
    api.bind(api.get_function(module, "converge"), args)(1, 1, 1, 64, 1, 1, 0)
    np.testing.assert_array_equal(out, 7 + np.arange(64))
    with pytest.raises(GpuError, match="barrier divergence"):
        api.bind(api.get_function(module, "diverge"), args)(1, 1, 1, 64, 1, 1, 0)


@pytest.mark.parametrize("cols, k", checks.TOP_K_SHAPES)
def test_top_k_candidates_match_a_stable_sort(emulated_device: Device, cols: int, k: int) -> None:
    checks.check_top_k(emulated_device, cols, k)


def test_top_tokens_select_on_the_device_and_a_k_past_the_kernel_is_refused(emulated_device: Device) -> None:
    from pie_engine_cuda.launchers import MAX_K

    assert emulated_device.supports("top_k")
    logits = np.random.default_rng(3).standard_normal((2, 700)).astype(np.float32)
    indices, values = emulated_device.top_tokens(emulated_device.upload(logits), 40)
    expected_values, expected_indices = kernels.top_k(logits, k=40)
    np.testing.assert_array_equal(indices, expected_indices)
    np.testing.assert_array_equal(values, expected_values)
    with pytest.raises(EngineError, match=f"engine 'cuda': compiling kernel top_k failed: ValueError: .*k <= {MAX_K}, "
                       f"not k={MAX_K + 1}"):
        emulated_device.compile("top_k", k=MAX_K + 1)
    with pytest.raises(ValueError, match=r"top_k: k=9 must be in 1\.\.8"):
        emulated_device.compile("top_k", k=9)(emulated_device.upload(logits[:, :8]))


def test_read_bandwidth_times_argmax_sweeps_and_the_emulator_leaves_the_roofline_to_the_host(
    emulated_device: Device,
) -> None:
    from pie_engine_cuda import plugin

    runtime = plugin.engine.backend(emulated_device.info)
    held = runtime.blocks.live_bytes
    bandwidth = runtime.read_bandwidth(megabytes=1, passes=2, sweeps=1)
    assert 0 < bandwidth < float("inf")
    assert runtime.blocks.live_bytes == held  # its buffers went back
    assert plugin.engine.pie_memory_bandwidth(emulated_device.info, passes=1) is None


def test_the_read_sweep_reads_up_to_the_last_group(emulated_device: Device) -> None:
    from pie_engine_cuda import launch, plugin
    from pie_engine_cuda.args import STRUCTS

    runtime = plugin.engine.backend(emulated_device.info)
    data = np.zeros((1000, 4), np.float32)
    data[-1, 3] = 12345.0  # the one value the sweep reports through its sink
    buffer, sink = runtime.upload(data), runtime.zeros((1,))
    args = STRUCTS["SweepArgs"]()
    args.x, args.sink, args.count = buffer.ptr, sink.ptr, 1000
    runtime.bind("core", "pie_read_sweep", args)(*launch.grid_stride(1000, 2))
    assert runtime.download(sink)[0] == 12345.0


def test_shapes_that_would_read_past_a_buffer_are_refused(emulated_device: Device) -> None:
    linear = emulated_device.compile("linear", "gemv")
    with pytest.raises(ValueError, match=r"linear: x \(2, 8\) has 8 columns, the weight \(4, 6\) takes 6"):
        linear(emulated_device.upload(np.ones((2, 8), np.float32)), emulated_device.upload(np.ones((4, 6), np.float32)),
               None)
    from pie.contract import PageLayout

    pool = emulated_device.allocate_pages(PageLayout(num_layers=1, num_pages=2, page_size=4, num_kv_heads=1,
                                                     head_dim=8))
    attention = emulated_device.compile("attention", "decode", layer=0, num_heads=2, scale=1.0)
    indices = [emulated_device.upload(np.array(a, np.int32)) for a in ([0, 1], [0], [0, 1], [1])]
    with pytest.raises(ValueError, match=r"q \(1, 8\) is not \[tokens, 2 heads \* 8\]"):
        attention(emulated_device.upload(np.ones((1, 8), np.float32)), pool, *indices)


def test_catalogue_arguments_that_would_read_or_write_past_a_buffer_are_refused(emulated_device: Device) -> None:
    from pie.contract import PageLayout

    def up(shape: tuple[int, ...], dtype: type = np.float32) -> object:
        return emulated_device.upload(np.zeros(shape, dtype))

    with pytest.raises(ValueError, match=r"add: shapes \(2, 8\) and \(2, 4\) differ"):
        emulated_device.compile("add")(up((2, 8)), up((2, 4)))
    with pytest.raises(ValueError, match="silu_mul: width 7 is odd"):
        emulated_device.compile("silu_mul")(up((2, 7)))
    rope = emulated_device.compile("rope", head_dim=4)
    with pytest.raises(ValueError, match="rope: width 6 is not whole heads of 4"):
        rope(up((2, 6)), up((2,), np.int32), up((2,)))
    with pytest.raises(ValueError, match=r"rope: positions \(1,\) are not \[2\]"):
        rope(up((2, 8)), up((1,), np.int32), up((2,)))
    with pytest.raises(ValueError, match=r"rope positions: expected a 1-d int32 tensor, got \(2,\) float32"):
        rope(up((2, 8)), up((2,), np.float32), up((2,)))
    with pytest.raises(ValueError, match=r"rope: inv_freq must be \[2\], got \(1,\)"):
        rope(up((2, 8)), up((2,), np.int32), up((1,)))
    with pytest.raises(ValueError, match=r"residual \(2, 3\) mismatches the output \(2, 4\)"):
        emulated_device.compile("linear_add", "gemv")(up((2, 8)), up((4, 8)), up((2, 3)))
    with pytest.raises(ValueError, match="gather_rows indices: expected a 1-d int32 tensor"):
        emulated_device.compile("gather_rows")(up((4, 8)), up((2,), np.float32))
    with pytest.raises(ValueError, match="embedding indices: expected a 1-d int32 tensor"):
        emulated_device.compile("embedding")(up((2, 1), np.int32), up((4, 8)))
    pool = emulated_device.allocate_pages(PageLayout(num_layers=1, num_pages=2, page_size=4, num_kv_heads=1,
                                                     head_dim=8))
    append_kv = emulated_device.compile("append_kv", layer=0)
    with pytest.raises(ValueError, match=r"append_kv: k \(2, 8\), v \(3, 8\), slots \(2,\)"):
        append_kv(pool, up((2, 8)), up((3, 8)), up((2,), np.int32))
    with pytest.raises(ValueError, match=r"append_kv: k \(2, 4\), v \(2, 4\), slots \(2,\) are not \[tokens, 8\]"):
        append_kv(pool, up((2, 4)), up((2, 4)), up((2,), np.int32))
    with pytest.raises(ValueError, match=r"append_kv slots: expected a 1-d int32 tensor, got \(2,\) float32"):
        append_kv(pool, up((2, 8)), up((2, 8)), up((2,), np.float32))
    with pytest.raises(ValueError, match=r"rms_norm: weight \(4,\) is not \[8\]"):
        emulated_device.compile("rms_norm", eps=1e-6)(up((2, 8)), up((4,)))
    attention = emulated_device.compile("attention", "decode", layer=0, num_heads=1, scale=1.0)
    indices = [emulated_device.upload(np.array(a, np.int32)) for a in ([0, 1], [0], [0, 1], [1])]
    with pytest.raises(ValueError, match=r"attention qo_indptr: expected a 1-d int32 tensor, got \(2,\) int64"):
        attention(up((1, 8)), pool, up((2,), np.int64), *indices[1:])
    with pytest.raises(ValueError, match="kv_page_indptr and qo_indptr describe different batches"):
        attention(up((1, 8)), pool, *indices[:2], up((1,), np.int32), indices[3])
    with pytest.raises(ValueError, match="kv_last_page_lens does not match the batch"):
        attention(up((1, 8)), pool, *indices[:3], up((2,), np.int32))
    with pytest.raises(ValueError, match=r"bias \(3,\) for 4 rows"):
        emulated_device.compile("linear", "gemv")(up((2, 8)), up((4, 8)), up((3,)))
    with pytest.raises(ValueError, match=r"norm weight \(4,\) for 8 columns"):
        emulated_device.compile("rms_norm_linear", "gemv", eps=1e-6)(up((2, 8)), up((4,)), up((4, 8)))


def test_activations_of_another_type_and_odd_gate_up_rows_are_refused(emulated_device: Device) -> None:
    """A 16-bit activation would be read as float32, past the end of its buffer; an odd number of stacked
    gate/up rows has no halves. Both used to reach the kernels."""

    def up(shape: tuple[int, ...], dtype: type = np.float32) -> object:
        return emulated_device.upload(np.zeros(shape, dtype))

    with pytest.raises(ValueError, match=r"add b: expected a 2-d float32 tensor, got \(2, 8\) float16"):
        emulated_device.compile("add")(up((2, 8)), up((2, 8), np.float16))
    with pytest.raises(ValueError, match=r"rope x: expected a 2-d float32 tensor, got \(2, 8\) float16"):
        emulated_device.compile("rope", head_dim=4)(up((2, 8), np.float16), up((2,), np.int32), up((2,)))
    with pytest.raises(ValueError, match=r"softmax x: expected a 2-d float32 tensor, got \(2, 8\) int32"):
        emulated_device.compile("softmax", temperature=1.0)(up((2, 8), np.int32))
    for variant in emulated_device.kernels()["rms_norm_gate_up_silu"]:
        gate_up = emulated_device.compile("rms_norm_gate_up_silu", variant, eps=1e-6)
        with pytest.raises(ValueError, match=r"rms_norm_gate_up_silu: the stacked gate/up weight has an odd number"):
            gate_up(up((2, 8)), up((8,)), up((5, 8)))


def test_a_launch_of_its_own_with_pages_or_slots_outside_the_pool_is_refused(emulated_device: Device) -> None:
    """Outside a pass the page tables and slots are the caller's: read back (or from their host copies) and
    checked against the pool before the kernels follow them unbounded. The pool is left as it was."""
    pool = emulated_device.upload(np.zeros((1, 8, 2, 4, 2, 16), np.float32))
    k = emulated_device.upload(np.ones((3, 32), np.float32))

    def ints(*values: int) -> object:
        return emulated_device.upload(np.array(values, np.int32))

    append_kv = emulated_device.compile("append_kv", layer=0)
    with pytest.raises(ValueError, match="append_kv: slot 32 is outside the pool's 8 pages of 4 tokens"):
        append_kv(pool, k, k, ints(0, 1, 32))
    for variant in emulated_device.kernels()["attention"]:
        attention = emulated_device.compile("attention", variant, layer=0, num_heads=2, scale=0.25)
        with pytest.raises(ValueError, match="attention: kv_page_indices holds page 8, outside the pool's 8 pages"):
            attention(k, pool, ints(0, 3), ints(0, 8), ints(0, 2), ints(3))
        with pytest.raises(ValueError, match="attention: kv_page_indices holds page -1, outside the pool's 8 pages"):
            attention(k, pool, ints(0, 3), ints(-1, 2), ints(0, 2), ints(3))
    assert not emulated_device.download(pool).any()
