"""Lowering: each region becomes kernels of one engine, bound once into a flat plan.

For every region the longest fused kernel the engine implements wins; what no
fused kernel covers runs as primitives; a primitive the engine lacks runs on the
CPU engine with transfers around it. The page-pool kernels (``append_kv``,
``attention``) cannot move: an engine without them cannot run a model.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pie.contract import KernelRequest, RegionOp, RegionRequest
from pie.plugins import Device, EngineError
from pie.poem.graph import Graph, Op
from pie.poem.regions import Region, partition

POOL_KERNELS = frozenset({"append_kv", "attention"})


@dataclass(frozen=True)
class Fusion:
    """A chain of ops (each feeding the next, nothing else reading the middle) that one kernel replaces."""

    kinds: tuple[str, ...]
    kernel: str
    takes_bias: bool = False

    def arguments(self, ops: list[Op]) -> tuple[tuple[str | None, ...], dict[str, Any]]:
        """The fused kernel's inputs and options, following its catalogue signature."""
        options: dict[str, Any] = {}
        for op in ops:
            options.update(op.option_dict)
        if self.kernel == "rms_norm_linear":
            norm, proj = ops
            return (norm.inputs[0], norm.inputs[1], proj.inputs[1], proj.inputs[2]), options
        if self.kernel == "linear_add":
            proj, add = ops
            residual = add.inputs[1] if add.inputs[0] == proj.output else add.inputs[0]
            return (proj.inputs[0], proj.inputs[1], residual), options
        if self.kernel == "rms_norm_gate_up_silu":
            norm, proj, _ = ops
            return (norm.inputs[0], norm.inputs[1], proj.inputs[1]), options
        raise KeyError(self.kernel)

    def matches(self, ops: list[Op], uses: Mapping[str, int]) -> bool:
        if tuple(op.kind for op in ops) != self.kinds:
            return False
        for producer, consumer in zip(ops, ops[1:]):
            if producer.output is None or producer.output not in consumer.inputs or uses[producer.output] != 1:
                return False
        projection = next(op for op in ops if op.kind == "linear")
        return self.takes_bias or projection.inputs[2] is None


FUSIONS = (
    Fusion(("rms_norm", "linear", "silu_mul"), "rms_norm_gate_up_silu"),
    Fusion(("rms_norm", "linear"), "rms_norm_linear", takes_bias=True),
    Fusion(("linear", "add"), "linear_add"),
)


@dataclass
class Step:
    region: str
    kernel: str
    variant: str | None
    covers: tuple[str, ...]
    inputs: tuple[str | None, ...]
    outputs: tuple[str, ...]
    """Empty for in-place kernels; several for a region compiled as one unit."""
    launcher: Callable[..., Any]
    request: KernelRequest | RegionRequest
    fallback: bool = False

    @property
    def whole_region(self) -> bool:
        return isinstance(self.request, RegionRequest)


class Plan:
    """A lowered forward pass: steps over numbered value slots, run by a tight loop."""

    def __init__(self, graph: Graph, regions: list[Region], steps: list[Step], device: Device):
        self.graph = graph
        self.regions = regions
        self.steps = steps
        self.device = device
        names: list[str | None] = [None]
        for step in steps:
            names.extend(n for n in (*step.inputs, *step.outputs) if n is not None)
        self.slots: dict[str | None, int] = {}
        for name in names:
            self.slots.setdefault(name, len(self.slots))
        self._program = tuple((step.launcher, tuple(self.slots[n] for n in step.inputs), self._outputs(step)) for step in steps)
        self.output_slot = self.slots[graph.output]

    def _outputs(self, step: Step) -> int | tuple[int, ...]:
        if step.whole_region:
            return tuple(self.slots[n] for n in step.outputs)
        return self.slots[step.outputs[0]] if step.outputs else -1

    def new_env(self) -> list[Any]:
        return [None] * len(self.slots)

    def bind(self, env: list[Any], name: str, value: Any) -> None:
        slot = self.slots.get(name)
        if slot is not None:
            env[slot] = value

    def run(self, env: list[Any]) -> Any:
        for launcher, inputs, output in self._program:
            result = launcher(*[env[i] for i in inputs])
            if output.__class__ is int:
                if output >= 0:
                    env[output] = result
            else:
                for slot, value in zip(output, result):
                    env[slot] = value
        return env[self.output_slot]

    def describe(self) -> str:
        lines = [f"Poem plan on {self.device.info.key} ({self.device.info.name}): {len(self.regions)} regions, {len(self.steps)} kernels"]
        by_region: dict[str, list[Step]] = {}
        for step in self.steps:
            by_region.setdefault(step.region, []).append(step)
        for region in self.regions:
            ops = " + ".join(op.kind for op in region.ops)
            lines.append(f"  {region.label:<16} {ops}")
            for step in by_region.get(region.label, []):
                how = "fused" if len(step.covers) > 1 else "primitive"
                if step.whole_region:
                    how = "whole region"
                elif step.fallback:
                    how = "cpu fallback"
                variant = f"[{step.variant}]" if step.variant else ""
                lines.append(f"      -> {step.kernel}{variant} ({how})")
        return "\n".join(lines)


VariantChooser = Callable[[str], "str | None"]


def lower(
    graph: Graph,
    device: Device,
    fallback: Device | None = None,
    choose_variant: VariantChooser | None = None,
) -> Plan:
    """Partition ``graph`` and bind every region to ``device``'s kernels."""
    uses = graph.use_counts()
    regions = partition(graph)
    steps: list[Step] = []
    for region in regions:
        request = region_request(region, uses, graph.output)
        launcher = device.compile_region(request)
        if launcher is not None:
            covers = tuple(op.kind for op in region.ops)
            steps.append(Step(region.label, "region", None, covers, request.inputs, request.outputs, launcher, request))
            continue
        steps.extend(_lower_region(region, device, fallback, uses, choose_variant or (lambda kernel: None)))
    return Plan(graph, regions, steps, device)


def region_request(region: Region, uses: Mapping[str, int], graph_output: str) -> RegionRequest:
    """The region as a self-contained unit: what it reads from outside and what others read of it."""
    produced: set[str] = set()
    inputs: dict[str, None] = {}
    inner_uses: dict[str, int] = {}
    for op in region.ops:
        for name in op.inputs:
            if name is None:
                continue
            inner_uses[name] = inner_uses.get(name, 0) + 1
            if name not in produced:
                inputs.setdefault(name)
        if op.output is not None:
            produced.add(op.output)
    outputs = tuple(
        op.output
        for op in region.ops
        if op.output is not None and (op.output == graph_output or uses[op.output] > inner_uses.get(op.output, 0))
    )
    ops = tuple(RegionOp(op.kind, op.inputs, op.output, op.options) for op in region.ops)
    return RegionRequest(region.label, ops, tuple(inputs), outputs)


def _lower_region(
    region: Region, device: Device, fallback: Device | None, uses: Mapping[str, int], choose_variant: VariantChooser
) -> list[Step]:
    steps: list[Step] = []
    ops = region.ops
    i = 0
    while i < len(ops):
        for fusion in FUSIONS:
            window = ops[i : i + len(fusion.kinds)]
            if device.supports(fusion.kernel) and fusion.matches(window, uses):
                inputs, options = fusion.arguments(window)
                variant = _variant(device, fusion.kernel, choose_variant)
                launcher = device.compile(fusion.kernel, variant, **options)
                covers = tuple(op.kind for op in window)
                request = KernelRequest(fusion.kernel, variant, tuple(sorted(options.items())))
                outputs = _names(window[-1].output)
                steps.append(Step(region.label, fusion.kernel, variant, covers, inputs, outputs, launcher, request))
                i += len(window)
                break
        else:
            steps.append(_primitive(region.label, ops[i], device, fallback, choose_variant))
            i += 1
    return steps


def _variant(device: Device, kernel: str, choose_variant: VariantChooser) -> str | None:
    wanted = choose_variant(kernel)
    return wanted if wanted is not None and device.supports(kernel, wanted) else None


def _primitive(label: str, op: Op, device: Device, fallback: Device | None, choose_variant: VariantChooser) -> Step:
    if device.supports(op.kind):
        variant = _variant(device, op.kind, choose_variant)
        launcher = device.compile(op.kind, variant, **op.option_dict)
        request = KernelRequest(op.kind, variant, op.options)
        return Step(label, op.kind, variant, (op.kind,), op.inputs, _names(op.output), launcher, request)
    if op.kind in POOL_KERNELS or fallback is None or not fallback.supports(op.kind):
        raise EngineError(f"engine {device.name!r} does not implement {op.kind!r} and it cannot run elsewhere")
    host_launcher = fallback.compile(op.kind, None, **op.option_dict)
    request = KernelRequest(op.kind, None, op.options)
    launcher = _across(device, host_launcher)
    return Step(label, op.kind, None, (op.kind,), op.inputs, _names(op.output), launcher, request, fallback=True)


def _names(output: str | None) -> tuple[str, ...]:
    return () if output is None else (output,)


def _across(device: Device, host_launcher: Callable[..., Any]) -> Callable[..., Any]:
    """Run a CPU launcher on ``device`` tensors: download the inputs, upload the result."""
    download, upload = device.download, device.upload

    def run_on_host(*tensors: Any) -> Any:
        host = [None if t is None else download(t) for t in tensors]
        result = host_launcher(*host)
        return None if result is None else upload(np.ascontiguousarray(result))

    return run_on_host
