"""A tiny random Llama on the CPU engine, small enough for thousands of requests in seconds."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
from pie.model.config import ModelConfig
from pie.plugins import Device, EngineRegistry
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.testing.models import random_weights, tiny_config
from threadpoolctl import threadpool_limits

RunnerFactory = Callable[..., ModelRunner]


@pytest.fixture(autouse=True)
def _one_blas_thread() -> Iterator[None]:
    # Many tiny GEMMs: threads only add contention (and noise) on a shared machine.
    with threadpool_limits(1):
        yield


@pytest.fixture(scope="session")
def cpu() -> Device:
    return EngineRegistry().select("cpu")[0]


@pytest.fixture(scope="session")
def tiny_model() -> tuple[ModelConfig, dict[str, np.ndarray]]:
    config = tiny_config(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16)
    weights = random_weights(config, seed=1)
    # Spread the logits so greedy choices are never near-ties that float rounding could flip.
    weights["lm_head.weight"] *= 20
    return config, weights


@pytest.fixture
def make_runner(cpu: Device, tiny_model: tuple[ModelConfig, dict[str, np.ndarray]]) -> RunnerFactory:
    config, weights = tiny_model

    def make(pages: int, page_size: int = 4) -> ModelRunner:
        return ModelRunner(config, weights.items(), cpu, page_size=page_size, max_cached_tokens=pages * page_size)

    return make


@pytest.fixture
def greedy_alone() -> Callable[[ModelRunner, list[int], int], list[int]]:
    return _greedy_alone


def _greedy_alone(runner: ModelRunner, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens for one request run by itself, one forward pass per step, no scheduler."""
    seq = runner.new_sequence()
    out: list[int] = []
    logits = runner.step([SequenceWork(seq, prompt)])[0]
    while True:
        out.append(int(np.argmax(logits)))
        if len(out) == max_tokens:
            break
        logits = runner.step([SequenceWork(seq, [out[-1]])])[0]
    seq.free()
    return out
