"""A model run with variants chosen per bucket gives the same logits as with the engine's defaults."""

from __future__ import annotations

import numpy as np
import pytest
from pie.poem.lower import ShapeBuckets
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.testing.models import random_weights, tiny_config

pytest.importorskip("pie_engine_cpu")

ROWS_WHEN_SMALL = ShapeBuckets(tuple((1 << s, r, "rows") for s in range(8, 24) for r in (1, 2)))


def logits_for(chooser) -> list[np.ndarray]:
    from pie.plugins import EngineRegistry

    config = tiny_config()
    device = EngineRegistry(env={"PIE_ENGINES": "cpu"}).engine("cpu").open(0)
    runner = ModelRunner(
        config, random_weights(config).items(), device, page_size=4, max_cached_tokens=128, choose_variant=chooser
    )
    if chooser is not None:
        assert "[default; rows at 1,2 rows (size 2^8), 1,2 rows (size 2^9)" in runner.plan.describe()
    first, second = runner.new_sequence(), runner.new_sequence()
    out = [runner.step([SequenceWork(first, [5, 9, 11, 3, 7])])]  # prefill: 5 rows, the defaults
    out.append(runner.step([SequenceWork(first, [4]), SequenceWork(second, [8, 2])]))  # 3 rows
    out.append(runner.step([SequenceWork(first, [6]), SequenceWork(second, [1])]))  # 2 rows: "rows"
    out.append(runner.step([SequenceWork(second, [12])]))  # 1 row: "rows"
    return out


def test_bucketed_variants_match_the_defaults() -> None:
    fused = {"rms_norm_linear", "linear_add", "rms_norm_gate_up_silu"}
    chosen = logits_for(lambda kernel: ROWS_WHEN_SMALL if kernel in fused else None)
    for got, expected in zip(chosen, logits_for(None), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
