"""A user's eta epilogue on the logits runs inside the head region, on the engine."""

from __future__ import annotations

import re

import numpy as np
import pytest

from pie.eta import EtaSyntaxError
from pie.eta.stdlib import SOURCES
from pie.model.loader import load_model
from pie.plugins import EngineRegistry
from pie.poem.graph import LogitEpilogue
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.testing.models import make_gguf_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_gguf_model(tmp_path_factory.mktemp("m") / "tiny.gguf", "F32")


def _logits(path, epilogue=None) -> np.ndarray:  # noqa: ANN001
    cpu = EngineRegistry().select("cpu")[0]
    loaded = load_model(path)
    runner = ModelRunner(loaded.config, loaded.tensors(), cpu, page_size=4, max_cached_tokens=64, logit_epilogue=epilogue)
    return runner.step([SequenceWork(runner.new_sequence(), [1, 5, 7, 9, 11, 13])])[0], runner


def test_softcap_epilogue_transforms_the_logits(model_path) -> None:
    plain, _ = _logits(model_path)
    capped, runner = _logits(model_path, LogitEpilogue(SOURCES["logit_softcap"], (("cap", 0.5),)))
    np.testing.assert_allclose(capped, 0.5 * np.tanh(plain / 0.5), atol=1e-6)
    head = [region for region in runner.plan.regions if region.label == "head"][0]
    assert [op.kind for op in head.ops][-2:] == ["linear", "epilogue"]
    described = runner.plan.describe()
    assert "-> epilogue" in described and "an eta program" in described, described
    assert len(re.findall(r"\beta\b", described)) == 1, "only the epilogue is eta's: the catalogue's fused kernels are the engine's own"


def test_a_custom_expression_with_a_select(model_path) -> None:
    source = "in x: f32\nout y = select(x > 0.0, x * 2.0, x)\n"
    plain, _ = _logits(model_path)
    got, _ = _logits(model_path, LogitEpilogue(source))
    np.testing.assert_allclose(got, np.where(plain > 0, plain * 2, plain), atol=1e-6)


def test_bad_epilogues_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="takes one f32 input"):
        LogitEpilogue(SOURCES["residual_add"])
    with pytest.raises(ValueError, match="needs values for its params: cap"):
        LogitEpilogue(SOURCES["logit_softcap"])
    with pytest.raises(EtaSyntaxError):
        LogitEpilogue("in x: f32\nout y = x +* 2\n")


@pytest.mark.parametrize(
    ("source", "params", "message"),
    [
        ("in x: f32\nout y = x\nout z = x * 2.0\n", (), "one f32 output .* gives y: f32, z: f32"),
        ("in x: f32\nout y = x\n", (("foo", 1.0),), "no param named 'foo' \\(it takes none\\)"),
        (SOURCES["logit_softcap"], (("cap", 1.0), ("capp", 2.0)), "no param named 'capp' \\(it takes cap\\)"),
        (SOURCES["logit_softcap"], (("cap", 1.0), ("cap", 2.0)), "param cap is given twice"),
        (SOURCES["logit_softcap"], (("cap", float("nan")),), "param cap is NaN"),
        ("in x: f32\nparam k: i32\nout y = x * f32(k)\n", (("k", 1.5),), "param k is an i32; 1.5 is not one"),
        ("in x: f32\nparam k: i32\nout y = x * f32(k)\n", (("k", 2.0**31),), "param k is an i32; 2147483648.0 is"),
        (SOURCES["logit_softcap"], (("cap", 1e39),), "param cap is 1e\\+39, beyond f32's range"),
        (SOURCES["logit_softcap"], (("cap", -3.4028236e38),),
         re.escape("param cap is -3.4028236e+38, beyond f32's range (±3.4028234663852886e+38)")),
        ("in x: f32; param t: f16; out y = x * f32(t)", (("t", 7e4),), re.escape("t is 70000.0, beyond f16's range (±65504.0)")),
        ("in x: f32; param t: f16; out y = x * f32(t)", (("t", 65520.0),), "beyond f16's range"),
        ("in x: f32; param t: bf16; out y = x * f32(t)", (("t", 1e39),), "t is 1e\\+39, beyond bf16's range"),
    ],
    ids=["two outputs", "unknown param", "misspelt param", "param twice", "NaN param", "fractional i32", "huge i32",
         "huge f32", "just past f32", "huge f16", "f16 rounding to inf", "huge bf16"],
)
def test_epilogues_that_cannot_be_logit_epilogues_are_refused(source: str, params: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LogitEpilogue(source, params)


@pytest.mark.parametrize(
    ("dtype", "value"),
    [("f32", 3.4028235e38), ("f32", -3.4028235e38), ("f32", float("inf")), ("f16", 65519.0), ("bf16", 3.39e38)],
)
def test_a_float_param_that_rounds_to_a_finite_value_of_its_type_is_taken(dtype: str, value: float) -> None:
    """3.4028235e38 is f32's largest as numpy prints it: it rounds to that value, not past it."""
    epilogue = LogitEpilogue(f"in x: f32; param t: {dtype}; out y = x * f32(t)", (("t", value),))
    assert epilogue.params == (("t", value),)


def test_an_integer_param_takes_a_whole_number(model_path) -> None:
    plain, _ = _logits(model_path)
    epilogue = LogitEpilogue("in x: f32\nparam k: i32\nout y = x * f32(k)\n", (("k", 3.0),))
    assert epilogue.params == (("k", 3),) and isinstance(epilogue.params[0][1], int), "an int for the kernels' packers"
    scaled, _ = _logits(model_path, epilogue)
    np.testing.assert_allclose(scaled, 3 * plain, rtol=1e-6)
