"""Runs a model's lowered forward pass on one engine device over the paged KV cache."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import Protocol, TypeVar

import numpy as np

from pie.contract import KV_DTYPES, PageLayout
from pie.generation.sampling import TopTokens
from pie.model.config import ModelConfig
from pie.models import architecture_of
from pie.plugins import Device, EngineError
from pie.poem import Plan, build_decoder_graph, lower
from pie.poem.graph import POOL, LogitEpilogue
from pie.poem.lower import VariantChooser
from pie.runtime.kv_cache import SequencePages
from pie.runtime.page_pool import PagePool, PageReplicas
from pie.runtime.pass_plan import PassPlan
from pie.weights import Weight, WeightChoice, choose_weight_types, convert, describe_choices, readers_of, weight_type

I32 = np.int32
Result = TypeVar("Result")


@dataclass
class ForwardBatch:
    """One ragged forward pass, described FlashInfer-style (see :mod:`pie.kernels`)."""

    ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    qo_indptr: np.ndarray
    kv_page_indices: np.ndarray
    kv_page_indptr: np.ndarray
    kv_last_page_lens: np.ndarray
    sample_rows: np.ndarray

    def __post_init__(self) -> None:
        self.plan: PassPlan | None = None
        """The pass's plan, made by :meth:`ModelRunner.prepare` (a batch made from its arrays alone,
        as an XLA follower receives one, is planned when it runs)."""

    @property
    def num_tokens(self) -> int:
        return len(self.ids)


INPUTS = tuple(
    (f"in.{field}", field)
    for field in (
        "ids",
        "positions",
        "slots",
        "qo_indptr",
        "kv_page_indices",
        "kv_page_indptr",
        "kv_last_page_lens",
        "sample_rows",
    )
)
"""The plan's input names and the ``ForwardBatch`` fields that feed them."""


@dataclass
class SequenceWork:
    """New tokens for one sequence in a forward pass; ``logits`` says whether its last token is sampled.

    ``all_logits`` returns the logits after every new token (for scoring a continuation), not only the last.
    """

    pages: SequencePages
    tokens: Sequence[int]
    logits: bool = True
    all_logits: bool = False


class Replicas(PageReplicas, Protocol):
    """Other copies of a runner that run each of its device operations, in its order, before it does
    (the other processes of a multi-controller engine: :class:`pie.runtime.replicated.Leader`)."""

    def forward(self, batch: ForwardBatch, top: int | None) -> None:
        """A pass: :meth:`ModelRunner.forward_top` of ``top``, or :meth:`ModelRunner.forward` when None."""

    def watch(self, on_lost: Callable[[BaseException], object] | None) -> None:
        """Call ``on_lost`` (from any thread; None: no longer) as soon as a replica is gone for good, between
        operations too, with the error (a :class:`pie.plugins.DeviceLost`) that every later operation raises."""


def _layer_groups(weights: Iterable[tuple[str, Weight]]) -> Iterator[list[tuple[str, Weight]]]:
    """Consecutive weights of one layer as one group (each other weight alone): an engine may place
    a group in one allocation, and the loader's per-layer streaming bounds the memory held."""
    group: list[tuple[str, Weight]] = []
    group_layer: str | None = None
    for name, array in weights:
        layer = name.split(".")[1] if name.startswith("w.L") else None
        if group and (layer is None or layer != group_layer):
            yield group
            group = []
        group.append((name, array))
        group_layer = layer
        if layer is None:
            yield group
            group = []
    if group:
        yield group


def check_kv_dtype(device: Device, kv_dtype: str) -> None:
    """Raise EngineError unless ``device``'s engine keeps KV pages in ``kv_dtype``."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"KV pages hold {', '.join(KV_DTYPES)}, not {kv_dtype!r}")
    taken = device.kv_dtypes()
    if kv_dtype not in taken:
        raise EngineError(f"engine {device.name!r} keeps KV pages in {', '.join(taken)} only, not {kv_dtype}")


class ModelRunner:
    """A model bound to a device: weights uploaded, plan lowered, page pool allocated.

    ``tensors`` are float arrays or :class:`pie.weights.StoredWeight` (``LoadedModel.stored_tensors``):
    each weight is uploaded in its stored type where the kernels reading it take it, else converted
    (``weight_choices`` says which, ``pie plan`` prints it). The KV pages hold ``kv_dtype``, one of the
    engine's ``pie_kv_dtypes``.
    """

    def __init__(
        self,
        config: ModelConfig,
        tensors: Iterable[tuple[str, Weight]],
        device: Device,
        *,
        page_size: int = 16,
        max_cached_tokens: int = 8192,
        fallback: Device | None = None,
        choose_variant: VariantChooser | None = None,
        logit_epilogue: LogitEpilogue | None = None,
        kv_dtype: str = "float32",
    ):
        check_kv_dtype(device, kv_dtype)
        self.config = config
        self.device = device
        self.plan: Plan = lower(build_decoder_graph(config, logit_epilogue), device, fallback, choose_variant)
        self._env = self.plan.new_env()
        self._input_slots = tuple((self.plan.slots[name], field) for name, field in INPUTS if name in self.plan.slots)
        architecture = architecture_of(config)
        derived = architecture.derived_weights(config)
        for name, table in derived.items():
            self.plan.bind(self._env, name, device.upload(table))
        uploaded: dict[str, object] = {}
        readers, declared = readers_of(self.plan.steps), device.weight_types()
        self.weight_choices: dict[str, WeightChoice] = {}
        for group in _layer_groups(architecture.poem_weights(config, tensors)):
            names = [name for name, _ in group]
            choices = choose_weight_types(readers, {name: weight_type(w) for name, w in group}, declared)
            self.weight_choices.update(choices)
            tied = names == ["w.lm_head"] and "w.embed" in uploaded and config.tie_word_embeddings
            if tied and self.weight_choices["w.embed"].uploaded == choices["w.lm_head"].uploaded:
                tensors_on_device = [uploaded["w.embed"]]
            else:
                tensors_on_device = device.upload_weights([convert(w, choices[n].uploaded) for n, w in group])
            for name, tensor in zip(names, tensors_on_device, strict=True):
                uploaded[name] = tensor
                self.plan.bind(self._env, name, tensor)
        missing = [w for w in self.plan.graph.weights() if w not in uploaded and w not in derived]
        if missing:
            raise ValueError(f"the model provided no tensor for {', '.join(missing)}")
        num_pages = -(-max_cached_tokens // page_size)
        layout = PageLayout(config.num_layers, num_pages, page_size, config.num_kv_heads, config.head_dim, kv_dtype)
        self.pages = PagePool(device, layout)
        """The KV cache: its pages' memory on the device and who holds which (the scheduler's way in)."""
        self.plan.bind(self._env, POOL, self.pages.handle)
        self.replicas: Replicas | None = None
        """Where each pass and page operation goes before it runs here (:meth:`replicate_to`)."""

    @property
    def layout(self) -> PageLayout:
        return self.pages.layout

    @property
    def page_size(self) -> int:
        return self.pages.page_size

    def replicate_to(self, replicas: Replicas | None) -> None:
        """Send each pass and page read, write and copy to ``replicas`` before running it (None: stop),
        for an engine whose every process must launch the same programs in the same order."""
        self.replicas = self.pages.replicas = replicas

    def describe_weights(self) -> str:
        """The weights section of ``pie plan``: what goes as stored and what was converted at load."""
        return describe_choices(self.weight_choices)

    def new_sequence(self) -> SequencePages:
        return self.pages.new_sequence()

    def prepare(self, work: Sequence[SequenceWork]) -> ForwardBatch:
        """Reserve KV slots for every sequence's new tokens and describe the pass.

        Raises OutOfPages (nothing reserved for the failing sequence) when the pool is full.
        """
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        qo_indptr, page_indptr, page_indices, last_lens = [0], [0], [], []
        q_lens: list[int] = []
        kv_lens: list[int] = []
        for item in work:
            pages = item.pages
            start = pages.length
            slots += pages.append(len(item.tokens), self.pages.copy)
            ids += item.tokens
            positions += range(start, pages.length)
            qo_indptr.append(len(ids))
            q_lens.append(len(item.tokens))
            kv_lens.append(pages.length)
            page_indices += pages.pages
            page_indptr.append(len(page_indices))
            last_lens.append(pages.last_page_len)
            if item.all_logits:
                sample_rows += range(len(ids) - len(item.tokens), len(ids))
            elif item.logits:
                sample_rows.append(len(ids) - 1)
        # Lists turned into arrays once each: at batch 1 this runs right after the weights have swept the
        # caches, where every distinct numpy call costs several microseconds of cold code.
        batch = ForwardBatch(
            np.array(ids, I32),
            np.array(positions, I32),
            np.array(slots, I32),
            np.array(qo_indptr, I32),
            np.array(page_indices, I32),
            np.array(page_indptr, I32),
            np.array(last_lens, I32),
            np.array(sample_rows, I32),
        )
        max_q_len = max(q_lens, default=0)
        batch.plan = PassPlan(
            ids=batch.ids, positions=batch.positions, slots=batch.slots, qo_indptr=batch.qo_indptr,
            kv_page_indices=batch.kv_page_indices, kv_page_indptr=batch.kv_page_indptr,
            kv_last_page_lens=batch.kv_last_page_lens, sample_rows=batch.sample_rows, page_size=self.pages.page_size,
            q_lens=np.array(q_lens, I32), kv_lens=np.array(kv_lens, I32), max_q_len=max_q_len,
            max_kv_len=max(kv_lens, default=0), num_tokens=len(ids), decode_only=max_q_len == 1 and len(ids) == len(q_lens),
        )
        return batch

    def plan_of(self, batch: ForwardBatch) -> PassPlan:
        """``batch``'s plan: the one :meth:`prepare` made, else derived from its arrays."""
        if batch.plan is None:
            arrays = {f.name: getattr(batch, f.name) for f in fields(batch)}
            batch.plan = PassPlan.from_batch(**arrays, page_size=self.pages.page_size, num_pages=self.pages.num_pages)
        return batch.plan

    def forward(self, batch: ForwardBatch) -> np.ndarray:
        """Run the pass; returns host logits ``[len(batch.sample_rows), vocab]``. One pass at a time."""
        if self.replicas is not None:
            self.replicas.forward(batch, None)
        return self._run(batch, self.device.download, lambda: np.zeros((0, self.config.vocab_size), np.float32))

    def forward_top(self, batch: ForwardBatch, top: int) -> TopTokens:
        """Run the pass and read each sampled row's ``top`` most likely tokens on the device, rounded
        up to a power of two (so that few kernels compile): the argmax for ``top == 1``, the engine's
        ``top_k`` (with their logits) for more. Downloads those instead of every logit."""
        if not 0 < top <= self.config.vocab_size:
            raise ValueError(f"top must be in 1..{self.config.vocab_size} (the vocabulary size), got {top}")
        k = min(1 << (top - 1).bit_length(), self.config.vocab_size)
        if self.replicas is not None:
            self.replicas.forward(batch, top)

        def read(logits: object) -> TopTokens:
            return TopTokens(*self.device.top_tokens(logits, k))

        def empty() -> TopTokens:
            return TopTokens(np.zeros((0, k), I32), None if k == 1 else np.zeros((0, k), np.float32))

        return self._run(batch, read, empty)

    def _run(self, batch: ForwardBatch, read: Callable[[object], Result], empty: Callable[[], Result]) -> Result:
        """Run the pass and ``read`` its device logits into host memory (``empty()`` when no row is sampled).

        The pass runs in the environment that holds the weights, not in a copy of it: copying it, and
        dropping the copy after the pass, touched every weight's Python object twice a decode step, each
        a cache miss once the weights' data had swept the caches.
        """
        env = self._env
        device = self.device
        upload = device.upload
        plan = self.plan_of(batch)
        substitute_rows = None
        if len(batch.sample_rows) == 0:
            # Engines never see an empty gather: compute one row and drop it.
            substitute_rows = np.array([batch.num_tokens - 1], I32)
            plan = replace(plan, sample_rows=substitute_rows)
        device.begin_pass(plan)
        try:
            for slot, field in self._input_slots:
                env[slot] = upload(getattr(batch, field))
            if substitute_rows is not None:
                self.plan.bind(env, "in.sample_rows", upload(substitute_rows))
                device.download(self.plan.run(env, plan))
                return empty()
            return read(self.plan.run(env, plan))
        finally:
            device.end_pass()
            self.plan.release(env)
            for slot, _ in self._input_slots:
                env[slot] = None

    def step(self, work: Sequence[SequenceWork]) -> np.ndarray:
        return self.forward(self.prepare(work))

    def step_top(self, work: Sequence[SequenceWork], top: int) -> TopTokens:
        """:meth:`step`, reading each sampled row's ``top`` most likely tokens (:meth:`forward_top`)."""
        return self.forward_top(self.prepare(work), top)

    def close(self) -> None:
        self.pages.close()
