"""A Poem region as one jitted JAX function, compiled once per shape bucket.

Regions that differ only in their ``layer`` (the same ops of every decoder layer)
share one :class:`Program`: the layer index is a traced scalar argument, so a
30-layer model compiles a handful of programs, not 150. A program compiles
once per combination of argument shapes; the token, sequence and page counts
are padded to powers of two (:mod:`pie_engine_xla.tensors`), so decoding
crosses a new bucket only when one of them doubles.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import jax
from pie.contract import RegionOp, RegionRequest
from pie.poem.primitives import PrimitiveRegion
from pie.poem.sharding import ShardingPlan, plan_sharding
from pie.weights import F32, WEIGHT_TYPES

from pie_engine_xla import kernels
from pie_engine_xla.compile_cache import use_persistent_cache
from pie_engine_xla.mesh import AXIS, MeshDevice
from pie_engine_xla.stored import Stored
from pie_engine_xla.tensors import ROLE_PAD, Pad, Placement, PoolBuffer, Tensor, place


class Program:
    """The shared compiled form of every region with one :class:`PrimitiveRegion`."""

    def __init__(self, mesh: MeshDevice, label: str, region: PrimitiveRegion):
        self.mesh = mesh
        self.label = label
        self.region = region
        self._donated = region.donated
        self.roles = region.input_roles()
        self.compiles = 0
        self._fixed = tuple(i for i, role in enumerate(self.roles) if role not in ROLE_PAD)
        self._variants: dict[tuple[tuple[int, ...], ...], _Variant] = {}
        self._lowered: Any = None
        self._compiled: Any = None
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<xla program {self.label}: {len(self.region.steps)} ops, {self.compiles} compile(s)>"

    def run(self, args: Sequence[Any], layers: tuple[Any, ...]) -> tuple[Tensor, ...]:
        variant = self._variants.get(tuple([args[i].layout_key for i in self._fixed]))
        if variant is None:
            variant = self._variant(args)
        arrays = [prep(a) for prep, a in zip(variant.preps, args, strict=True)]
        key = tuple([(a.shape, a.dtype, a.sharding) for a in arrays])
        compiled = variant.cache.get(key)
        if compiled is None:
            compiled = self._compile(variant, arrays, layers, key)
        results = compiled(*arrays, *layers)
        self.mesh.last = results  # the pool included: a region may write it and return nothing else
        if self._donated is not None:
            args[self._donated].array = results[-1]
            results = results[:-1]
        out = tuple(
            Tensor(array=r, rows=None if src is None else args[src].real_rows())
            for r, src in zip(results, variant.rows, strict=True)
        )
        return out

    def _variant(self, args: Sequence[Any]) -> _Variant:
        """Plan the layout for these weight shapes and types (and the shardings the activations arrive in)."""
        with self._lock:
            key = tuple(args[i].layout_key for i in self._fixed)
            found = self._variants.get(key)
            if found is None:
                specs = {
                    i: _spec_of(a.array)
                    for i, a in enumerate(args)
                    if self.roles[i] == "act" and a.host is None
                }
                pool_sharded = any(isinstance(a, PoolBuffer) and _spec_of(a.array) != () for a in args)
                shapes = [a.shape for a in args]
                stored = {
                    i: (a.weight_type, a.columns)
                    for i, a in enumerate(args)
                    if isinstance(a, Tensor) and a.weight_type != F32
                }
                blocks = {i: WEIGHT_TYPES[weight_type][1] for i, (weight_type, _) in stored.items()}  # elements a block
                plan = plan_sharding(self.region, shapes, specs, self.mesh.size, AXIS, pool_sharded, blocks)
                found = self._variants[key] = _Variant(self, plan, stored)
            return found

    def _compile(self, variant: _Variant, arrays: list[Any], layers: tuple[Any, ...], key: Any) -> Any:
        with self._lock:
            compiled = variant.cache.get(key)
            if compiled is not None:
                return compiled
            donate: tuple[int, ...] = ()
            out_shardings = [self.mesh.sharding(variant.plan.specs.get(v, ())) for v in self.region.outputs]
            if self._donated is not None:
                donate = (self._donated,)
                out_shardings.append(arrays[self._donated].sharding)
            use_persistent_cache()
            jitted = jax.jit(variant.trace, donate_argnums=donate, out_shardings=tuple(out_shardings))
            lowered = jitted.lower(*arrays, *layers)
            compiled = lowered.compile()
            variant.cache[key] = compiled
            self._lowered, self._compiled = lowered, compiled
            self.compiles += 1
            return compiled

    def stablehlo(self) -> str | None:
        """StableHLO text of the most recently compiled bucket (None before the first launch)."""
        return None if self._lowered is None else self._lowered.as_text()

    def optimized_hlo(self) -> str | None:
        """XLA's optimized HLO of the most recent executable: shows the collectives sharding added."""
        return None if self._compiled is None else self._compiled.as_text()


class _Variant:
    """A program planned for one set of weight shapes: argument preparation, tracing, executables."""

    def __init__(self, program: Program, plan: ShardingPlan, stored: dict[int, tuple[str, int | None]]):
        self.program = program
        self.plan = plan
        self.stored = stored
        """Region input -> (weight type, logical columns) of each weight kept in a stored type."""
        self.preps = [self._prep(i) for i in range(program.region.num_inputs)]
        self.rows = [plan.rows_source.get(v) for v in program.region.outputs]
        self.cache: dict[Any, Any] = {}

    def _prep(self, index: int) -> Any:
        role = self.program.roles[index]
        if role == "pool":
            return attrgetter("array")  # the pool's current array
        split = self.plan.splits.get(index)
        assert split is not None, (self.program.label, index, role)
        sharding = self.program.mesh.sharding(split.spec)
        return _Placer(Placement(ROLE_PAD.get(role, Pad.NONE), split), sharding, role == "act")

    def trace(self, *flat: Any) -> tuple[Any, ...]:
        region, plan, mesh = self.program.region, self.plan, self.program.mesh
        env: dict[int, Any] = dict(enumerate(flat[: region.num_inputs]))
        for index, (weight_type, columns) in self.stored.items():
            env[index] = Stored(env[index], weight_type, columns or env[index].shape[1])
        layers = flat[region.num_inputs :]
        for index, step in enumerate(region.steps):
            args = [None if v is None else env[v] for v in step.inputs]
            if step.layer is not None:
                args.append(layers[step.layer])
            options = dict(step.options)
            if index in plan.groups:
                options["groups"] = plan.groups[index]
            value = kernels.PRIMITIVES[step.kernel](*args, **options)
            spec = plan.specs.get(step.output)
            if spec is not None:
                value = jax.lax.with_sharding_constraint(value, mesh.sharding(spec))
            env[step.output] = value
        results = tuple(env[v] for v in region.outputs)
        if region.pool_value is not None:
            results += (env[region.pool_value],)
        return results


def _spec_of(array: Any) -> tuple[str | None, ...]:
    spec = getattr(array.sharding, "spec", None)
    if spec is None:
        return ()
    parts = tuple(spec)
    while parts and parts[-1] is None:
        parts = parts[:-1]
    return parts


@dataclass(frozen=True, slots=True)
class _Placer:
    """Places an argument the way the plan says, once. Weights and batch indices already in their planned
    layout, and activations already on the mesh (launch outputs), are used as they are."""

    placement: Placement
    sharding: Any
    activation: bool

    def __call__(self, tensor: Tensor) -> Any:
        if tensor.host is None and (self.activation or tensor.placement == self.placement):
            return tensor.array
        return place(tensor, self.placement, self.sharding)


@dataclass(eq=False, slots=True)
class RegionLauncher:
    """A compiled region bound to its layer: called with the region inputs, returns its outputs."""

    program: Program
    label: str
    layer_options: tuple[int, ...]
    _layers: tuple[Any, ...] | None = field(default=None, init=False)

    def __call__(self, *args: Any) -> tuple[Tensor, ...]:
        layers = self._layers
        if layers is None:
            layers = self._layers = self.program.mesh.scalars(self.layer_options)
        return self.program.run(args, layers)

    def __repr__(self) -> str:
        return f"<xla region {self.label} -> program {self.program.label}>"


@dataclass(eq=False, slots=True)
class KernelLauncher:
    """One catalogue kernel: a one-op region per pattern of absent (None) arguments."""

    mesh: MeshDevice
    kernel: str
    options: tuple[tuple[str, Any], ...]
    _launchers: dict[tuple[bool, ...], RegionLauncher] = field(default_factory=dict, init=False)

    def region(self, present: tuple[bool, ...]) -> RegionRequest:
        names = tuple(f"arg{i}" if here else None for i, here in enumerate(present))
        output = None if self.kernel == "append_kv" else "out"
        op = RegionOp(self.kernel, names, output, self.options)
        inputs = tuple(n for n in names if n is not None)
        return RegionRequest(f"kernel.{self.kernel}", (op,), inputs, () if output is None else (output,))

    def launchers(self) -> list[RegionLauncher]:
        return list(self._launchers.values())

    def __call__(self, *args: Any) -> Any:
        present = tuple(a is not None for a in args)
        launcher = self._launchers.get(present)
        if launcher is None:
            launcher = self._launchers[present] = self.mesh.launcher(self.region(present))
        outputs = launcher(*[a for a in args if a is not None])
        return outputs[0] if outputs else None
