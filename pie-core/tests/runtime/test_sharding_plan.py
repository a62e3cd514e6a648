"""The tensor-parallel plan over a region's primitives (`pie.poem.sharding`), on a decoder layer's regions.

A layer of 8 query and 4 KV heads of 16, hidden size 64 and MLP width 128; the XLA engine's tests run the
same plan on 2 and 4 devices against the CPU engine.
"""

from __future__ import annotations

import numpy as np

from pie.contract import RegionOp, RegionRequest
from pie.kernels import PRIMITIVES
from pie.poem.primitives import PrimitiveRegion, primitive_region
from pie.poem.sharding import REPLICATED, ShardingPlan, Spec, Split, plan_sharding

AXIS = "model"
COLUMNS: Spec = (None, AXIS)
Q, KV, HEAD_DIM, HIDDEN, MLP = 128, 64, 16, 64, 128


def attention_input() -> RegionRequest:
    ops = (
        RegionOp("rms_norm_linear", ("x", "norm", "qkv", None), "h", (("eps", 1e-5),)),
        RegionOp("slice_columns", ("h",), "q", (("start", 0), ("stop", Q))),
        RegionOp("slice_columns", ("h",), "k", (("start", Q), ("stop", Q + KV))),
        RegionOp("slice_columns", ("h",), "v", (("start", Q + KV), ("stop", Q + 2 * KV))),
        RegionOp("rope", ("q", "positions", "inv_freq"), "qr", (("head_dim", HEAD_DIM),)),
        RegionOp("rope", ("k", "positions", "inv_freq"), "kr", (("head_dim", HEAD_DIM),)),
    )
    return RegionRequest("L0.attn_in", ops, ("x", "norm", "qkv", "positions", "inv_freq"), ("qr", "kr", "v"))


SHAPES = [(5, HIDDEN), (HIDDEN,), (Q + 2 * KV, HIDDEN), (5,), (HEAD_DIM // 2,)]


def plan(
    region: RegionRequest,
    shapes: list[tuple[int, ...]],
    devices: int,
    pool_sharded: bool,
    specs: dict[int, Spec] | None = None,
    blocks: dict[int, int] | None = None,
) -> tuple[PrimitiveRegion, ShardingPlan]:
    program, _ = primitive_region(region, PRIMITIVES, "test")
    return program, plan_sharding(program, shapes, specs or {}, devices, AXIS, pool_sharded, blocks)


def test_qkv_is_grouped_by_segment_and_its_slices_stay_on_their_device() -> None:
    program, found = plan(attention_input(), SHAPES, 2, pool_sharded=True)
    assert found.splits[2] == Split((AXIS, None), (Q, KV, KV), 2)
    assert found.splits[1] == found.splits[4] == REPLICATED, "norm weights and rotary frequencies"
    assert found.splits[0] == found.splits[3] == REPLICATED, "the batch's activations and positions"
    slices = [i for i, step in enumerate(program.steps) if step.kernel == "slice_columns"]
    assert all(found.groups[i] == 2 for i in slices)
    assert all(found.specs[v] == COLUMNS for v in program.outputs)
    assert all(found.rows_source[v] == 0 for v in program.outputs), "every output has x's rows"


def test_a_mesh_the_heads_do_not_divide_replicates_instead() -> None:
    _, found = plan(attention_input(), SHAPES, 3, pool_sharded=False)
    assert found.splits[2] == REPLICATED and not found.groups
    assert set(found.specs.values()) == {()}


def test_one_device_plans_no_constraints() -> None:
    _, found = plan(attention_input(), SHAPES, 1, pool_sharded=False)
    assert set(found.splits.values()) == {REPLICATED} and not found.specs and not found.groups


def test_projections_of_a_sharded_input_are_row_parallel_and_gate_up_is_grouped_in_halves() -> None:
    ops = (
        RegionOp("linear_add", ("attn", "o", "x"), "y"),
        RegionOp("rms_norm_gate_up_silu", ("y", "norm", "gate_up"), "m", (("eps", 1e-5),)),
    )
    region = RegionRequest("L0.attn_out", ops, ("attn", "o", "x", "norm", "gate_up"), ("y", "m"))
    shapes = [(5, Q), (HIDDEN, Q), (5, HIDDEN), (HIDDEN,), (2 * MLP, HIDDEN)]
    program, found = plan(region, shapes, 2, pool_sharded=True, specs={0: COLUMNS})
    assert found.splits[1] == Split(COLUMNS), "o: columns split, the partial sums reduced"
    assert found.splits[4] == Split((AXIS, None), (MLP, MLP), 2)
    y, m = program.outputs
    assert found.specs[y] == () and found.specs[m] == COLUMNS
    # Kept as blocks of 32 elements, o's 128 columns split at block boundaries only: 4 blocks over 2, not over 8.
    _, blocked = plan(region, shapes, 2, pool_sharded=True, specs={0: COLUMNS}, blocks={1: 32})
    assert blocked.splits[1] == Split(COLUMNS)
    _, too_fine = plan(region, shapes, 8, pool_sharded=True, specs={0: COLUMNS}, blocks={1: 32})
    assert too_fine.splits[1] != Split(COLUMNS)


def test_the_grouped_row_order_gives_each_device_its_share_of_every_segment() -> None:
    order = Split((AXIS, None), (4, 2, 2), 2).permutation(8)
    assert order is not None
    np.testing.assert_array_equal(order, [0, 1, 4, 6, 2, 3, 5, 7])
    assert Split((AXIS, None)).permutation(8) is None and REPLICATED.permutation(8) is None
