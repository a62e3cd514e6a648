"""Type rules, literal typing and the meaning of casts."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pie.eta as eta
import pytest
from eta_harness import EDGES
from pie.eta import DType, EtaTypeError, Shape
from pie.eta.checker import MAX_REDUCTIONS
from pie.eta.ir import Const, postorder


def run(source: str, **arguments):
    return eta.compile(source).numpy_fn()(**arguments)


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("in x: f32; let h = f16(x); out y = x + h", "different types, f32 and f16"),
        ("in x: f32; in n: i32; out y = x * n", "different types, f32 and i32"),
        ("in n: i32; out y: i32 = n / 2", "'/' needs float operands"),
        ("in x: f32; out y = x / 0", "division by zero"),  # infinity on CPU and XLA, undefined in WGSL and SPIR-V
        ("in n: i32; out y: i32 = n + 0.5", "a float literal where an i32 is needed"),
        ("in x: f32; out y = x + (x > 0.0)", "different types, f32 and bool"),
        ("in x: f32; out y = f32((x > 0.0) + (x > 1.0))", "needs numbers, not bool"),
        ("in x: f32; out y = f32(!x)", "expected a bool, found f32"),
        ("in x: f32; out y = select(x, x, x)", "expected a bool, found f32"),
        ("in x: f32; out y = f32(x > 0.0 && 1)", "a number where a bool is needed"),
        ("in n: i32; out y = exp(n)", "exp needs a float argument, not i32"),
        ("in n: i32; out y: i32 = row_mean(n)", "row_mean needs a float argument"),
        ("in x: f32; out y: i32 = x", "output 'y' is i32 but its value is f32"),
        ("in x: f32; out y = f16(x)", "output 'y' is f32 but its value is f16"),
        ("in x: f16; out y = f32(x)", "inputs are stored as f32 or i32"),
        ("in x: f32; out y: bool = x > 0.0", "outputs are stored as f32 or i32"),
        ("in x: f32; out y = min(x)", "min takes 2 arguments, got 1"),
        ("in x: f32; out y = f32(x, x)", "takes 1 argument, got 2"),
        ("in x: f32; out y = softplus(x)", "unknown function 'softplus'"),
        ("in x: f32; in x: f32; out y = x", "'x' is already defined"),
        ("in x: f32; out y = x; out y = x", "'y' is already defined"),
        ("in x: f32; out y = z", "undefined name 'z'"),
        ("in x: f32; out y = x * f16(70000.0)", "literal out of range for f16"),
        ("in x: f32; out y = x * 1e39", "literal out of range for f32"),
        ("in n: i32; out y: i32 = n + 2147483648", "integer literal out of range for i32"),
        ("in n: i32; out y: i32 = n + -2147483649", "integer literal out of range for i32"),
        ("in n: i32; out y: i32 = n + inf", "'inf' is a float where i32 is needed"),
        ("in x: f32", "needs at least one output"),
        ("in b: f32[cols]; out y = b", "needs at least one full input"),
        ("; ".join([f"in x{k}: f32" for k in range(8)] + ["out y = x0"]), "at most 8 inputs and outputs"),
    ],
)
def test_type_errors(source: str, words: str) -> None:
    with pytest.raises(EtaTypeError) as info:
        eta.compile(source)
    assert words in info.value.message


def constants(source: str) -> list[Const]:
    ep = eta.compile(source)
    return [n for n in postorder(o.value for o in ep.outputs) if isinstance(n, Const)]


def test_literals_take_the_type_their_context_needs() -> None:
    assert {c.dtype for c in constants("in x: f32; let h = f16(x); out y = f32(h * 2 + 0.5)")} == {DType.F16}
    assert {c.dtype for c in constants("in x: f32; let b = bf16(x); out y = f32(max(b, 1))")} == {DType.BF16}
    assert {c.dtype for c in constants("in n: i32; out y: i32 = n * 3 + 1")} == {DType.I32}
    # Literal-only expressions default to f32 (any float literal) or i32.
    assert {c.dtype for c in constants("in x: f32; let k = 1 + 2; out y = x * f32(k)")} == {DType.I32}
    assert {c.dtype for c in constants("in x: f32; let k = 1 + 2.5; out y = x * k")} == {DType.F32}
    # A cast of literals types them as the cast's target directly.
    assert {c.dtype for c in constants("in x: f32; out y = x * f32(1 + 2)")} == {DType.F32}


def test_literals_are_rounded_once_straight_to_their_type() -> None:
    (h,) = constants("in x: f32; out y = f32(f16(0.1) * f16(x))")
    assert h.value == float(np.float16(0.1))
    # Just above a bf16 tie: rounds up. Going through f32 first would land on the tie and
    # round down to even, as ml_dtypes does from a Python float.
    (b,) = constants("in x: f32; out y = f32(bf16(1.00390625001))")
    assert b.value == 1.0078125
    assert float(ml_dtypes.bfloat16(np.float32(1.00390625001))) == 1.0


def test_declarations_are_ordered_and_typed() -> None:
    ep = eta.compile(
        "in x: f32; in b: f32[cols]; in s: i32[rows]; param t: bf16; param k: bool; out y = x + b; out z: i32 = s"
    )
    assert [(i.name, i.dtype, i.shape) for i in ep.inputs] == [
        ("x", DType.F32, Shape.FULL),
        ("b", DType.F32, Shape.COLS),
        ("s", DType.I32, Shape.ROWS),
    ]
    assert [(p.name, p.dtype) for p in ep.params] == [("t", DType.BF16), ("k", DType.BOOL)]
    assert [(o.name, o.dtype) for o in ep.outputs] == [("y", DType.F32), ("z", DType.I32)]


def test_f16_cast_rounds_like_numpy_float16() -> None:
    got = run("in x: f32; out y = f32(f16(x))", x=EDGES[None, :])["y"][0]
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(got, EDGES.astype(np.float16).astype(np.float32))


def test_bf16_cast_rounds_to_nearest_even() -> None:
    got = run("in x: f32; out y = f32(bf16(x))", x=EDGES[None, :])["y"][0]
    np.testing.assert_array_equal(got, EDGES.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_i32_cast_truncates_saturates_and_maps_nan_to_zero() -> None:
    got = run("in x: f32; out y: i32 = i32(x)", x=EDGES[None, :])["y"][0]
    want = np.where(np.isnan(EDGES), 0, np.clip(np.trunc(EDGES.astype(np.float64)), -(2**31), 2**31 - 1)).astype(
        np.int32
    )
    np.testing.assert_array_equal(got, want)


def test_bool_casts() -> None:
    x = np.array([[0.0, -0.0, 2.0, np.nan, -np.inf]], np.float32)
    out = run("in x: f32; out a = f32(bool(x)); out b: i32 = i32(bool(x)); out c: i32 = i32(bool(i32(x)))", x=x)
    np.testing.assert_array_equal(out["a"], [[0, 0, 1, 1, 1]])  # NaN is not zero
    np.testing.assert_array_equal(out["b"], [[0, 0, 1, 1, 1]])
    np.testing.assert_array_equal(out["c"], [[0, 0, 1, 0, 1]])  # i32(NaN) is 0


def test_i32s_least_value_is_a_literal() -> None:
    out = run("in n: i32; out a: i32 = n + -2147483648; out b: i32 = max(n, -2147483648) - 1", n=np.array([[5]], np.int32))
    assert (out["a"][0, 0], out["b"][0, 0]) == (-2147483643, 4)
    assert [c.value for c in constants("in n: i32; out y: i32 = n * -2147483648")] == [-(2**31)]
    assert [c.value for c in constants("in x: f32; out y = x * -2147483648")] == [2.0**31]  # a float: negated


def test_row_reductions_are_limited() -> None:
    """Each is a pass that recomputes what it reduces: a chain of them rendered quadratic kernel source."""
    last = MAX_REDUCTIONS + 1
    chain = ["in x: f32", "let a0 = x"] + [f"let a{k} = a{k - 1} - row_max(a{k - 1})" for k in range(1, last + 1)]
    eta.compile("\n".join([*chain[:-1], f"out y = a{last - 1}"]))
    with pytest.raises(EtaTypeError) as info:
        eta.compile("\n".join([*chain, f"out y = a{last}"]))
    assert (info.value.line, info.value.column) == (len(chain), chain[-1].index("row_max") + 1)
    assert info.value.message == f"an epilogue has at most {MAX_REDUCTIONS} row reductions"
    # The same reduction written twice is one.
    eta.compile("in x: f32; out y = " + " + ".join(["row_max(x)"] * 20))


def test_integer_arithmetic_wraps_like_int32() -> None:
    n = np.array([[2**31 - 1, -(2**31), 65536, -7]], np.int32)
    out = run("in n: i32; out a: i32 = n + 1; out b: i32 = n * 65536; out c: i32 = -n; out d: i32 = abs(n)", n=n)
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(out["a"], n + np.int32(1))
        np.testing.assert_array_equal(out["b"], n * np.int32(65536))
        np.testing.assert_array_equal(out["c"], -n)
        np.testing.assert_array_equal(out["d"], np.abs(n))


def test_half_precision_arithmetic_rounds_every_result() -> None:
    x = np.linspace(-3, 3, 97, dtype=np.float32)[None, :]
    out = run("in x: f32; let h = f16(x); out y = f32(h * h + h / 3.0)", x=x)["y"]
    h = x.astype(np.float16)
    np.testing.assert_array_equal(out, (h * h + h / np.float16(3.0)).astype(np.float32))


def test_numpy_fn_stays_in_float32() -> None:
    x = np.array([[1.1, 2.2, 3.3]], np.float32)
    out = run("in x: f32; param t: f32; out y = x * 0.1 / t", x=x, t=0.7)["y"]
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, x * np.float32(0.1) / np.float32(0.7))


def test_nan_propagates_through_min_max_and_reductions() -> None:
    x = np.array([[1.0, np.nan, 3.0], [1.0, 2.0, 3.0]], np.float32)
    out = run("in x: f32; out a = min(x, 2.0); out b = max(2.0, x); out c = row_max(x); out d = row_min(x)", x=x)
    np.testing.assert_array_equal(out["a"], np.minimum(x, 2))
    np.testing.assert_array_equal(out["b"], np.maximum(2, x))
    np.testing.assert_array_equal(out["c"], np.broadcast_to([[np.nan], [3.0]], x.shape))
    np.testing.assert_array_equal(out["d"], np.broadcast_to([[np.nan], [1.0]], x.shape))


def test_numpy_fn_checks_its_arguments() -> None:
    fn = eta.compile("in x: f32; in b: f32[cols]; param t: f32; out y = x * b / t").numpy_fn()
    with pytest.raises(TypeError, match="missing"):
        fn(x=np.ones((2, 3), np.float32), b=np.ones(3, np.float32))
    with pytest.raises(ValueError, match="shape"):
        fn(x=np.ones((2, 3), np.float32), b=np.ones(4, np.float32), t=1.0)
