"""A logit epilogue (eta) runs on the XLA engine itself, through eta's JAX rendering, in the LM-head region."""

from __future__ import annotations

import numpy as np

from pie.eta.stdlib import SOURCES
from pie.model.loader import load_model
from pie.plugins import EngineRegistry
from pie.poem.graph import LogitEpilogue
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.testing.models import make_gguf_model


def test_logit_epilogue_runs_on_the_xla_engine(tmp_path) -> None:
    path = make_gguf_model(tmp_path / "tiny.gguf", "F32")
    registry = EngineRegistry()
    xla, cpu = registry.engine("xla").open(0), registry.engine("cpu").open(0)
    options = dict(page_size=4, max_cached_tokens=64, fallback=cpu)
    capped = ModelRunner(
        load_model(path).config,
        load_model(path).tensors(),
        xla,
        logit_epilogue=LogitEpilogue(SOURCES["logit_softcap"], (("cap", 0.5),)),
        **options,
    )
    plain = ModelRunner(load_model(path).config, load_model(path).tensors(), cpu, **options)
    head = [step for step in capped.plan.steps if step.region == "head"]
    assert [step.kernel for step in head][-1] == "epilogue" and not head[-1].fallback
    prompt = [1, 5, 7, 9]
    got = capped.step([SequenceWork(capped.new_sequence(), prompt)])[0]
    expected = plain.step([SequenceWork(plain.new_sequence(), prompt)])[0]
    np.testing.assert_allclose(got, 0.5 * np.tanh(expected / 0.5), atol=1e-5)
