"""Lowering: each region becomes kernels of one engine, bound once into a flat plan.

For every region the longest fused kernel the engine implements wins; what no
fused kernel covers runs as primitives; a primitive the engine lacks runs on the
CPU engine with transfers around it. The page-pool kernels (``append_kv``,
``attention``) cannot move: an engine without them cannot run a model.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pie.contract import KernelRequest, PassPlan, RegionOp, RegionRequest
from pie.kernels import POOL_KERNELS
from pie.plugins import Device, EngineError, what_raised
from pie.poem.fusions import FUSIONS
from pie.poem.graph import Graph, Op
from pie.poem.regions import Region, partition

ROW_ARGUMENT = {"append_kv": 1}
"""Launcher argument whose first axis is the row count (tokens or sampled rows); 0 when not listed."""
SIZE_ARGUMENT = {"linear": 1, "linear_add": 1, "rms_norm_linear": 2, "rms_norm_gate_up_silu": 2, "embedding": 1}
"""Launcher argument holding a kernel's static operand (its weight). Kernels without one are sized by
one row of their row argument (its elements past the first axis)."""
KV_BUCKETED = ("attention",)
"""Kernels whose buckets may also be keyed on the pass's longest KV length (``min_kv_tokens``)."""


def pow2_floor(n: int) -> int:
    """The power-of-two bucket anchor of ``n`` (0 for 0): the largest power of two <= n."""
    return 1 << (n.bit_length() - 1) if n > 0 else 0


def static_size(kernel: str, args: tuple[Any, ...]) -> int:
    """Elements of the launch's static operand: the weight, or one row of the row argument."""
    index = SIZE_ARGUMENT.get(kernel)
    if index is not None:
        return math.prod(args[index].shape)
    return math.prod(args[ROW_ARGUMENT.get(kernel, 0)].shape[1:])


@dataclass(frozen=True)
class ShapeBuckets:
    """A kernel's variants chosen per shape bucket, resolved when the kernel is launched.

    Each entry ``(size, rows, variant)`` covers launches whose static operand holds
    ``size <= elements < 2 * size`` (see :func:`static_size`) and whose row count is
    ``rows <= n < 2 * rows``, both powers of two. Any other shape runs the default variant.
    These buckets say nothing of KV lengths; a profile's may (:class:`pie.profiles.schema.ProfileBuckets`).
    """

    entries: tuple[tuple[int, int, str], ...]

    def variants(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(variant for _, _, variant in self.entries))

    def kv_thresholds(self) -> tuple[int, ...]:
        """The ``min_kv_tokens`` its buckets name, rising (empty: the variant never depends on KV length)."""
        return ()

    def rows_for(self, size: int, kv_tokens: int = 0) -> dict[int, str]:
        """Row-count bucket -> variant, for launches whose static operand falls in ``size``'s bucket (and,
        where :meth:`kv_thresholds` names any, in passes whose longest KV length is ``kv_tokens``)."""
        bucket = pow2_floor(size)
        return {rows: variant for s, rows, variant in self.entries if s == bucket}

    def restricted(self, supported: tuple[str, ...]) -> ShapeBuckets:
        """Without entries for variants ``supported`` lacks or for its default (its first)."""
        keep = set(supported[1:])
        return ShapeBuckets(tuple(e for e in self.entries if e[2] in keep))

    def describe(self) -> str:
        """E.g. ``rows at 2,4 rows (size 2^19), 2 rows (size 2^24)``."""
        parts = []
        for variant in self.variants():
            sizes = dict.fromkeys(size for size, _, v in self.entries if v == variant)
            cells = ", ".join(
                ",".join(str(r) for s, r, v in self.entries if s == size and v == variant)
                + f" rows (size 2^{size.bit_length() - 1})"
                for size in sizes
            )
            parts.append(f"{variant} at {cells}")
        return "; ".join(parts)


VariantChoice = str | ShapeBuckets | None
VariantChooser = Callable[[str], VariantChoice]
"""Asked once per kernel when a plan is lowered: a variant name, variants by shape bucket, or None
for the engine's default."""


class RunningPass:
    """What launchers see of the pass running now: its longest KV length (keys per sequence, the
    :class:`PassPlan`'s ``max_kv_len``), set by :meth:`Plan.run`; 0 outside a pass."""

    __slots__ = ("max_kv_len",)

    def __init__(self) -> None:
        self.max_kv_len = 0


def _row_table(
    by_rows: Mapping[int, str], launchers: Mapping[str, Callable[..., Any]], default: Callable[..., Any]
) -> list[Callable[..., Any]]:
    """The launcher per row-count bit length (index 0: no rows) for one static size's row buckets."""
    return [default] + [launchers.get(by_rows.get(1 << bit, ""), default) for bit in range(64)]


def bucketed_launcher(
    kernel: str,
    buckets: ShapeBuckets,
    launchers: Mapping[str, Callable[..., Any]],
    default: Callable[..., Any],
    running: RunningPass | None = None,
) -> Callable[..., Any]:
    """One launcher that runs the variant of each launch's shape bucket.

    The static operand never changes for a step, so the first launch reads its size and fills a
    table indexed by the row count's bit length; every later launch costs one table lookup. Buckets
    keyed on KV length (attention's) get one such table per ``min_kv_tokens``, picked by the bit length
    of ``running``'s longest KV length; without a running pass (``running`` None or 0) a launch takes the
    table of the buckets without the key.
    """
    row = ROW_ARGUMENT.get(kernel, 0)
    thresholds = buckets.kv_thresholds()
    if thresholds:
        return _kv_bucketed_launcher(kernel, buckets, thresholds, launchers, default, running or RunningPass())
    table: list[Callable[..., Any]] = []

    def specialise(*args: Any) -> Any:
        table[:] = _row_table(buckets.rows_for(static_size(kernel, args)), launchers, default)
        return table[args[row].shape[0].bit_length()](*args)

    table.extend([specialise] * 65)

    def launch(*args: Any) -> Any:
        return table[args[row].shape[0].bit_length()](*args)

    return launch


def _kv_bucketed_launcher(
    kernel: str,
    buckets: ShapeBuckets,
    thresholds: tuple[int, ...],
    launchers: Mapping[str, Callable[..., Any]],
    default: Callable[..., Any],
    running: RunningPass,
) -> Callable[..., Any]:
    """:func:`bucketed_launcher` for buckets keyed on KV length: a row table per threshold (the first for
    KV lengths below every threshold), the threshold's index read off the KV length's bit length."""
    row = ROW_ARGUMENT.get(kernel, 0)
    starts = (0, *thresholds)
    by_bits = [sum(1 for k in thresholds if k.bit_length() <= bits) for bits in range(65)]
    tables: list[list[Callable[..., Any]]] = [[] for _ in starts]

    def specialise(*args: Any) -> Any:
        size = static_size(kernel, args)
        for table, kv_tokens in zip(tables, starts, strict=True):
            table[:] = _row_table(buckets.rows_for(size, kv_tokens), launchers, default)
        return launch(*args)

    for table in tables:
        table.extend([specialise] * 65)

    def launch(*args: Any) -> Any:
        return tables[by_bits[running.max_kv_len.bit_length()]][args[row].shape[0].bit_length()](*args)

    return launch


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
    fallback: str | None = None
    """The engine that runs this step in the plan's engine's place (the CPU fallback), by name."""
    buckets: ShapeBuckets | None = None
    """Set when the launcher picks among variants per shape bucket (``variant`` is then the default)."""

    @property
    def whole_region(self) -> bool:
        return isinstance(self.request, RegionRequest)


@dataclass(frozen=True)
class Block:
    """A run of steps (one decoder layer's regions) the engine launches as one unit when it can."""

    label: str
    regions: tuple[str, ...]
    start: int
    """Index of the block's first step in ``Plan.steps``; its steps run when the launcher declines a pass."""
    stop: int
    launcher: Callable[..., Any]
    request: RegionRequest


@dataclass(frozen=True)
class Stack:
    """A run of consecutive blocks (a model's decoder layers) the engine launches as one unit when it can."""

    label: str
    blocks: tuple[Block, ...]
    """Its blocks, whose launchers run when the stack's declines a pass."""
    launcher: Callable[..., Any]
    request: RegionRequest


ProgramEntry = tuple[Callable[..., Any], tuple[int, ...], int | tuple[int, ...], str]
"""A launcher, its input slots, its output slot(s), and the name a failure is reported under."""


class KernelFailed(RuntimeError):
    """A kernel raised (or called sys.exit) during a forward pass: the message names it and what it raised."""

    def __init__(self, kernel: str, error: BaseException):
        super().__init__(f"kernel {kernel} failed: {what_raised(error)}")
        self.kernel = kernel


def _execute(program: tuple[ProgramEntry, ...], env: list[Any]) -> None:
    for launcher, inputs, output, name in program:
        try:
            result = launcher(*[env[i] for i in inputs])
        except KernelFailed:
            raise
        except (Exception, SystemExit) as exc:
            raise KernelFailed(name, exc) from exc
        if output.__class__ is int:
            if output >= 0:
                env[output] = result
        else:
            for slot, value in zip(output, result, strict=True):  # type: ignore[arg-type]  # a tuple here
                env[slot] = value


class Plan:
    """A lowered forward pass: steps over numbered value slots, run by a tight loop."""

    def __init__(
        self,
        graph: Graph,
        regions: list[Region],
        steps: list[Step],
        device: Device,
        blocks: tuple[Block, ...] = (),
        stacks: tuple[Stack, ...] = (),
        running: RunningPass | None = None,
    ):
        self.graph = graph
        self.regions = regions
        self.steps = steps
        self.device = device
        self.blocks = blocks
        self.stacks = stacks
        self.running = running or RunningPass()
        """The pass its launchers see (:meth:`run` sets it)."""
        names: list[str | None] = [None]
        for step in steps:
            names.extend(n for n in (*step.inputs, *step.outputs) if n is not None)
        for request in (*(block.request for block in blocks), *(stack.request for stack in stacks)):
            names.extend((*request.inputs, *request.outputs))
        self.slots: dict[str | None, int] = {}
        for name in names:
            self.slots.setdefault(name, len(self.slots))
        self._program = self._build_program()
        self.output_slot = self.slots[graph.output]
        written = {slot for _, _, out, _ in self._program for slot in (out if isinstance(out, tuple) else (out,))}
        self._written = tuple(sorted(slot for slot in written if slot >= 0))

    def _build_program(self) -> tuple[ProgramEntry, ...]:
        """The steps' launchers in order, each stack's or block's one launch in place of its steps."""
        engine = self.device.name
        step_entries = [
            (
                step.launcher,
                tuple(self.slots[n] for n in step.inputs),
                self._outputs(step),
                f"{step.kernel} in {step.region} on engine {step.fallback or engine!r}",
            )
            for step in self.steps
        ]

        def block_entry(block: Block) -> ProgramEntry:
            parts = tuple(step_entries[block.start : block.stop])
            name = f"block {block.label} on engine {engine!r}"
            return self._entry_or_parts(block.launcher, block.request, parts, name)

        block_at = {block.start: block for block in self.blocks}
        stack_at = {stack.blocks[0].start: stack for stack in self.stacks}
        program: list[ProgramEntry] = []
        index = 0
        while index < len(step_entries):
            if index in stack_at:
                stack = stack_at[index]
                parts = tuple(block_entry(block) for block in stack.blocks)
                name = f"stack {stack.label} on engine {engine!r}"
                program.append(self._entry_or_parts(stack.launcher, stack.request, parts, name))
                index = stack.blocks[-1].stop
            elif index in block_at:
                program.append(block_entry(block_at[index]))
                index = block_at[index].stop
            else:
                program.append(step_entries[index])
                index += 1
        return tuple(program)

    def _entry_or_parts(
        self, launcher: Callable[..., Any], request: RegionRequest, parts: tuple[ProgramEntry, ...], name: str
    ) -> ProgramEntry:
        """A block's or stack's launcher, falling back to its parts for a pass it declines."""
        inputs = tuple(self.slots[n] for n in request.inputs)
        outputs = tuple(self.slots[n] for n in request.outputs)
        slot_count = len(self.slots)

        def launch(*args: Any) -> Any:
            result = launcher(*args)
            if result is NotImplemented:
                env: list[Any] = [None] * slot_count
                for slot, value in zip(inputs, args, strict=True):
                    env[slot] = value
                _execute(parts, env)
                result = tuple(env[slot] for slot in outputs)
            return result

        return launch, inputs, outputs, name

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

    def run(self, env: list[Any], pass_plan: PassPlan | None = None) -> Any:
        """Run the program over ``env``; launchers whose buckets are keyed on KV length read ``pass_plan``'s
        longest one (without a plan they take the buckets without the key)."""
        self.running.max_kv_len = 0 if pass_plan is None else pass_plan.max_kv_len
        try:
            _execute(self._program, env)
        finally:
            self.running.max_kv_len = 0
        return env[self.output_slot]

    def release(self, env: list[Any]) -> None:
        """Drops what runs wrote into ``env`` (intermediates and the output), keeping what was bound."""
        for slot in self._written:
            env[slot] = None

    def describe(self) -> str:
        info = self.device.info
        lines = [f"Poem plan on {info.key} ({info.name}): {len(self.regions)} regions, {len(self.steps)} kernels"]
        by_region: dict[str, list[Step]] = {}
        for step in self.steps:
            by_region.setdefault(step.region, []).append(step)
        block_at = {block.regions[0]: block for block in self.blocks}
        stack_at = {stack.blocks[0].regions[0]: stack for stack in self.stacks}
        for region in self.regions:
            stack = stack_at.get(region.label)
            if stack is not None:
                lines.append(
                    f"  {stack.label:<16} stack of {len(stack.blocks)} blocks -> one launch for the passes the "
                    "engine takes, else its blocks:"
                )
            block = block_at.get(region.label)
            if block is not None:
                lines.append(
                    f"  {block.label:<16} block of {len(block.regions)} regions -> one launch for the passes the "
                    "engine takes, else its regions:"
                )
            ops = " + ".join(op.kind for op in region.ops)
            lines.append(f"  {region.label:<16} {ops}")
            for step in by_region.get(region.label, []):
                how = "fused" if len(step.covers) > 1 else "primitive"
                if step.whole_region:
                    how = "whole region"
                elif step.fallback:
                    how = "cpu fallback"
                variant = f"[{step.variant}]" if step.variant else ""
                if step.buckets is not None:
                    variant = f"[default; {step.buckets.describe()}]"
                if step.kernel == "epilogue":
                    how += ", an eta program"  # the engine compiles eta here; catalogue kernels are its own code
                lines.append(f"      -> {step.kernel}{variant} ({how})")
        return "\n".join(lines)


def lower(
    graph: Graph,
    device: Device,
    fallback: Device | None = None,
    choose_variant: VariantChooser | None = None,
) -> Plan:
    """Partition ``graph`` and bind every region to ``device``'s kernels."""
    uses = graph.use_counts()
    regions = partition(graph)
    running = RunningPass()
    choose = choose_variant or (lambda kernel: None)
    tag_sizes = Counter(op.tag for op in graph.ops)
    steps: list[Step] = []
    blocks: list[Block] = []
    block_ops: dict[str, list[Op]] = {}
    for name, run in _block_runs(regions):
        start = len(steps)
        for region in run:
            request = region_request(region, uses, graph.output)
            # a description is of all the ops of its tag: a region with only some of them is not what it says
            if all(op.tag == region.label for op in region.ops) and len(region.ops) == tag_sizes[region.label]:
                request = replace(request, attention_input=graph.attention_inputs.get(region.label),
                                  attention=graph.attentions.get(region.label))
            launcher = device.compile_region(request)
            if launcher is not None:
                covers = tuple(op.kind for op in region.ops)
                steps.append(
                    Step(region.label, "region", None, covers, request.inputs, request.outputs, launcher, request)
                )
                continue
            steps.extend(_lower_region(region, device, fallback, uses, choose, running))
        if name:
            block_ops[name] = [op for region in run for op in region.ops]
            request = replace(region_request(Region(name, block_ops[name]), uses, graph.output), layer=graph.layers.get(name))
            launcher = device.compile_block(request)
            if launcher is not None:
                blocks.append(Block(name, tuple(r.label for r in run), start, len(steps), launcher, request))
    stacks = [
        stack for run in _consecutive(blocks) if (stack := _offer_stack(run, block_ops, device, uses, graph.output))
    ]
    return Plan(graph, regions, steps, device, tuple(blocks), tuple(stacks), running)


def _consecutive(blocks: list[Block]) -> list[list[Block]]:
    """The blocks in runs of two or more with no step between them."""
    runs: list[list[Block]] = []
    for block in blocks:
        if runs and runs[-1][-1].stop == block.start:
            runs[-1].append(block)
        else:
            runs.append([block])
    return [run for run in runs if len(run) > 1]


def _offer_stack(
    run: list[Block], block_ops: Mapping[str, list[Op]], device: Device, uses: Mapping[str, int], graph_output: str
) -> Stack | None:
    label = f"{run[0].label}-{run[-1].label}"
    request = region_request(Region(label, [op for block in run for op in block_ops[block.label]]), uses, graph_output)
    launcher = device.compile_stack(request, tuple(block.request for block in run))
    return None if launcher is None else Stack(label, tuple(run), launcher, request)


def _block_runs(regions: list[Region]) -> list[tuple[str, list[Region]]]:
    """Consecutive regions grouped by the block all their ops are in ("" for regions in none)."""
    runs: list[tuple[str, list[Region]]] = []
    for region in regions:
        blocks = {op.block for op in region.ops}
        name = blocks.pop() if len(blocks) == 1 else ""
        if name and runs and runs[-1][0] == name:
            runs[-1][1].append(region)
        else:
            runs.append((name, [region]))
    return runs


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
    region: Region,
    device: Device,
    fallback: Device | None,
    uses: Mapping[str, int],
    choose_variant: VariantChooser,
    running: RunningPass,
) -> list[Step]:
    steps: list[Step] = []
    ops = region.ops
    i = 0
    while i < len(ops):
        for fusion in FUSIONS:
            window = ops[i : i + len(fusion.kinds)]
            if device.supports(fusion.kernel) and fusion.matches(window, uses):
                inputs, options = fusion.arguments(window)
                launcher, variant, buckets = _bind(device, fusion.kernel, options, choose_variant, running)
                covers = tuple(op.kind for op in window)
                request = KernelRequest(fusion.kernel, variant, tuple(sorted(options.items())))
                outputs = _names(window[-1].output)
                steps.append(
                    Step(
                        region.label,
                        fusion.kernel,
                        variant,
                        covers,
                        inputs,
                        outputs,
                        launcher,
                        request,
                        buckets=buckets,
                    )
                )
                i += len(window)
                break
        else:
            steps.append(_primitive(region.label, ops[i], device, fallback, choose_variant, running))
            i += 1
    return steps


def _bind(
    device: Device, kernel: str, options: Mapping[str, Any], choose_variant: VariantChooser, running: RunningPass
) -> tuple[Callable[..., Any], str | None, ShapeBuckets | None]:
    """The launcher of ``kernel``: one variant's own launcher, or a per-bucket dispatcher when the
    chooser picks different variants for different shapes (only then is a launch indirected)."""
    wanted = choose_variant(kernel)
    if isinstance(wanted, ShapeBuckets):
        buckets = wanted.restricted(device.kernels()[kernel])
        default = device.compile(kernel, None, **options)
        if not buckets.entries:
            return default, None, None
        launchers = {variant: device.compile(kernel, variant, **options) for variant in buckets.variants()}
        return bucketed_launcher(kernel, buckets, launchers, default, running), None, buckets
    variant = wanted if wanted is not None and device.supports(kernel, wanted) else None
    return device.compile(kernel, variant, **options), variant, None


def _primitive(
    label: str, op: Op, device: Device, fallback: Device | None, choose_variant: VariantChooser, running: RunningPass
) -> Step:
    if device.supports(op.kind):
        launcher, variant, buckets = _bind(device, op.kind, op.option_dict, choose_variant, running)
        request = KernelRequest(op.kind, variant, op.options)
        return Step(
            label, op.kind, variant, (op.kind,), op.inputs, _names(op.output), launcher, request, buckets=buckets
        )
    if op.kind in POOL_KERNELS or fallback is None or not fallback.supports(op.kind):
        raise EngineError(f"engine {device.name!r} does not implement {op.kind!r} and it cannot run elsewhere")
    host_launcher = fallback.compile(op.kind, None, **op.option_dict)
    request = KernelRequest(op.kind, None, op.options)
    launcher = _across(device, host_launcher)
    return Step(label, op.kind, None, (op.kind,), op.inputs, _names(op.output), launcher, request, fallback=fallback.name)


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
