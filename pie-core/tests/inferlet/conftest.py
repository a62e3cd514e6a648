"""A tiny random Llama with the real (trained BPE) test tokenizer, and inferlet hosts over it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pie.inferlet import InferletHost, InferletMain, load_inferlet
from pie.model.tokenizer import Tokenizer
from pie.plugins import Device, EngineRegistry
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.scheduler import BatchScheduler, HostPagePool, Scheduler
from pie.testing.models import BOS_TOKEN_ID, CHAT_TEMPLATE, EOS_TOKEN_ID, random_weights, tiny_config, tiny_tokenizer
from threadpoolctl import threadpool_limits

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
PAGE_SIZE = 4


@pytest.fixture(autouse=True)
def _one_blas_thread() -> Iterator[None]:
    with threadpool_limits(1):
        yield


@pytest.fixture(scope="session")
def cpu() -> Device:
    return EngineRegistry().select("cpu")[0]


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer(
        tiny_tokenizer(), bos_token_id=BOS_TOKEN_ID, eos_token_ids=(EOS_TOKEN_ID,), chat_template=CHAT_TEMPLATE
    )


@pytest.fixture(scope="session")
def weights() -> dict[str, np.ndarray]:
    config = tiny_config(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)
    weights = random_weights(config, seed=3)
    weights["lm_head.weight"] *= 5  # clear greedy winners, yet sampling still varies
    return weights


@pytest.fixture
def make_runner(cpu: Device, weights: dict[str, np.ndarray]) -> Callable[[int], ModelRunner]:
    config = tiny_config(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)

    def make(pages: int = 256) -> ModelRunner:
        return ModelRunner(config, weights.items(), cpu, page_size=PAGE_SIZE, max_cached_tokens=pages * PAGE_SIZE)

    return make


@pytest.fixture
def make_host(make_runner: Callable[[int], ModelRunner], tokenizer: Tokenizer) -> Callable[..., InferletHost]:
    def make(pages: int = 256, host_pages: int = 64, timeout_s: float = 60.0) -> InferletHost:
        runner = make_runner(pages)
        host = HostPagePool.for_runner(runner, host_pages) if host_pages else None
        return InferletHost(Scheduler(BatchScheduler(runner, host)), tokenizer, timeout_s=timeout_s)

    return make


@pytest.fixture
def reference(make_runner: Callable[[int], ModelRunner]) -> ModelRunner:
    """A separate runner for computing expected values one sequence at a time."""
    return make_runner(256)


@pytest.fixture
def example() -> Callable[[str], InferletMain]:
    return lambda name: load_inferlet(EXAMPLES / f"{name}.py")


def all_logits(runner: ModelRunner, tokens: list[int]) -> np.ndarray:
    """Logits after every token of ``tokens`` in one fresh sequence."""
    seq = runner.new_sequence()
    rows = runner.step([SequenceWork(seq, tokens, all_logits=True)])
    seq.free()
    return rows


def greedy(runner: ModelRunner, context: list[int], count: int) -> list[int]:
    """``count`` greedy tokens after ``context``, computed alone."""
    seq = runner.new_sequence()
    logits = runner.step([SequenceWork(seq, context)])[0]
    out = []
    for _ in range(count):
        out.append(int(np.argmax(logits)))
        logits = runner.step([SequenceWork(seq, [out[-1]])])[0]
    seq.free()
    return out


@pytest.fixture
def helpers() -> Any:
    class Helpers:
        all_logits = staticmethod(all_logits)
        greedy = staticmethod(greedy)

    return Helpers
