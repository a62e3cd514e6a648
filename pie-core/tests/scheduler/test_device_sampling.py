"""Sampling on the device: a step whose passes all sample greedily or from a top_k reads the argmax or the
engine's top_k and downloads those, not the logits, and draws the tokens the host path draws."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from pie.generation import Sampler, SamplingParams, TopTokens
from pie.model.config import ModelConfig
from pie.plugins import Device, EngineRegistry
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.scheduler.core import BatchScheduler, PassResult
from pie.scheduler.driver import Scheduler
from pie.scheduler.requests import generate

ENGINES = ("cpu", "xla", "vulkan", "wgpu")
PROMPTS = [[1, 5, 9, 2, 7], [3, 3, 8], [4, 11, 6, 2, 9, 10, 12]]


@pytest.fixture(scope="module", params=ENGINES)
def device(request: pytest.FixtureRequest) -> Device:
    registry = EngineRegistry()
    if request.param not in registry.names():
        pytest.skip(f"engine {request.param!r} is not installed")
    return registry.select(request.param)[0]


@pytest.fixture
def runner(device: Device, tiny_model: tuple[ModelConfig, dict[str, np.ndarray]]) -> Iterator[ModelRunner]:
    config, weights = tiny_model
    made = ModelRunner(config, weights.items(), device, page_size=4, max_cached_tokens=256)
    yield made
    made.close()


@pytest.fixture
def downloads(runner: ModelRunner, monkeypatch: pytest.MonkeyPatch) -> list[tuple[tuple[int, ...], str]]:
    """Shape and dtype of every array the runner's device downloads."""
    seen: list[tuple[tuple[int, ...], str]] = []
    device = runner.device
    download = device._download

    def counted(tensor: object) -> np.ndarray:
        array = download(tensor)
        seen.append((array.shape, array.dtype.name))
        return array

    monkeypatch.setattr(device, "_download", counted)
    return seen


def _host_tokens(runner: ModelRunner, prompt: list[int], sampling: SamplingParams, count: int) -> list[int]:
    """Tokens drawn on the host from every logit, one pass a step, no scheduler."""
    sampler = Sampler(sampling)
    seq = runner.new_sequence()
    logits = runner.step([SequenceWork(seq, prompt)])[0]
    tokens = []
    for _ in range(count):
        tokens.append(sampler.sample(logits))
        logits = runner.step([SequenceWork(seq, [tokens[-1]])])[0]
    seq.free()
    return tokens


def _scheduled_tokens(runner: ModelRunner, sampling: SamplingParams, count: int) -> list[list[int]]:
    scheduler = Scheduler(BatchScheduler(runner))

    async def run_all() -> list[list[int]]:
        return await asyncio.gather(
            *(generate(scheduler, prompt, max_tokens=count, sampling=sampling) for prompt in PROMPTS)
        )

    return asyncio.run(run_all())


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(),
        SamplingParams(temperature=0.9, top_k=5, seed=11),
        SamplingParams(temperature=1.2, top_k=3, min_p=0.02, seed=12),
    ],
    ids=["greedy", "top_k", "top_k_min_p"],
)
def test_device_sampling_draws_the_host_paths_tokens(
    runner: ModelRunner, downloads: list[tuple[tuple[int, ...], str]], sampling: SamplingParams
) -> None:
    expected = [_host_tokens(runner, prompt, sampling, 12) for prompt in PROMPTS]
    downloads.clear()
    assert _scheduled_tokens(runner, sampling, 12) == expected
    vocab = runner.config.vocab_size
    assert downloads, "nothing was downloaded"
    assert all(vocab not in shape for shape, _ in downloads), f"logits were downloaded: {set(downloads)}"
    if sampling.greedy:
        assert {dtype for _, dtype in downloads} == {"int32"}, "greedy steps download the argmax only"


def _submit(core: BatchScheduler, prompt: list[int], top: int, into: dict[int, PassResult]) -> None:
    def done(result: PassResult, error: BaseException | None) -> None:
        assert error is None, error
        into[len(into)] = result

    core.submit(core.new_sequence(), prompt, done, top=top)


def test_a_step_where_one_pass_needs_logits_downloads_logits_for_all(
    runner: ModelRunner, downloads: list[tuple[tuple[int, ...], str]]
) -> None:
    """The whole step falls back: the greedy pass gets logits too (Sampler.sample takes either)."""
    core = BatchScheduler(runner)
    results: dict[int, PassResult] = {}
    _submit(core, PROMPTS[0], 1, results)
    _submit(core, PROMPTS[1], 0, results)  # e.g. a request for logprobs
    core.step()
    vocab = runner.config.vocab_size
    assert downloads == [((2, vocab), "float32")]
    assert all(isinstance(result, np.ndarray) and result.shape == (vocab,) for result in results.values())

    downloads.clear()
    results.clear()
    _submit(core, PROMPTS[0], 1, results)
    _submit(core, PROMPTS[2], 5, results)
    core.step()
    assert downloads == [((2, 8), "int32"), ((2, 8), "float32")], "one top_k of 8 (5 rounded up) for both"
    greedy, sampled = results[0], results[1]
    assert isinstance(greedy, TopTokens) and isinstance(sampled, TopTokens)
    logits = runner.step([SequenceWork(runner.new_sequence(), PROMPTS[0])])[0]  # alone: rounded differently
    assert int(greedy.indices[0]) == int(np.argmax(logits))
    np.testing.assert_allclose(greedy.values, np.sort(logits)[::-1][:8], rtol=1e-5)


@pytest.mark.parametrize("device", [name for name in ENGINES if name != "cpu"], indirect=True)  # cpu is the host
def test_top_k_off_the_device_is_selected_on_the_host_alike(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine without ``top_k`` has its logits downloaded and the CPU engine select (same result)."""
    device = runner.device
    batch = runner.prepare([SequenceWork(runner.new_sequence(), prompt) for prompt in PROMPTS])
    logits = runner.forward(batch)
    on_device = runner.forward_top(runner.prepare([SequenceWork(runner.new_sequence(), p) for p in PROMPTS]), 8)
    monkeypatch.setattr(device, "_kernels", {k: v for k, v in device.kernels().items() if k != "top_k"})
    on_host = runner.forward_top(runner.prepare([SequenceWork(runner.new_sequence(), p) for p in PROMPTS]), 8)
    np.testing.assert_array_equal(on_host.indices, on_device.indices)
    np.testing.assert_array_equal(on_host.values, on_device.values)
    np.testing.assert_array_equal(on_host.values, np.sort(logits, axis=-1)[:, ::-1][:, :8])


def test_forward_top_refuses_more_tokens_than_the_vocabulary(runner: ModelRunner) -> None:
    batch = runner.prepare([SequenceWork(runner.new_sequence(), PROMPTS[0])])
    vocab = runner.config.vocab_size
    with pytest.raises(ValueError, match=f"top must be in 1..{vocab}"):
        runner.forward_top(batch, vocab + 1)


def test_submit_refuses_top_without_the_last_tokens_logits(runner: ModelRunner) -> None:
    core = BatchScheduler(runner)
    seq = core.new_sequence()
    ignore: Callable[[PassResult, BaseException | None], None] = lambda result, error: None  # noqa: E731
    with pytest.raises(ValueError, match="top=4 needs a pass that returns its last token's logits"):
        core.submit(seq, [1, 2], ignore, all_logits=True, top=4)
    with pytest.raises(ValueError, match="top=4"):
        core.submit(seq, [1, 2], ignore, logits=False, top=4)
