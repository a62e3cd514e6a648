"""Shared by the XLA engine's tests: run one random model on the CPU and XLA engines side by side."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pie.model.config import ModelConfig
from pie.plugins import EngineRegistry
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.testing.models import random_weights, tiny_config
from pie.weights import F32, WEIGHT_TYPES, StoredWeight, convert, quantize


def sharding_config(**overrides: object) -> ModelConfig:
    """A tiny Llama whose heads (8 query, 4 KV), MLP (128) and vocabulary divide over 1, 2 and 4 devices."""
    settings: dict[str, object] = {"num_heads": 8, "num_kv_heads": 4, "head_dim": 16, "num_layers": 2}
    settings.update(overrides)
    return tiny_config(**settings)  # type: ignore[arg-type]


@dataclass
class Comparison:
    """Logits of every step on both engines, and the runners (kept open for inspection)."""

    steps: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    runners: dict[str, ModelRunner] = field(default_factory=dict)

    @property
    def max_error(self) -> float:
        return max(float(np.abs(cpu - xla).max()) for cpu, xla in self.steps)

    def close(self) -> None:
        for runner in self.runners.values():
            runner.close()


def compare_engines(
    config: ModelConfig,
    prompt_lengths: tuple[int, ...] = (7, 3),
    decode_steps: int = 6,
    page_size: int = 4,
    fork: bool = False,
    seed: int = 0,
    weight_type: str = F32,
) -> Comparison:
    """Prefill a ragged batch, optionally fork the first sequence, then decode greedily (the CPU engine's
    tokens feed both engines, so one mismatch cannot snowball). Returns every step's logits.

    With ``weight_type``, every matrix is quantized to it: the XLA engine gets it as stored, the CPU engine
    its float32 dequantization."""
    weights = random_weights(config, seed)
    stored = {name: stored_copy(w, weight_type) for name, w in weights.items()}
    dense = {name: convert(w, F32) if isinstance(w, StoredWeight) else w for name, w in stored.items()}
    registry = EngineRegistry()
    result = Comparison()
    for name, tensors in (("cpu", dense), ("xla", stored)):
        result.runners[name] = ModelRunner(
            config, tensors.items(), registry.engine(name).open(0), page_size=page_size, max_cached_tokens=512
        )
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(0, config.vocab_size, n)] for n in prompt_lengths]
    sequences = {name: [runner.new_sequence() for _ in prompts] for name, runner in result.runners.items()}

    def step(tokens: list[list[int]]) -> None:
        logits = [
            result.runners[name].step([SequenceWork(s, t) for s, t in zip(sequences[name], tokens, strict=True)])
            for name in ("cpu", "xla")
        ]
        result.steps.append((logits[0], logits[1]))

    step(prompts)
    if fork:
        for seqs in sequences.values():
            seqs.append(seqs[0].fork())
    for _ in range(decode_steps):
        cpu_logits = result.steps[-1][0]
        tokens = [[int(np.argmax(row))] for row in cpu_logits]
        if fork and len(tokens) < len(sequences["cpu"]):
            tokens.append([(tokens[0][0] + 1) % config.vocab_size])  # the fork takes another branch
        step(tokens)
    return result


def stored_copy(weight: np.ndarray, weight_type: str) -> np.ndarray | StoredWeight:
    """A matrix quantized to ``weight_type`` where its rows are whole blocks; vectors stay float32."""
    if weight_type == F32 or weight.ndim != 2 or weight.shape[1] % WEIGHT_TYPES[weight_type][1]:
        return weight
    return quantize(weight, weight_type)


SMOLLM2_PROMPT = "The three primary colors are"
SMOLLM2_TOKENS = 16


def smollm2_workload(runner: ModelRunner, tokenizer: Any) -> tuple[list[int], np.ndarray]:
    """SmolLM2's greedy continuation of ``SMOLLM2_PROMPT`` on ``runner``, and the prompt's logits."""
    sequence = runner.new_sequence()
    logits = first = runner.step([SequenceWork(sequence, tokenizer.encode(SMOLLM2_PROMPT))])[0]
    tokens: list[int] = []
    for _ in range(SMOLLM2_TOKENS):
        tokens.append(int(np.argmax(logits)))
        logits = runner.step([SequenceWork(sequence, [tokens[-1]])])[0]
    return tokens, first


def smollm2_greedy(engine: str) -> tuple[list[int], np.ndarray]:
    """:func:`smollm2_workload` on ``engine`` in this process."""
    from pie.model.loader import load_model
    from pie.model.store import resolve_model

    model = load_model(resolve_model(None))
    runner = ModelRunner(model.config, model.tensors(), EngineRegistry().engine(engine).open(0), max_cached_tokens=256)
    try:
        return smollm2_workload(runner, model.tokenizer)
    finally:
        runner.close()


def pool_contents(runner: ModelRunner) -> np.ndarray:
    pages = np.arange(runner.layout.num_pages, dtype=np.int32)
    return np.asarray(runner.pages.read(pages))
