"""Stop strings over streamed text: what is shown is the text before the earliest stop string, however it streams."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pie.generation import StopMatcher


def shown(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    matcher = StopMatcher(stops)
    text = "".join(matcher.push(piece) for piece in pieces)
    return text + matcher.flush(), matcher.stopped


def expected(stops: list[str], text: str) -> tuple[str, bool]:
    found = [text.find(stop) for stop in stops if stop and stop in text]
    return (text[: min(found)], True) if found else (text, False)


def test_the_earliest_stop_in_the_text_wins_whatever_the_lists_order() -> None:
    # The first stop of the list that matched won: "." was shown before "\n" when both came in one piece.
    for stops in (["\n", "."], [".", "\n"]):
        assert shown(stops, ["Hi.\n"]) == ("Hi", True)
    assert shown(["world", "o"], ["Hello world"]) == ("Hell", True)


@given(
    st.lists(st.text(alphabet="ab.\n", min_size=0, max_size=3), max_size=4),
    st.lists(st.text(alphabet="ab.\n", max_size=5), max_size=8),
)
def test_any_chunking_shows_what_the_whole_text_would(stops: list[str], pieces: list[str]) -> None:
    assert shown(stops, pieces) == expected(stops, "".join(pieces))
