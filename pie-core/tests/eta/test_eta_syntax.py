"""Parsing: the grammar, and errors that point at the offending column."""

from __future__ import annotations

import numpy as np
import pie.eta as eta
import pytest
from pie.eta import EtaError, EtaSyntaxError, EtaTypeError


def error_at(source: str, kind: type[EtaError] = EtaError) -> EtaError:
    with pytest.raises(kind) as info:
        eta.compile(source)
    return info.value


@pytest.mark.parametrize(
    ("source", "line", "column", "words"),
    [
        ("in x: f32\nout y = x +", 2, 12, "expected an expression, found end of input"),
        ("in x: f32\nout y = (x * 2", 2, 15, "expected ')'"),
        ("in x: f32\nout y = x $ 2", 2, 11, "unexpected character '$'"),
        ("in x: f32\nout y = 1.5f", 2, 9, "malformed number"),
        ("in x: f32\nout y = 2x", 2, 9, "malformed number"),
        ("in x: f32\nout y = x < 1 < 2", 2, 15, "comparisons do not chain"),
        ("in x: f32\nout y = f32", 2, 9, "a type name is not a value"),
        ("in x: f32\nlet exp = x\nout y = x", 2, 5, "'exp' is reserved"),
        ("in x: f32\nlet a__b = x\nout y = x", 2, 5, "'__' is reserved"),
        ("in _x: f32\nout y = _x", 1, 4, "start with a letter"),
        ("in x: f16x\nout y = x", 1, 7, "expected a type"),
        ("in x: f32[cols, rows]\nout y = x", 1, 11, "expected a shape"),
        ("in x: f32\nout y = x\nx = 1", 3, 1, "expected a statement"),
        ("in x: f32 out y = x", 1, 11, "expected end of statement"),
        ("in x: f32\nout y = x + in", 2, 13, "unexpected keyword 'in'"),
        ("in x: f32\nout y = é", 2, 9, "unexpected character"),
    ],
)
def test_syntax_errors_point_at_the_offending_column(source: str, line: int, column: int, words: str) -> None:
    error = error_at(source, EtaSyntaxError)
    assert (error.line, error.column) == (line, column)
    assert words in error.message


def test_error_display_has_the_line_and_a_caret_under_the_column() -> None:
    error = error_at("in x: f32\nout y = exp(x) +* 2")
    assert str(error).splitlines() == [
        "line 2, column 17: expected an expression, found '*'",
        "  out y = exp(x) +* 2",
        "                  ^",
    ]


@pytest.mark.parametrize("breaks", ["\u2028", "\x85", "\r", "\x0c"])
def test_the_excerpt_is_the_line_the_column_counts_in(breaks: str) -> None:
    """Only "\n" ends a line (a comment may hold other breaks); CRLF line endings show without the CR."""
    for source in (f"# note{breaks}more\nin x: f32\nout y = x +* 2", "in x: f32\r\nout y = x +* 2\r\n"):
        error = error_at(source)
        assert str(error).splitlines()[1:] == ["  out y = x +* 2", "             ^"], source


def test_the_excerpt_of_a_long_line_is_a_window_around_the_caret() -> None:
    lets = [f"let a{k} = x" for k in range(3000)]
    source = "; ".join(["in x: f32", *lets, "out y = x +* 2", *lets[:1000]])
    error = error_at(source)
    _, excerpt, caret = str(error).splitlines()
    assert len(excerpt) < 100 and excerpt.startswith("  ...") and excerpt.endswith("...")
    assert excerpt[len(caret) - 1] == "*" and caret.endswith(" ^")
    end = error_at("in x: f32; " + "let a = x; " * 20 + "out y = x +")  # the caret past the end of the line
    assert str(end).splitlines()[2].index("^") == len(str(end).splitlines()[1])


def test_type_errors_point_at_the_offending_column() -> None:
    error = error_at("in x: f32\nlet h = f16(x)\nout y = x + h", EtaTypeError)
    assert (error.line, error.column) == (3, 11)
    assert "different types, f32 and f16" in error.message
    error = error_at("in x: f32\nout y = exp(x) + nope", EtaTypeError)
    assert (error.line, error.column, error.message) == (2, 18, "undefined name 'nope'")


def test_error_classes_share_the_base() -> None:
    assert issubclass(EtaSyntaxError, EtaError) and issubclass(EtaTypeError, EtaError)
    assert issubclass(EtaError, Exception)


@pytest.mark.parametrize("separator", ["\n", ";", " ; ", "\n\n;\n"])
def test_statements_split_on_newlines_or_semicolons(separator: str) -> None:
    ep = eta.compile(separator.join(["in x: f32", "param t: f32", "let z = x / t", "out y = z"]))
    assert [i.name for i in ep.inputs] == ["x"] and [p.name for p in ep.params] == ["t"]


def test_expressions_continue_across_lines_inside_parentheses_and_comments_are_ignored() -> None:
    one = eta.compile("in x: f32\nout y = max(x,\n   0.0) * (x +\n 1.0)  # trailing comment\n# whole line")
    two = eta.compile("in x: f32; out y = max(x, 0.0) * (x + 1.0)")
    assert one.key == two.key


def test_precedence_follows_c() -> None:
    # `a + b * c`, `-a * b`, comparisons below arithmetic, && below comparisons, || lowest.
    ep = eta.compile("in a: f32; out y = f32(a + a * 2.0 > 3.0 && !(a < 0.0) || a == 1.0)")
    tight = eta.compile("in a: f32; out y = f32((((a + (a * 2.0)) > 3.0) && (!(a < 0.0))) || (a == 1.0))")
    assert ep.key == tight.key


@pytest.mark.parametrize(
    "source",
    [
        "in x: f32; out y = " + "(" * 200 + "x" + ")" * 200,
        "in x: f32; out y = " + "-" * 200 + "x",
        "in x: f32; out y = " + "exp(" * 100 + "x" + ")" * 100,
        "in x: f32; out y = " + "x + (" * 100 + "x" + ")" * 100,
        "in x: f32; out y = " + "x + exp(" * 100 + "x" + ")" * 100,
    ],
)
def test_deep_nesting_is_a_syntax_error_not_a_crash(source: str) -> None:
    assert "nested deeper" in error_at(source, EtaSyntaxError).message


@pytest.mark.parametrize(
    ("source", "value"),
    [
        ("in x: f32; out y = " + " + ".join(["x"] * 10000), 10000.0),
        ("in x: f32; out y = x" + " - x * 2.0 + 1" * 4000, 1.0 - 4000.0),
        ("in x: f32; out y = " + " + ".join(["1"] * 10000) + " + x", 10001.0),  # literals typed by the last operand
        ("in x: f32; out y = x * (" + " + ".join(["0.5"] * 10000) + ")", 5000.0),
        ("in x: f32; out y = select(" + " && ".join(["x > 0.0"] * 5000) + " || x < 0.0, x, -x)", 1.0),
    ],
)
def test_a_flat_chain_of_operators_is_no_nesting(source: str, value: float) -> None:
    """`a + b + c + ...` is one level at any length; the checker, evaluators and renderers walk it in a loop."""
    ep = eta.compile(source)
    assert ep.numpy_fn()(x=np.ones((1, 1), np.float32))["y"][0, 0] == value
    assert all(ep.render(target).source for target in eta.TARGETS)


def test_an_integer_literal_of_thousands_of_digits_is_out_of_range() -> None:
    """Past 39 digits no literal fits any type; `int()` of thousands of digits would raise a bare ValueError."""
    for digits in ("1" * 5000, "1" + "0" * 39):
        error = error_at("in x: f32; out y = x * " + digits, EtaSyntaxError)
        assert (error.line, error.column, error.message) == (1, 24, "integer literal out of range")
    padded = eta.compile("in x: f32; out y = x * " + "0" * 5000 + "7")
    assert padded.key == eta.compile("in x: f32; out y = x * 7").key
    assert eta.compile("in x: f32; out y = x * 340282346638528859811704183484516925440")  # f32's largest, 39 digits


def test_oversized_source_is_rejected() -> None:
    assert "longer than" in error_at("#" * 70000, EtaSyntaxError).message


def test_long_let_chains_compile_without_recursion() -> None:
    lines = (
        ["in x: f32", "let v0 = x"]
        + [f"let v{k} = v{k - 1} * 1.0001 + 0.5" for k in range(1, 2000)]
        + ["out y = v1999"]
    )
    ep = eta.compile("\n".join(lines))
    assert "out_y[i] = t3998;" in ep.render("cuda").source  # one load, then two SSA steps per let
