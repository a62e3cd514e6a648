"""The profile loader: round trips, clear errors with line numbers, and 10,000 malformed files."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pie.profiles import ProfileError, dump_profile, parse_profile
from pie.profiles.writer import dumps_document
from profile_fakes import VALID_TEXT, make_profile

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


def test_round_trip() -> None:
    profile = make_profile()
    loaded = parse_profile(VALID_TEXT, "fake.toml")
    assert loaded == profile
    assert dump_profile(loaded) == VALID_TEXT
    assert loaded.kernel("linear").crossovers() == {(4096, 0): [(1, "rows"), (8, "blas")]}


def test_speedups_compare_the_chosen_variant_with_the_default_per_bucket() -> None:
    speedups = [(bucket.rows, round(gain, 3)) for bucket, gain in make_profile().kernel("linear").speedups()]
    assert speedups == [(1, 3.125), (2, 3.125), (4, 3.125), (8, 1.0)]


def _line_of(text: str, needle: str, occurrence: int = 0) -> int:
    index = -1
    for _ in range(occurrence + 1):
        index = text.index(needle, index + 1)
    return text.count("\n", 0, index) + 1


@pytest.mark.parametrize(
    ("old", "new", "occurrence", "message"),
    [
        ("rows = 2\n", "rows = 3\n", 0, r"rows: 3 is not a power of two"),
        ("size = 4096\nrows = 4", "size = 4000\nrows = 4", 0, r"size: 4000 is not a power of two"),
        ("rows = [15.0", "rows = [-15.0", 0, r"times_us\.rows\[0\]: -15.0 must be above 0"),
        ("rows = [15.0", "rows = [nan", 1, r"times_us\.rows\[0\]: nan is not a finite number"),
        ('variant = "rows"', 'variant = "turbo"', 1, r"unknown variant 'turbo'"),
        ("rows = [15.0, 16.0, 17.5]", "turbo = [1.0, 2.0, 3.0]", 2, r"times for unknown variant 'turbo'"),
        (
            "memory_bytes = 1073741824",
            "memory_bytes = 1.5",
            0,
            r"device\.memory_bytes: must be an integer, not a float",
        ),
        ("repeats = 9", "repeats = true", 0, r"tune\.repeats: must be an integer, not a boolean"),
        ('kind = "gpu"', 'kind = "toaster"', 0, r"'toaster' is not one of"),
        ("rows = 4\n", "color = 3\nrows = 4\n", 0, r"unknown key 'color'"),
        # The choice is what the times fail to justify: the error points at the variant line.
        (
            'variant = "rows"\nshapes = [[64, 64]]\ntimes_us = { blas = [48.0, 50.0, 52.0], rows = [15.0, 16.0, 17.5]',
            'variant = "rows"\nshapes = [[64, 64]]\ntimes_us = { blas = [48.0, 50.0, 52.0], rows = [49.5, 50.0, 51.0]',
            0,
            r"do not beat the default 'blas'",
        ),
        ("blas = [48.0, 50.0, 52.0]", "blas = [48.0, 47.0, 52.0]", 0, r"not in increasing order"),
        ('measured_at = "2025-06-01T12:00:00+00:00"', 'measured_at = "last tuesday"', 0, r"not an ISO 8601"),
        ('default = "blas"', 'default = "gemm"', 0, r"default 'gemm' is not among the variants"),
        ('mode = "quick"', 'mode = "slow"', 0, r"'slow' is not one of quick, full"),
    ],
)
def test_errors_name_the_line(old: str, new: str, occurrence: int, message: str) -> None:
    line = _line_of(VALID_TEXT, old, occurrence)
    parts = VALID_TEXT.split(old)
    assert len(parts) > occurrence + 1, old
    text = old.join(parts[: occurrence + 1]) + new + old.join(parts[occurrence + 1 :])
    with pytest.raises(ProfileError, match=message) as caught:
        parse_profile(text, "mine.toml")
    assert caught.value.line == line, str(caught.value)
    assert str(caught.value).startswith(f"mine.toml:{line}: ")


def test_duplicate_bucket_is_an_error() -> None:
    text = VALID_TEXT.replace("size = 4096\nrows = 2", "size = 4096\nrows = 1")
    with pytest.raises(ProfileError, match=r"buckets\[1\]: size 4096, rows 1 is already given by bucket 0"):
        parse_profile(text)


def test_other_schema_version_rejects_the_whole_file() -> None:
    text = VALID_TEXT.replace("schema = 1", "schema = 2").replace('mode = "quick"', "mode = 7")
    with pytest.raises(ProfileError, match="schema version 2 is not supported") as caught:
        parse_profile(text)
    assert caught.value.line == _line_of(VALID_TEXT, "schema = 1")


def test_toml_syntax_error_has_its_line() -> None:
    text = VALID_TEXT.replace('kind = "gpu"', 'kind = "gpu')
    with pytest.raises(ProfileError, match="not valid TOML") as caught:
        parse_profile(text)
    assert caught.value.line == _line_of(VALID_TEXT, 'kind = "gpu"')


def test_bytes_that_are_not_utf8() -> None:
    with pytest.raises(ProfileError, match="not UTF-8"):
        parse_profile(VALID_TEXT.encode() + b"\xff\xfe")


def test_deep_nesting_is_a_profile_error() -> None:
    with pytest.raises(ProfileError):
        parse_profile("schema = " + "[" * 5000 + "]" * 5000)


# --------------------------------------------------------------------------
# Fuzzing: mostly small mutations of a valid file
# --------------------------------------------------------------------------

LINES = VALID_TEXT.split("\n")
SNIPPETS = [
    "",
    "[",
    "]",
    "[[",
    "=",
    '"',
    "'",
    '"""',
    "#",
    "{",
    "}",
    ",",
    ".",
    "0",
    "-1",
    "1e400",
    "nan",
    "inf",
    "-0.0",
    "true",
    "2",
    "3",
    "1024",
    "1.5",
    "9" * 30,
    '""',
    '"x"',
    "[]",
    "{}",
    "\\",
    "\x00",
    "\x7f",
    "é",
    "\u2028",
    "\r",
    "\n",
    "rows = 2",
    "size = 4096",
    'variant = "blas"',
    "[kernels.add]",
    "[[kernels.linear.buckets]]",
    "[device]",
    'default = "rows"',
    "schema = 1",
    "times_us = {}",
    "blas = [1.0, 2.0, 3.0]",
    "[tools]",
    "x = 1",
    "a.b.c = 1",
]
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")


@st.composite
def text_mutation(draw: st.DrawFn) -> str:
    text = VALID_TEXT
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["insert", "delete", "replace_line", "duplicate_line", "number", "swap_lines"]))
        if kind == "insert":
            at = draw(st.integers(0, len(text)))
            piece = draw(st.one_of(st.sampled_from(SNIPPETS), st.text(max_size=4)))
            text = text[:at] + piece + text[at:]
        elif kind == "delete":
            at = draw(st.integers(0, max(0, len(text) - 1)))
            text = text[:at] + text[at + draw(st.integers(1, 12)) :]
        elif kind in ("replace_line", "duplicate_line", "swap_lines"):
            lines = text.split("\n")
            i = draw(st.integers(0, len(lines) - 1))
            if kind == "replace_line":
                lines[i] = draw(st.one_of(st.sampled_from(SNIPPETS + LINES), st.text(max_size=20)))
            elif kind == "duplicate_line":
                lines.insert(i, lines[i])
            else:
                j = draw(st.integers(0, len(lines) - 1))
                lines[i], lines[j] = lines[j], lines[i]
            text = "\n".join(lines)
        else:
            numbers = list(NUMBER.finditer(text))
            match = numbers[draw(st.integers(0, len(numbers) - 1))]
            replacement = draw(
                st.one_of(
                    st.sampled_from(
                        ["0", "-1", "nan", "inf", "-inf", "1e400", "true", '"7"', "1.0", "3", "2048", "1e-300"]
                    ),
                    st.integers(-(2**64), 2**64).map(str),
                    st.floats(allow_nan=True).map(lambda f: repr(f).replace("inf", "inf")),
                )
            )
            text = text[: match.start()] + replacement + text[match.end() :]
    return text


VALUES = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**63 - 1),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=12),
        st.sampled_from(["blas", "rows", "gpu", "quick", "full", "linear"]),
        st.sampled_from([1, 2, 4096, 1 << 40, 1 << 41, 0, -4]),
    ),
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=6,
)


def _paths(node: object, prefix: tuple = ()) -> list[tuple]:
    found = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            found.extend(_paths(value, (*prefix, key)))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found.extend(_paths(value, (*prefix, index)))
    return found


@st.composite
def structure_mutation(draw: st.DrawFn) -> str:
    document = tomllib.loads(VALID_TEXT)
    for _ in range(draw(st.integers(1, 2))):
        paths = [p for p in _paths(document) if p]
        path = draw(st.sampled_from(paths))
        parent = document
        for step in path[:-1]:
            parent = parent[step]
        action = draw(st.sampled_from(["set", "set", "delete", "add"]))
        last = path[-1]
        if action == "delete":
            del parent[last]
        elif action == "add" and isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=8))] = draw(VALUES)
        else:
            parent[last] = draw(VALUES)
    try:
        return dumps_document(_no_none(document))
    except TypeError:
        return VALID_TEXT.replace("schema = 1", "schema = []")


def _no_none(node: object) -> object:
    """TOML has no null: drop None values (a missing key is a mutation too)."""
    if isinstance(node, dict):
        return {k: _no_none(v) for k, v in node.items() if v is not None}
    if isinstance(node, list):
        return [_no_none(v) for v in node if v is not None]
    return node


MALFORMED = st.one_of(
    text_mutation(),
    text_mutation(),
    text_mutation(),
    structure_mutation(),
    structure_mutation(),
    st.binary(max_size=64).map(lambda b: b.decode("latin-1")),
)


@settings(max_examples=2_000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(MALFORMED)
def test_malformed_files_raise_only_profile_error(text: str) -> None:
    try:
        profile = parse_profile(text, "fuzz.toml")
    except ProfileError as exc:
        assert exc.source == "fuzz.toml"
        assert exc.line is None or 1 <= exc.line <= text.count("\n") + 1
        return
    # Whatever parses is a complete, valid profile: it writes out and reads back the same.
    assert parse_profile(dump_profile(profile)) == profile
