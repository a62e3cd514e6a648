"""A forward pass runs in the environment that holds the weights and leaves nothing else behind in it,
whether it returns or raises."""

from __future__ import annotations

import numpy as np
import pytest
from pie.poem.graph import POOL
from pie.poem.lower import KernelFailed
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.testing.models import random_weights, tiny_config

pytest.importorskip("pie_engine_cpu")


def cpu_runner() -> ModelRunner:
    from pie.plugins import EngineRegistry

    config = tiny_config("llama")
    device = EngineRegistry(env={"PIE_ENGINES": "cpu"}).engine("cpu").open(0)
    return ModelRunner(config, random_weights(config).items(), device, page_size=4, max_cached_tokens=64)


def held(runner: ModelRunner) -> dict[int, object]:
    return {slot: value for slot, value in enumerate(runner._env) if value is not None}


def test_passes_leave_only_the_bound_weights() -> None:
    runner = cpu_runner()
    bound = held(runner)
    names = {name for name, slot in runner.plan.slots.items() if slot in bound}
    assert POOL in names and all(name.startswith("w.") for name in names - {POOL}), "the weights and the page pool"
    sequence = runner.new_sequence()
    first = runner.step([SequenceWork(sequence, [5, 9, 2, 7, 1])])
    after = held(runner)
    assert after.keys() == bound.keys() and all(after[slot] is bound[slot] for slot in bound)
    second = runner.step([SequenceWork(sequence, [int(first[0].argmax())])])
    assert held(runner).keys() == bound.keys()
    assert first.shape == second.shape == (1, runner.config.vocab_size) and np.isfinite(second).all()


def test_a_pass_that_raises_leaves_only_the_bound_weights() -> None:
    runner = cpu_runner()
    bound = held(runner).keys()
    launcher, inputs, output, name = runner.plan._program[-1]

    def failing(*args: object) -> object:
        raise RuntimeError("the last kernel failed")

    runner.plan._program = (*runner.plan._program[:-1], (failing, inputs, output, name))
    with pytest.raises(KernelFailed, match=f"kernel {name} failed: RuntimeError: the last kernel failed") as caught:
        runner.step([SequenceWork(runner.new_sequence(), [3, 4])])
    assert caught.value.kernel == name and name.endswith(" in head on engine 'cpu'")
    assert held(runner).keys() == bound
    runner.plan._program = (*runner.plan._program[:-1], (launcher, inputs, output, name))
    assert runner.step([SequenceWork(runner.new_sequence(), [3, 4])]).shape == (1, runner.config.vocab_size)
