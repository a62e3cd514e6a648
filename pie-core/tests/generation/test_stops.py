"""Stop strings over streamed text: what is shown is the text before the earliest stop string, however it streams."""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from types import FrameType

from hypothesis import example, given
from hypothesis import strategies as st

from pie.generation import StopMatcher


def shown(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    matcher = StopMatcher(stops)
    text = "".join(matcher.push(piece) for piece in pieces)
    return text + matcher.flush(), matcher.stopped


def reference(stops: list[str], text: str) -> tuple[str, str | None]:
    """What a matcher fed ``text`` has shown, and what it holds back (None once it stopped), found naively in the
    whole text: the text ends where the first stop string ends, and is shown up to the earliest stop string in
    it; else the longest end of the text that is the start of a stop string is held back."""
    stops = [stop for stop in stops if stop]
    ends = [text.find(stop) + len(stop) for stop in stops if stop in text]
    if ends:
        text = text[: min(ends)]
        return text[: min(text.find(stop) for stop in stops if stop in text)], None
    hold = max((size for stop in stops for size in range(1, len(stop)) if text.endswith(stop[:size])), default=0)
    return text[: len(text) - hold], text[len(text) - hold :]


def test_the_earliest_stop_in_the_text_wins_whatever_the_lists_order() -> None:
    # The first stop of the list that matched won: "." was shown before "\n" when both came in one piece.
    for stops in (["\n", "."], [".", "\n"]):
        assert shown(stops, ["Hi.\n"]) == ("Hi", True)
    assert shown(["world", "o"], ["Hello world"]) == ("Hell", True)


@given(
    st.lists(st.text(alphabet="aab.\n", min_size=0, max_size=6), max_size=5),
    st.lists(st.text(alphabet="aab.\n", max_size=8), max_size=10),
)
@example(stops=["a", ".aa"], pieces=[".aa"])
def test_each_push_shows_and_holds_what_the_text_so_far_would(stops: list[str], pieces: list[str]) -> None:
    # Stops "a" and ".aa" showed "" for the piece ".aa" but "." for the pieces ".", "a", "a": a stop string
    # ending in a later part of the same piece could win, so the text shown depended on how it was split.
    matcher, text, so_far = StopMatcher(stops), "", ""
    held: str | None = ""
    for piece in pieces:
        so_far += matcher.push(piece)
        text += piece
        expected, held = reference(stops, text)
        assert (so_far, matcher.stopped) == (expected, held is None)
        if held is None:
            break
    assert matcher.flush() == (held or "")


MATCHER_FILE = inspect.getfile(StopMatcher)


def lines_run(work: Callable[[], object]) -> int:
    """How many lines of the matcher's module ``work`` runs: its work, counted without a clock."""
    count = 0

    def line(frame: FrameType, event: str, arg: object) -> Callable[..., object]:
        nonlocal count
        count += event == "line"
        return line

    def call(frame: FrameType, event: str, arg: object) -> Callable[..., object] | None:
        return line if frame.f_code.co_filename == MATCHER_FILE else None

    outer = sys.gettrace()
    sys.settrace(call)
    try:
        work()
    finally:
        sys.settrace(outer)
    return count


def test_a_push_costs_the_same_however_much_text_is_held_back() -> None:
    # Each push tested every prefix of every stop string against the end of the text held back: 16 stop strings
    # of 400k characters, whose start the text kept matching, made each token cost more than the one before, on
    # the engine thread that every request shares.
    long = 2000
    matcher = StopMatcher(["x" * long] + [chr(ord("a") + i) * long for i in range(15)])
    costs = [lines_run(lambda: matcher.push("x" * 16)) for _ in range(100)]
    assert not matcher.stopped and matcher.flush() == "x" * 1600
    assert sum(costs[-10:]) <= 2 * sum(costs[:10]), costs
