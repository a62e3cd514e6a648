"""Whole models on an engine against the CPU engine, for any engine's test suite::

    from pie.testing.model_parity import ModelParitySuite

    class TestMyEngineModels(ModelParitySuite):
        engine = "foo"

A random model of each architecture (`pie.models.ARCHITECTURES`, shaped by `pie.testing.models.tiny_config`:
sliding windows shorter than the prompts, soft-caps that bite) must give the CPU engine's logits through a
ragged prefill over several pages and five batched decode steps, with every kernel on the engine; the slow test
runs SmolLM2-135M end to end through ``LLM`` and compares 8 greedy tokens. An engine that records
its queue submissions adds :class:`OneSubmissionPerPass`; :class:`KQuantModelParity` runs a K-quant GGUF;
:class:`NarrowKVModelParity` runs a model over each KV page type the engine lists.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from pie.model.config import ModelConfig
from pie.models import ARCHITECTURES
from pie.plugins import Device, EngineRegistry
from pie.poem.graph import build_decoder_graph
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.testing.models import make_k_quant_model, random_weights, tiny_config
from pie.weights import Weight


def small_runner(
    device: Device, config: ModelConfig, tensors: list[tuple[str, Weight]], page_size: int = 4,
    kv_dtype: str = "float32",
) -> ModelRunner:
    return ModelRunner(config, tensors, device, page_size=page_size, max_cached_tokens=256, kv_dtype=kv_dtype)


class ModelParitySuite:
    """Subclass with ``engine = "name"``; ``greedy_tokens`` is how far SmolLM2's greedy text is compared."""

    engine: ClassVar[str] = ""
    greedy_tokens: ClassVar[int] = 8

    @pytest.fixture(scope="class")
    @classmethod
    def registry(cls) -> EngineRegistry:
        return EngineRegistry()

    @pytest.mark.parametrize("architecture", list(ARCHITECTURES))
    def test_random_model_logits_match_the_cpu_engine(self, registry: EngineRegistry, architecture: str) -> None:
        config = tiny_config(architecture)
        device = registry.engine(self.engine).open(0)
        lacking = sorted({op.kind for op in build_decoder_graph(config).ops if not device.supports(op.kind)})
        if lacking:
            pytest.skip(f"the {self.engine} engine has no {', '.join(lacking)} kernel, which {architecture} needs")
        tensors = list(random_weights(config, seed=3).items())
        cpu = small_runner(registry.engine("cpu").open(0), config, tensors)
        other = small_runner(device, config, tensors)
        assert not any(step.fallback for step in other.plan.steps), "every kernel runs on the engine"
        rng = np.random.default_rng(7)
        # 11 and 6 prompt tokens over pages of 4: both sequences span several pages.
        prompts = [[int(t) for t in rng.integers(0, config.vocab_size, n)] for n in (11, 6)]
        cpu_seqs, seqs = [cpu.new_sequence() for _ in prompts], [other.new_sequence() for _ in prompts]
        expected = cpu.step([SequenceWork(s, p) for s, p in zip(cpu_seqs, prompts, strict=True)])
        got = other.step([SequenceWork(s, p) for s, p in zip(seqs, prompts, strict=True)])
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4, err_msg="prefill")
        for step in range(5):
            tokens = [int(np.argmax(row)) for row in expected]
            expected = cpu.step([SequenceWork(s, [t]) for s, t in zip(cpu_seqs, tokens, strict=True)])
            got = other.step([SequenceWork(s, [t]) for s, t in zip(seqs, tokens, strict=True)])
            np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4, err_msg=f"decode step {step}")
        assert seqs[0].length == 16 and len(seqs[0].pages) == 4
        other.close()

    @pytest.mark.slow
    def test_smollm2_greedy_tokens_match_the_cpu_engine(self, registry: EngineRegistry) -> None:
        """The real model end to end through LLM (model store, Poem plan, scheduler-free generation)."""
        from pie.model.store import resolve_model
        from pie.runtime.llm import LLM

        path = str(resolve_model(None))
        results = []
        for name in ("cpu", self.engine):
            llm = LLM.load(path, name, registry=registry, max_cached_tokens=256)
            assert llm.device.name == name
            prompt = llm.encode_prompt("The capital of France is", chat=False)
            results.append(list(llm.generate_tokens(prompt, max_tokens=self.greedy_tokens, stop_token_ids=())))
            llm.runner.close()
        assert len(results[0]) == self.greedy_tokens
        assert results[1] == results[0]


class OneSubmissionPerPass:
    """Mixin beside :class:`ModelParitySuite` for engines that submit a whole forward pass to their
    device queue at once; define ``submissions(device)``, the count the engine has made so far."""

    engine: ClassVar[str] = ""

    def submissions(self, device: Device) -> int:
        raise NotImplementedError

    def test_a_forward_pass_is_one_submission(self, registry: EngineRegistry) -> None:
        config = tiny_config()
        device = registry.engine(self.engine).open(0)
        runner = small_runner(device, config, list(random_weights(config).items()))
        sequence = runner.new_sequence()
        runner.step([SequenceWork(sequence, [1, 2, 3])])
        before = self.submissions(device)
        runner.step([SequenceWork(sequence, [4])])
        assert self.submissions(device) - before == 1, f"{len(runner.plan.steps)} launches should share one submission"
        runner.close()


def greedy_tokens(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Each prompt's greedy continuation of ``steps`` tokens, the prompts prefilled and decoded as one batch."""
    sequences = [runner.new_sequence() for _ in prompts]
    logits = runner.step([SequenceWork(s, p) for s, p in zip(sequences, prompts, strict=True)])
    chosen: list[list[int]] = [[] for _ in prompts]
    for _ in range(steps):
        tokens = [int(np.argmax(row)) for row in logits]
        for continuation, token in zip(chosen, tokens, strict=True):
            continuation.append(token)
        logits = runner.step([SequenceWork(s, [t]) for s, t in zip(sequences, tokens, strict=True)])
    return chosen


class NarrowKVModelParity:
    """Mixin: a random SmolLM2-shaped (Llama) model gives the same 16 greedy tokens with its KV pages in
    float16 as in float32, on the engine, prefill and decode batched over several pages; in bfloat16, logits
    near float32's (its 8 bits of mantissa may flip a near tie of the random model's logits)."""

    engine: ClassVar[str] = ""

    def test_greedy_tokens_with_float16_kv_equal_float32_kv(self) -> None:
        device = EngineRegistry().engine(self.engine).open(0)
        narrow = [dtype for dtype in device.kv_dtypes() if dtype != "float32"]
        if not narrow:
            pytest.skip(f"{self.engine} keeps KV pages in float32 only")
        config = tiny_config()
        tensors = list(random_weights(config, seed=11).items())
        rng = np.random.default_rng(13)
        prompts = [[int(t) for t in rng.integers(0, config.vocab_size, n)] for n in (11, 6)]
        runners = {dtype: small_runner(device, config, tensors, kv_dtype=dtype) for dtype in ("float32", *narrow)}
        try:
            expected = greedy_tokens(runners["float32"], prompts, 16)
            if "float16" in runners:
                assert greedy_tokens(runners["float16"], prompts, 16) == expected
            for dtype in narrow:
                got, wanted = (_forced_logits(runners[d], prompts, expected) for d in (dtype, "float32"))
                scale = float(np.abs(wanted).max())
                np.testing.assert_allclose(got, wanted, rtol=0, atol=2e-2 * scale, err_msg=f"logits with {dtype} KV")
        finally:
            for runner in runners.values():
                runner.close()


def _forced_logits(runner: ModelRunner, prompts: list[list[int]], continuations: list[list[int]]) -> np.ndarray:
    """The logits of every step of the prompts fed on with the given continuations (teacher forcing)."""
    sequences = [runner.new_sequence() for _ in prompts]
    steps = [runner.step([SequenceWork(s, p) for s, p in zip(sequences, prompts, strict=True)])]
    for position in range(len(continuations[0]) - 1):
        tokens = [continuation[position] for continuation in continuations]
        steps.append(runner.step([SequenceWork(s, [t]) for s, t in zip(sequences, tokens, strict=True)]))
    for sequence in sequences:
        sequence.free()
    return np.stack(steps)


class KQuantModelParity:
    """Mixin: a K-quant GGUF (``make_k_quant_model``: Q4_K, Q5_K and Q6_K matrices) gives on the engine the
    greedy tokens of its dequantized float32 copy. Weights the engine does not take as stored are converted
    at load; ``stored_types`` names the K-quants the engine keeps (none by default)."""

    engine: ClassVar[str] = ""
    stored_types: ClassVar[frozenset[str]] = frozenset()

    def test_k_quant_model_greedy_tokens_match_its_float32_copy(self, tmp_path: Path) -> None:
        from pie.model import load_model

        loaded = load_model(make_k_quant_model(tmp_path / "q4_k_m.gguf"))
        device = EngineRegistry().engine(self.engine).open(0)
        stored = small_runner(device, loaded.config, list(loaded.stored_tensors()))
        dense = small_runner(device, loaded.config, list(loaded.tensors()))
        choices = stored.weight_choices.values()
        assert {c.stored for c in choices} >= {"q4_k", "q5_k", "q6_k"}
        for choice in choices:
            kept = choice.stored in self.stored_types or choice.stored == "f32"
            assert choice.uploaded == (choice.stored if kept else "f32"), choice
        rng = np.random.default_rng(5)
        prompts = [[int(t) for t in rng.integers(0, loaded.config.vocab_size, n)] for n in (11, 6)]
        want = greedy_tokens(dense, prompts, 8)
        assert greedy_tokens(stored, prompts, 8) == want
        assert len({t for row in want for t in row}) > 2, "the continuation is not one repeated token"
        stored.close()
        dense.close()
