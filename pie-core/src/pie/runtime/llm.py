"""A loaded model on a chosen engine: the object behind `pie run`, `pie bench` and the scheduler."""

from __future__ import annotations

import sys
from collections.abc import Generator, Iterator, Sequence

import numpy as np

from pie.generation import Sampler, SamplingParams, StopMatcher
from pie.model.loader import load_model
from pie.model.store import resolve_model
from pie.model.tokenizer import Tokenizer
from pie.plugins import Device, EngineError, EngineRegistry
from pie.probe_cache import ProbeCache
from pie.poem.graph import LogitEpilogue
from pie.profiles import variant_chooser
from pie.runtime.kv_cache import SequencePages
from pie.runtime.model_runner import ModelRunner, SequenceWork

DEFAULT_PREFILL_CHUNK = 512


class LLM:
    """One model bound to one device."""

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, engine_reason: str = "", profile_reason: str = ""):
        self.runner = runner
        self.tokenizer = tokenizer
        self.engine_reason = engine_reason
        self.profile_reason = profile_reason
        """Which device profile chose the kernel variants, and why (see `pie profile show`)."""

    @classmethod
    def load(
        cls,
        model: str | None = None,
        engine: str | None = None,
        *,
        registry: EngineRegistry | None = None,
        page_size: int = 16,
        max_cached_tokens: int = 8192,
        logit_epilogue: LogitEpilogue | None = None,
    ) -> LLM:
        registry = registry or EngineRegistry(probe_cache=ProbeCache())
        device, reason = registry.select(engine)
        fallback = _cpu_fallback(registry, device)
        loaded = load_model(resolve_model(model))
        chooser, profile_reason = variant_chooser(device)
        runner = ModelRunner(
            loaded.config,
            loaded.tensors(),
            device,
            page_size=page_size,
            max_cached_tokens=max_cached_tokens,
            fallback=fallback,
            choose_variant=chooser,
            logit_epilogue=logit_epilogue,
        )
        return cls(runner, loaded.tokenizer, reason, profile_reason)

    @property
    def device(self) -> Device:
        return self.runner.device

    def encode_prompt(self, prompt: str, chat: bool) -> list[int]:
        if chat and self.tokenizer.chat_template:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(prompt)

    def generate_tokens(
        self,
        prompt_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        max_tokens: int = 128,
        stop_token_ids: Sequence[int] | None = None,
    ) -> Generator[int, None, None]:
        """Stream token ids for one prompt (batch of one; the scheduler batches many). Closing the stream
        early frees the sequence's pages. An empty prompt is refused by ``prefill``."""
        sampler = Sampler(sampling)
        stops = set(self.tokenizer.eos_token_ids if stop_token_ids is None else stop_token_ids)
        sequence = self.runner.new_sequence()
        try:
            logits = self.prefill(sequence, prompt_ids)
            for produced in range(max_tokens):
                token = sampler.sample(logits)
                if token in stops:
                    return
                yield token
                if produced + 1 == max_tokens:
                    return
                logits = self.runner.step([SequenceWork(sequence, [token])])[0]
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
    ) -> Iterator[str]:
        """Stream text; never splits a UTF-8 character, never shows a stop string."""
        decoder = self.tokenizer.stream_decoder()
        matcher = StopMatcher(stop)
        for token in self.generate_tokens(self.encode_prompt(prompt, chat), sampling, max_tokens):
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
