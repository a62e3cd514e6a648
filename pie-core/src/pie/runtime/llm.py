"""A loaded model on a chosen engine: the object behind `pie run`, `pie bench` and the scheduler."""

from __future__ import annotations

import sys
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pie.contract import PageLayout
from pie.generation import Sampler, SamplingParams, StopMatcher
from pie.generation.sampling import TopTokens
from pie.model.config import ModelConfig
from pie.model.errors import ModelLoadError
from pie.model.loader import load_model
from pie.model.store import repair_hint, resolve_model
from pie.model.tokenizer import Tokenizer
from pie.models import architecture_of
from pie.plugins import Device, EngineError, EngineRegistry
from pie.probe_cache import ProbeCache
from pie.poem.graph import LogitEpilogue
from pie.profiles import variant_chooser
from pie.runtime.kv_cache import SequencePages
from pie.runtime.model_runner import ModelRunner, SequenceWork, check_kv_dtype
from pie.weights import Dtype, Weight, row_bytes, weight_type

if TYPE_CHECKING:  # a grammar's matcher is made by its caller; llguidance is imported only then
    from pie.generation.constraints import Matcher

DEFAULT_PREFILL_CHUNK = 512


@dataclass(frozen=True)
class MemoryUse:
    """What a loaded model holds on its device, in bytes (``pie run --verbose`` and ``pie bench`` print it)."""

    weight_bytes: int
    """The weights as uploaded: each in its stored type, or in the type it was converted to at load."""
    loaded_weight_bytes: int
    """The same weights as the model's files store them."""
    kv_bytes: int
    kv_tokens: int
    kv_dtype: str = "float32"

    def describe(self) -> str:
        return (f"memory: weights {self.weight_bytes / 1e6:.1f} MB ({self.loaded_weight_bytes / 1e6:.1f} MB in the "
                f"model's files); KV cache {self.kv_bytes / 1e6:.1f} MB ({self.kv_tokens} tokens of {self.kv_dtype})")


class _LoadedWeights:
    """Passes a loader's weights on, noting each one's name, type, shape and bytes as it goes by."""

    def __init__(self, weights: Iterator[tuple[str, Weight]]):
        self._weights = weights
        self.seen: list[tuple[str, str, tuple[int, int], int]] = []

    def __iter__(self) -> Iterator[tuple[str, Weight]]:
        for name, weight in self._weights:
            shape = weight.shape if len(weight.shape) == 2 else (1, weight.shape[0])
            self.seen.append((name, weight_type(weight), (int(shape[0]), int(shape[1])), int(weight.nbytes)))
            yield name, weight

    def memory_use(self, runner: ModelRunner, file_bytes: int) -> MemoryUse:
        """The weights' bytes as uploaded: a converted weight's elements in its new type; a tied LM head
        counts again when it was uploaded in another type than the embedding. ``file_bytes``: the same
        weights as the model's files store them (``--dtype`` may have converted them before they came here)."""
        choices, uploaded = runner.weight_choices, 0
        architecture = architecture_of(runner.config)
        for name, stored, (rows, cols), nbytes in self.seen:
            target = choices[architecture.poem_name(name)].uploaded
            uploaded += nbytes if target == stored else rows * row_bytes(target, cols)
            tied = name == "model.embed_tokens.weight" and runner.config.tie_word_embeddings
            if tied and choices["w.lm_head"].uploaded != choices["w.embed"].uploaded:
                uploaded += rows * row_bytes(choices["w.lm_head"].uploaded, cols)
        layout = runner.layout
        return MemoryUse(uploaded, file_bytes, layout.num_pages * layout.page_bytes,
                         layout.num_pages * layout.page_size, layout.dtype)


class ContextLengthExceeded(ValueError):
    """A prompt plus the tokens asked for would not fit in the model's context (or in the KV pool)."""

    def __init__(self, prompt_tokens: int, max_tokens: int, limit: int, what: str = "the model's context"):
        super().__init__(
            f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) is {prompt_tokens + max_tokens} "
            f"tokens, more than {what} of {limit} tokens"
        )
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.limit = limit


def kv_bytes_per_token(config: ModelConfig, kv_dtype: str = "float32") -> int:
    return PageLayout(config.num_layers, 1, 1, config.num_kv_heads, config.head_dim, kv_dtype).page_bytes


def _check_kv_fits(device: Device, config: ModelConfig, tokens: int, kv_dtype: str) -> None:
    """A KV cache larger than the device's whole memory is refused before anything is allocated (the engine's own
    failure would come later, in its own words, or as a MemoryError)."""
    memory, needed = device.info.memory_bytes, tokens * kv_bytes_per_token(config, kv_dtype)
    if memory and needed > memory:
        raise ValueError(f"not enough memory for a KV cache of {tokens} tokens: it needs {needed / 2**30:.1f} GiB "
                         f"of {kv_dtype}, and {device.info.key} ({device.info.name}) has {memory / 2**30:.1f} GiB")


def encode_prompt(tokenizer: Tokenizer, prompt: str, chat: bool) -> list[int]:
    """The prompt as token ids, as user text: a control token's spelling in it stays plain characters."""
    if chat and tokenizer.chat_template:
        return tokenizer.encode_chat([{"role": "user", "content": prompt}])
    return tokenizer.encode_text(prompt)


def kv_tokens_within(config: ModelConfig, memory_bytes: int, share: float, kv_dtype: str = "float32") -> int:
    """Tokens of KV cache of ``kv_dtype`` that fit in ``share`` of ``memory_bytes`` (at least one page's worth)."""
    return max(int(memory_bytes * share) // kv_bytes_per_token(config, kv_dtype), 16)


def kv_tokens_bindable(config: ModelConfig, layer_bytes: int, page_size: int, kv_dtype: str = "float32") -> int:
    """Tokens of KV cache of ``kv_dtype``, in whole pages of ``page_size``, whose one layer takes at most
    ``layer_bytes`` (an engine's ``pie_max_page_pool_layer_bytes``); 0 where not even a page fits."""
    page = PageLayout(config.num_layers, 1, page_size, config.num_kv_heads, config.head_dim, kv_dtype).layer_bytes
    return layer_bytes // page * page_size


@dataclass(frozen=True)
class _PoolBound:
    """What an engine bounds of a page pool, as the most bytes of one layer's pages (a bound on the whole pool is
    that divided among the layers), and how to say it."""

    layer_bytes: int
    capped: str
    """Why a KV cache the runtime sized was made smaller."""
    holds: str
    """What the device holds at most, in the refusal of a KV cache asked for."""


def _pool_bound(device: Device, config: ModelConfig) -> _PoolBound | None:
    """The tighter of the engine's bounds on one layer of a page pool (``pie_max_page_pool_layer_bytes``: Vulkan and
    WebGPU bind a layer's pages as one buffer range) and on the whole pool (``pie_max_page_pool_bytes``: they hold it
    in one buffer); None where it states neither."""
    key, bounds = device.info.key, []
    layer_limit, pool_limit = device.max_page_pool_layer_bytes(), device.max_page_pool_bytes()
    if layer_limit is not None:
        bounds.append(_PoolBound(layer_limit, f"capped so that one layer of its pages fits the {layer_limit} bytes "
                                 f"{key} binds at once", f"binds at most {layer_limit} bytes of one layer's pages"))
    if pool_limit is not None:
        bounds.append(_PoolBound(pool_limit // config.num_layers, f"capped so that its pages fit the {pool_limit} "
                                 f"bytes of one buffer of {key}", f"holds at most {pool_limit} bytes of pages in "
                                 "one buffer"))
    return min(bounds, key=lambda bound: bound.layer_bytes) if bounds else None


def _cap_to_binding(config: ModelConfig, tokens: int, page_size: int, bound: _PoolBound,
                    kv_dtype: str) -> tuple[int, str]:
    """``tokens`` of KV cache, fewer where their pages would be more than the engine holds (``bound``), and why in
    words (empty where they fit)."""
    bindable = kv_tokens_bindable(config, bound.layer_bytes, page_size, kv_dtype)
    if not 0 < bindable < tokens:  # none fits: _check_kv_bindable says so
        return tokens, ""
    return bindable, bound.capped


def _check_kv_bindable(device: Device, config: ModelConfig, tokens: int, page_size: int, bound: _PoolBound,
                       kv_dtype: str) -> None:
    """A KV cache of ``tokens`` whose pages the engine cannot hold (``bound``) is refused before the weights load:
    where it cannot bind a layer of them, its kernels would fail at every step (``pie serve`` would say it is ready,
    then answer every request with an error)."""
    bindable = kv_tokens_bindable(config, bound.layer_bytes, page_size, kv_dtype)
    if tokens <= bindable:
        return
    most = f"at most {bindable} tokens fit" if bindable else f"not even one page of {page_size} fits"
    raise ValueError(f"a KV cache of {tokens} tokens of {kv_dtype} does not fit engine {device.name!r} on "
                     f"{device.info.key} ({device.info.name}), which {bound.holds}: {most}")


class LLM:
    """One model bound to one device."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        engine_reason: str = "",
        profile_reason: str = "",
        memory: MemoryUse | None = None,
        dtype_conversions: Mapping[str, tuple[str, str]] | None = None,
        kv_cap: str = "",
    ):
        self.runner = runner
        self.tokenizer = tokenizer
        self.engine_reason = engine_reason
        self.profile_reason = profile_reason
        """Which device profile chose the kernel variants, and why (see `pie profile show`)."""
        self.memory = memory
        """What the model holds on its device, where :meth:`load` made it."""
        self.dtype_conversions = dict(dtype_conversions or {})
        """The matrices ``--dtype`` converted while loading: ``{name: (type in the files, type loaded)}``."""
        self.kv_cap = kv_cap
        """Why :meth:`load` made the KV cache smaller than it would have (the engine's bound on a layer of its
        pages or on the whole pool), in words; empty where it did not."""

    @classmethod
    def load(
        cls,
        model: str | None = None,
        engine: str | None = None,
        *,
        registry: EngineRegistry | None = None,
        page_size: int = 16,
        max_cached_tokens: int | Callable[[ModelConfig], int] | None = None,
        kv_memory_share: float | None = None,
        logit_epilogue: LogitEpilogue | None = None,
        sequence_tokens: Callable[[Tokenizer], int] | None = None,
        kv_dtype: str = "float32",
        dtype: Dtype = "auto",
    ) -> LLM:
        """``max_cached_tokens`` sizes the KV pool in tokens, or says it from the model's config once that is read (a
        callable, which may refuse what the caller asks of the model with a ValueError). Without it, the pool takes
        ``kv_memory_share`` of the device's memory when that is given (a server's many sequences); else it holds one
        sequence of ``sequence_tokens(tokenizer)`` tokens when the caller knows that (`pie run`: its prompt and
        ``--max-tokens``), or of the model's whole context, or what a quarter of the device's memory holds when that
        is less.

        Sizing the pool to the one sequence keeps the memory it touches small: each layer's pages lie in
        their own stretch of the pool, and a first write there maps a whole huge page of it.

        Where the engine bounds one layer of a pool (``pie_max_page_pool_layer_bytes``: Vulkan and WebGPU bind
        a layer's pages as one buffer range) or the whole pool (``pie_max_page_pool_bytes``: they hold it in one
        buffer), a pool sized here is capped to fit, and :attr:`kv_cap` says so; a ``max_cached_tokens`` that does
        not fit is refused (ValueError naming the most that does).

        ``kv_dtype`` is the KV pages' element type (``--kv-dtype``); an engine that does not list it in
        ``pie_kv_dtypes`` is refused (EngineError) before the model loads. ``dtype`` (``--dtype``) loads the
        matrices in that float type (see :func:`pie.model.loader.load_model`)."""
        if isinstance(max_cached_tokens, int) and max_cached_tokens < 1:
            raise ValueError(f"the KV cache needs room for at least one token, not {max_cached_tokens}")
        if kv_memory_share is not None and not 0 < kv_memory_share < 1:
            raise ValueError(f"the KV cache's share of memory must be between 0 and 1, not {kv_memory_share}")
        registry = registry or EngineRegistry(probe_cache=ProbeCache())
        device, reason = registry.select(engine)
        check_kv_dtype(device, kv_dtype)
        fallback = _cpu_fallback(registry, device)
        try:
            loaded = load_model(resolve_model(model), dtype)
        except ModelLoadError as exc:
            hint = repair_hint(model)
            if not hint:
                raise
            raise ModelLoadError(f"{exc}{hint}") from exc
        if callable(max_cached_tokens):
            max_cached_tokens = max_cached_tokens(loaded.config)
        bound = _pool_bound(device, loaded.config)
        kv_cap = ""
        if max_cached_tokens is None:
            # memory 0: the engine does not know it (WebGPU does not say); one whole sequence's worth then, which
            # --kv-tokens overrides (sized from 0 bytes, the pool held 16 tokens)
            memory = device.info.memory_bytes
            context = loaded.config.max_position_embeddings
            if kv_memory_share is not None:  # no more than many whole-context sequences at once would use
                max_cached_tokens = min(
                    kv_tokens_within(loaded.config, memory, kv_memory_share, kv_dtype), 256 * context
                ) if memory else context
            else:
                if sequence_tokens is not None:
                    context = min(context, max(sequence_tokens(loaded.tokenizer), 1))
                max_cached_tokens = min(context, kv_tokens_within(loaded.config, memory, 0.25, kv_dtype)) \
                    if memory else context
            if bound is not None:
                max_cached_tokens, kv_cap = _cap_to_binding(loaded.config, max_cached_tokens, page_size, bound,
                                                             kv_dtype)
        if bound is not None:
            _check_kv_bindable(device, loaded.config, max_cached_tokens, page_size, bound, kv_dtype)
        _check_kv_fits(device, loaded.config, max_cached_tokens, kv_dtype)
        chooser, profile_reason = variant_chooser(device)
        weights = _LoadedWeights(loaded.stored_tensors())
        runner = ModelRunner(
            loaded.config,
            weights,
            device,
            page_size=page_size,
            max_cached_tokens=max_cached_tokens,
            fallback=fallback,
            choose_variant=chooser,
            logit_epilogue=logit_epilogue,
            kv_dtype=kv_dtype,
        )
        use = weights.memory_use(runner, loaded.file_weight_bytes())
        return cls(runner, loaded.tokenizer, reason, profile_reason, use, loaded.conversions(), kv_cap)

    @property
    def device(self) -> Device:
        return self.runner.device

    @property
    def context_length(self) -> int:
        """Most tokens (prompt and output together) one sequence may hold."""
        return self.runner.config.max_position_embeddings

    @property
    def kv_capacity_tokens(self) -> int:
        return self.runner.pages.num_pages * self.runner.page_size

    @property
    def max_sequence_tokens(self) -> int:
        """Most tokens (prompt and output together) one sequence may hold here: the model's context, or less where
        the KV cache holds less (plus the last token, which is sampled and never needs its KV)."""
        return min(self.context_length, self.kv_capacity_tokens + 1)

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise ContextLengthExceeded unless the prompt and ``max_tokens`` more fit the context and the KV pool."""
        if prompt_tokens + max_tokens > self.context_length:
            raise ContextLengthExceeded(prompt_tokens, max_tokens, self.context_length)
        if prompt_tokens + max_tokens > self.max_sequence_tokens:  # the KV cache holds less than the context
            raise ContextLengthExceeded(prompt_tokens, max_tokens, self.kv_capacity_tokens, "the whole KV cache")

    def encode_prompt(self, prompt: str, chat: bool) -> list[int]:
        """The prompt as token ids, as user text (see :func:`encode_prompt`)."""
        return encode_prompt(self.tokenizer, prompt, chat)

    def generate_tokens(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        max_tokens: int = 128,
        stop_token_ids: Sequence[int] | None = None,
        constraint: Matcher | None = None,
    ) -> Generator[int, None, None]:
        """Stream token ids for one prompt (batch of one; the scheduler batches many). Closing the stream
        early frees the sequence's pages. An empty prompt is refused by ``prefill``; one that cannot fit
        with ``max_tokens`` more raises ContextLengthExceeded before anything runs.

        A ``constraint`` (a matcher, see :mod:`pie.generation.constraints`) masks every token and advances
        with it; the stream ends where its grammar is complete, or at ``max_tokens`` (then the matcher
        says whether the output is whole: ``constraint.is_accepting``)."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, not {max_tokens}")
        self.check_fits(len(prompt_ids), max_tokens)
        sampler = Sampler(sampling)
        stops = set(self.tokenizer.eos_token_ids if stop_token_ids is None else stop_token_ids)
        if constraint is not None:
            stops |= constraint.end_token_ids
        # Without a grammar the device picks the candidates the sampler needs, not every logit.
        top = 0 if constraint is not None else sampler.top_tokens_needed(self.runner.config.vocab_size)
        sequence = self.runner.new_sequence()
        try:
            logits: np.ndarray | TopTokens = self.prefill(sequence, prompt_ids)
            for produced in range(max_tokens):
                if constraint is not None:
                    assert isinstance(logits, np.ndarray)
                    logits = constraint.mask(logits)
                token = sampler.sample(logits)
                if constraint is not None:
                    constraint.accept(token)
                if token in stops:
                    return
                yield token
                if produced + 1 == max_tokens or (constraint is not None and constraint.is_finished):
                    return
                work = [SequenceWork(sequence, [token])]
                logits = self.runner.step_top(work, top)[0] if top else self.runner.step(work)[0]
        finally:
            sequence.free()

    def prefill(self, sequence: SequencePages, prompt_ids: Sequence[int]) -> np.ndarray:
        """Run the prompt into the sequence's KV cache, DEFAULT_PREFILL_CHUNK tokens a pass as the
        scheduler does, and return the logits of its last token."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        tokens, chunk = list(prompt_ids), DEFAULT_PREFILL_CHUNK
        for start in range(0, len(tokens), chunk):
            last = start + chunk >= len(tokens)
            logits = self.runner.step([SequenceWork(sequence, tokens[start : start + chunk], logits=last)])
        return logits[0]

    def generate(
        self,
        prompt: str,
        *,
        chat: bool = True,
        sampling: SamplingParams | None = None,
        max_tokens: int = 128,
        stop: Sequence[str] = (),
        constraint: Matcher | None = None,
    ) -> Iterator[str]:
        """Stream text; never splits a UTF-8 character, never shows a stop string. A ``constraint`` as for
        :meth:`generate_tokens`."""
        decoder = self.tokenizer.stream_decoder()
        matcher = StopMatcher(stop)
        prompt_ids = self.encode_prompt(prompt, chat)
        for token in self.generate_tokens(prompt_ids, sampling, max_tokens, constraint=constraint):
            piece = matcher.push(decoder.push(token))
            if piece:
                yield piece
            if matcher.stopped:
                return
        tail = matcher.push(decoder.flush()) + matcher.flush()
        if tail:
            yield tail


def _cpu_fallback(registry: EngineRegistry, device: Device) -> Device | None:
    """The CPU engine's device for the kernels ``device`` lacks; the line is printed only when it lacks one."""
    try:
        return registry.fallback_for(device)
    except EngineError as exc:
        print(f"pie: no CPU fallback ({exc}); every kernel must run on {device.name}", file=sys.stderr)
        return None
