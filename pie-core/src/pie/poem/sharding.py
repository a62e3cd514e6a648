"""Tensor parallelism as a plan over a region's primitives: which share of each weight and activation
each device of a one-axis mesh holds.

Megatron's layout, stated as partition specs over the mesh axis; the engine turns them into its own
placements (XLA: PartitionSpecs, its SPMD partitioner inserting the collectives):

- a projection whose input is replicated is column-parallel (weight rows sharded);
  one whose input is column-sharded is row-parallel (weight columns sharded, the
  partial sums all-reduced);
- the stacked QKV and gate/up weights are stored *grouped*: their rows are
  permuted (:meth:`Split.permutation`) so that device j's block holds the j-th
  slice of each segment (its share of the Q, K and V heads; of gate and of up).
  The following ``slice_columns``/``silu_mul`` then read their part of every
  block (``groups=n``) and stay local to each device;
- the KV pool is sharded on its KV-head axis, attention on heads;
- norms, residual adds and the batch's indices are replicated.

Whatever does not divide evenly by the mesh size is replicated instead: slower,
never wrong. With one device every spec is ``()``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import numpy as np

from pie.kernels import BATCH_ROLES
from pie.poem.primitives import PrimitiveRegion, Step

Spec = tuple[str | None, ...]
"""Per tensor axis, the mesh axis it is divided over or None: a PartitionSpec as a tuple (``()`` replicates)."""


@dataclass(frozen=True)
class Split:
    """How a tensor is divided among the devices: its spec, and for the grouped layout its row order."""

    spec: Spec
    segments: tuple[int, ...] = ()
    """Grouped layout: the widths of the stacked segments."""
    groups: int = 1

    def permutation(self, rows: int) -> np.ndarray | None:
        """Row order of the grouped layout: block j holds the j-th slice of every segment."""
        if self.groups == 1 or not self.segments:
            return None
        starts = np.cumsum((0, *self.segments[:-1]))
        blocks = [np.arange(start, start + width).reshape(self.groups, -1)
                  for start, width in zip(starts, self.segments, strict=True)]  # [groups, width / groups] each
        perm = np.concatenate(blocks, axis=1).reshape(-1)
        assert len(perm) == rows, (len(perm), rows)
        return perm


REPLICATED = Split(())


@dataclass(frozen=True)
class _Grouped:
    """An activation in the grouped layout: device j holds the j-th slice of each segment."""

    segments: tuple[int, ...]


@dataclass
class ShardingPlan:
    """Every split and constraint of one region on one mesh (:func:`plan_sharding`)."""

    splits: dict[int, Split] = field(default_factory=dict)
    """Region input -> how it is divided (every input but the pool)."""
    groups: dict[int, int] = field(default_factory=dict)
    """Step index -> ``groups`` option of a grouped slice_columns/silu_mul."""
    specs: dict[int, Spec] = field(default_factory=dict)
    """Value -> sharding constraint (multi-device only)."""
    rows_source: dict[int, int] = field(default_factory=dict)
    """Value -> region input whose real length is the value's real length."""


def plan_sharding(
    region: PrimitiveRegion,
    shapes: list[tuple[int, ...]],
    input_specs: dict[int, Spec],
    devices: int,
    axis: str,
    pool_sharded: bool,
    blocks: dict[int, int] | None = None,
) -> ShardingPlan:
    """Choose every split and constraint of one region for a mesh of ``devices`` along ``axis``.

    ``input_specs`` gives the specs the activations arrive in; ``blocks`` the elements a block holds for
    each weight kept block-quantized: its columns are sharded only at block boundaries.
    """
    blocks = blocks or {}
    replicated: Spec = ()
    columns: Spec = (None, axis)
    rows_sharded: Spec = (axis, None)
    steps, outputs = region.steps, region.outputs
    plan = ShardingPlan()
    state: dict[int | None, Any] = {}  # replicated, columns or _Grouped, keyed by the tensor inputs of primitives
    for index, role in enumerate(region.input_roles()):
        if role in BATCH_ROLES:
            plan.splits[index] = REPLICATED
            plan.rows_source[index] = index
        if role == "act":
            state[index] = columns if input_specs.get(index) == columns else replicated
    consumers: dict[int, list[Step]] = defaultdict(list)
    for step in steps:
        for value in step.inputs:
            if value is not None:
                consumers[value].append(step)
    unit = next((dict(s.options)["head_dim"] for s in steps if s.kernel == "rope"), 1)
    n = devices

    def weight(value: int | None, spec: Spec, segments: tuple[int, ...] = ()) -> None:
        if value is not None:  # a spec other than replicated, and segments, come only with n > 1
            plan.splits[value] = Split(spec, segments, n if segments else 1)

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
        out: Any = replicated
        if kind == "linear":
            x, w, b = args
            assert w is not None
            rows, cols = shapes[w]
            if n > 1 and state[x] == columns and cols % (n * blocks.get(w, 1)) == 0:
                weight(w, columns)
                weight(b, replicated)
            elif n > 1 and (segments := segments_of(step.output, rows)):
                weight(w, rows_sharded, segments)
                weight(b, (axis,), segments)
                out = _Grouped(segments)
            elif n > 1 and rows % n == 0:
                weight(w, rows_sharded)
                weight(b, (axis,))
                out = columns
            else:
                weight(w, replicated)
                weight(b, replicated)
        elif kind == "embedding":
            table = args[1]
            assert table is not None
            weight(table, rows_sharded if n > 1 and shapes[table][0] % n == 0 else replicated)
        elif kind in ("rms_norm", "rope", "rms_norm_heads"):
            weight(args[2] if kind == "rope" else args[1], replicated)
            if kind != "rms_norm":
                out = state[args[0]]
        elif kind == "slice_columns":
            source = state[args[0]]
            span = dict(step.options)["stop"] - dict(step.options)["start"]
            if isinstance(source, _Grouped) and span in source.segments:
                plan.groups[index] = n
                out = columns
        elif kind == "silu_mul":
            if isinstance(state[args[0]], _Grouped):
                plan.groups[index] = n
                out = columns
        elif kind == "attention":
            out = columns if pool_sharded else replicated
        elif kind == "add":
            out = columns if state[args[0]] == columns and state[args[1]] == columns else replicated
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
            plan.specs[step.output] = replicated if out == replicated else columns
    return plan
