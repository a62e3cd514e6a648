"""Tensor parallelism as a sharding plan: which mesh layout each weight and activation takes.

Megatron's layout, written as JAX PartitionSpecs over one mesh axis; XLA's SPMD
partitioner inserts the collectives, nothing here communicates by hand:

- a projection whose input is replicated is column-parallel (weight rows sharded);
  one whose input is column-sharded is row-parallel (weight columns sharded, the
  partial sums all-reduced by XLA);
- the stacked QKV and gate/up weights are stored *grouped*: their rows are
  permuted so that device j's block holds the j-th slice of each segment (its
  share of the Q, K and V heads; of gate and of up). The following
  ``slice_columns``/``silu_mul`` then read their part of every block
  (``groups=n``) and stay local to each device;
- the KV pool is sharded on its KV-head axis, attention on heads;
- norms, residual adds and the batch indices are replicated.

Whatever does not divide evenly by the mesh size is replicated instead: slower,
never wrong. With one device every spec is ``()``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from pie.poem.primitives import Step

from pie_engine_xla.mesh import AXIS
from pie_engine_xla.tensors import Pad, Placement

REPLICATED: tuple[str | None, ...] = ()
COLUMNS: tuple[str | None, ...] = (None, AXIS)
ROWS_SHARDED: tuple[str | None, ...] = (AXIS, None)

ROLE_PAD = {"act": Pad.ZEROS, "index": Pad.ZEROS, "slots": Pad.SLOTS, "indptr": Pad.INDPTR}


@dataclass(frozen=True)
class _Grouped:
    segments: tuple[int, ...]


_State = Any  # REPLICATED, COLUMNS or _Grouped


@dataclass
class RegionPlan:
    placements: dict[int, Placement] = field(default_factory=dict)
    """Region input index -> how an upload in that position is placed."""
    groups: dict[int, int] = field(default_factory=dict)
    """Step index -> ``groups`` option of a grouped slice_columns/silu_mul."""
    specs: dict[int, tuple[str | None, ...]] = field(default_factory=dict)
    """Value -> sharding constraint (multi-device only)."""
    rows_source: dict[int, int] = field(default_factory=dict)
    """Value -> region input whose real length is the value's real length."""


def plan_region(
    steps: tuple[Step, ...],
    roles: list[str],
    shapes: list[tuple[int, ...]],
    input_specs: dict[int, tuple[str | None, ...]],
    outputs: tuple[int, ...],
    devices: int,
    pool_sharded: bool,
    blocks: dict[int, int] | None = None,
) -> RegionPlan:
    """Choose every placement and constraint of one region for a mesh of ``devices``.

    ``blocks`` gives the elements a block holds for each weight kept block-quantized: its columns are
    sharded only at block boundaries.
    """
    blocks = blocks or {}
    plan = RegionPlan()
    state: dict[int | None, _State] = {}  # keyed by the (never absent) tensor inputs of primitives
    for index, role in enumerate(roles):
        if role in ROLE_PAD:
            plan.placements[index] = Placement(ROLE_PAD[role], REPLICATED)
            plan.rows_source[index] = index
        if role == "act":
            state[index] = COLUMNS if input_specs.get(index) == COLUMNS else REPLICATED
    consumers: dict[int, list[Step]] = defaultdict(list)
    for step in steps:
        for value in step.inputs:
            if value is not None:
                consumers[value].append(step)
    unit = next((dict(s.options)["head_dim"] for s in steps if s.kernel == "rope"), 1)
    n = devices

    def weight(value: int | None, spec: tuple[str | None, ...], segments: tuple[int, ...] = ()) -> None:
        if value is not None:  # a spec other than REPLICATED, and segments, come only with n > 1
            plan.placements[value] = Placement(Pad.NONE, spec, segments, n if segments else 1)

    def segments_of(value: int, width: int) -> tuple[int, ...]:
        users = consumers[value]
        if value in outputs or not users:
            return ()
        if len(users) == 1 and users[0].kernel == "silu_mul":
            return (width // 2, width // 2) if width % (2 * n) == 0 else ()
        if any(u.kernel != "slice_columns" for u in users):
            return ()
        spans = sorted((dict(u.options)["start"], dict(u.options)["stop"]) for u in users)
        if spans[0][0] != 0 or spans[-1][1] != width or any(a[1] != b[0] for a, b in pairwise(spans)):
            return ()
        widths = tuple(stop - start for start, stop in spans)
        return widths if all(w % (n * unit) == 0 for w in widths) else ()

    for index, step in enumerate(steps):
        args = step.inputs
        kind = step.kernel
        out: _State = REPLICATED
        if kind == "linear":
            x, w, b = args
            assert w is not None
            rows, cols = shapes[w]
            if n > 1 and state[x] == COLUMNS and cols % (n * blocks.get(w, 1)) == 0:
                weight(w, (None, AXIS))
                weight(b, REPLICATED)
            elif n > 1 and (segments := segments_of(step.output, rows)):
                weight(w, ROWS_SHARDED, segments)
                weight(b, (AXIS,), segments)
                out = _Grouped(segments)
            elif n > 1 and rows % n == 0:
                weight(w, ROWS_SHARDED)
                weight(b, (AXIS,))
                out = COLUMNS
            else:
                weight(w, REPLICATED)
                weight(b, REPLICATED)
        elif kind == "embedding":
            table = args[1]
            assert table is not None
            weight(table, ROWS_SHARDED if n > 1 and shapes[table][0] % n == 0 else REPLICATED)
        elif kind in ("rms_norm", "rope", "rms_norm_heads"):
            weight(args[2] if kind == "rope" else args[1], REPLICATED)
            if kind != "rms_norm":
                out = state[args[0]]
        elif kind == "slice_columns":
            source = state[args[0]]
            span = dict(step.options)["stop"] - dict(step.options)["start"]
            if isinstance(source, _Grouped) and span in source.segments:
                plan.groups[index] = n
                out = COLUMNS
        elif kind == "silu_mul":
            if isinstance(state[args[0]], _Grouped):
                plan.groups[index] = n
                out = COLUMNS
        elif kind == "attention":
            out = COLUMNS if pool_sharded else REPLICATED
        elif kind == "add":
            out = COLUMNS if state[args[0]] == COLUMNS and state[args[1]] == COLUMNS else REPLICATED
        elif kind == "gather_rows":
            out = state[args[0]]
        elif kind == "append_kv":
            out = None
        state[step.output] = out
        if kind not in ("append_kv",):
            source = args[1] if kind == "gather_rows" else args[0]
            if source is not None and source in plan.rows_source:
                plan.rows_source[step.output] = plan.rows_source[source]
        if n > 1 and out is not None:
            plan.specs[step.output] = REPLICATED if out == REPLICATED else COLUMNS
    return plan

