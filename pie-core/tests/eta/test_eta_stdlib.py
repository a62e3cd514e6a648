"""The stdlib epilogues against hand-written numpy references (float64), via numpy and JAX."""

from __future__ import annotations

import numpy as np
import pytest
from pie.eta import stdlib


def silu_mul(gate, up):
    return gate / (1.0 + np.exp(-gate)) * up


def softmax(x):
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def rms_norm(x, weight, eps):
    return x / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps) * weight


REFERENCES = {
    "silu_mul": (silu_mul, ("gate", "up"), {}),
    "residual_add": (lambda x, residual: x + residual, ("x", "residual"), {}),
    "bias_add": (lambda x, bias: x + bias, ("x", "bias:cols"), {}),
    "logit_temperature": (lambda x, temperature: x / temperature, ("x",), {"temperature": 0.7}),
    "logit_softcap": (lambda x, cap: cap * np.tanh(x / cap), ("x",), {"cap": 30.0}),
    "softmax": (softmax, ("x",), {}),
    "rms_norm": (rms_norm, ("x", "weight:cols"), {"eps": 1e-6}),
}


def arguments(name: str, rows: int, cols: int) -> dict:
    _, inputs, params = REFERENCES[name]
    rng = np.random.default_rng(len(name))
    values = {}
    for spec in inputs:
        key, _, shape = spec.partition(":")
        values[key] = rng.normal(scale=3.0, size=(cols,) if shape else (rows, cols)).astype(np.float32)
    return {**values, **params}


def test_every_stdlib_epilogue_has_a_reference() -> None:
    assert set(REFERENCES) == set(stdlib.SOURCES)


@pytest.mark.parametrize("name", sorted(REFERENCES))
@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (3, 300), (5, 1024)])
def test_numpy_fn_matches_reference(name: str, rows: int, cols: int) -> None:
    args = arguments(name, rows, cols)
    want = REFERENCES[name][0](
        **{k: np.float64(v) if np.isscalar(v) else v.astype(np.float64) for k, v in args.items()}
    )
    got = stdlib.get(name).numpy_fn()(**args)["y"]
    assert got.dtype == np.float32 and got.shape == (rows, cols)
    np.testing.assert_allclose(got, want, rtol=2e-6 if name != "softmax" else 1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_jax_fn_matches_reference(name: str) -> None:
    args = arguments(name, 3, 300)
    want = REFERENCES[name][0](
        **{k: np.float64(v) if np.isscalar(v) else v.astype(np.float64) for k, v in args.items()}
    )
    got = np.asarray(stdlib.get(name).jax_fn()(**args)["y"])
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_stdlib_epilogues_have_the_expected_shape() -> None:
    for name in ("softmax", "rms_norm"):
        assert stdlib.get(name).render("cuda").bindings.per_row
    for name in ("silu_mul", "residual_add", "bias_add", "logit_temperature", "logit_softcap"):
        assert not stdlib.get(name).render("cuda").bindings.per_row
    assert stdlib.get("silu_mul") is stdlib.get("silu_mul")  # compiled once
