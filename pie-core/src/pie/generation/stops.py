"""Stop strings over streamed text: emit what can no longer be part of a stop string."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache


class StopMatcher:
    """Feed text pieces; get back text safe to show, and whether a stop string was reached.

    Text that might be the start of a stop string is held back until it is
    either completed (generation stops, the stop string is not shown) or ruled out.
    The text stops where the first stop string ends; of the stop strings ending there,
    the longest (the one that began earliest) is cut off, so no stop string is ever
    shown, and how the text is split into pieces changes nothing.

    Each stop string is followed by a Knuth-Morris-Pratt automaton whose state is how
    much of it the text now ends with, so a push's matching costs time in proportion to the
    piece (amortized over the pushes), however long the stop strings; the text held back
    (shorter than the longest stop string) is copied once a push.
    """

    def __init__(self, stop_strings: Sequence[str] | str = ()):
        given = (stop_strings,) if isinstance(stop_strings, str) else stop_strings
        try:
            strings = tuple(given)
        except TypeError:
            strings = (given,)
        if not all(isinstance(s, str) for s in strings):
            raise TypeError(f"stop takes a string or a list of strings, not {stop_strings!r}")
        self.stop_strings = tuple(s for s in strings if s)
        self._fallbacks = tuple(_fallbacks(s) for s in self.stop_strings)
        self._matched = [0] * len(self.stop_strings)
        """For each stop string, the length of its longest start that the text ends with."""
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        end = len(text)
        ended: list[str] = []  # the stop strings that end first in ``text``, at ``end``
        for k, stop in enumerate(self.stop_strings):
            at = self._advance(k, text, end)
            if at is not None:
                ended = [stop] if at < end else [*ended, stop]
                end = at
        buffer = self._held + text[:end]
        if ended:
            self.stopped = True
            self._held = ""
            return buffer[: len(buffer) - max(map(len, ended))]
        hold = max(self._matched, default=0)  # at most len(buffer): each grew by at most len(text)
        self._held = buffer[len(buffer) - hold :]
        return buffer[: len(buffer) - hold]

    def flush(self) -> str:
        held, self._held = self._held, ""
        self._matched = [0] * len(self.stop_strings)
        return "" if self.stopped else held

    def _advance(self, k: int, text: str, end: int) -> int | None:
        """Feed ``text[:end]`` to stop string ``k``'s automaton; where in ``text`` it first ends, or None."""
        stop, fallback, matched = self.stop_strings[k], self._fallbacks[k], self._matched[k]
        at = 0
        while at < end:
            if not matched:  # nothing begun: skip to where the stop string could begin
                at = text.find(stop[0], at, end)
                if at < 0:
                    break
            char = text[at]
            while matched and stop[matched] != char:
                matched = fallback[matched - 1]
            if stop[matched] == char:
                matched += 1
            at += 1
            if matched == len(stop):
                return at
        self._matched[k] = matched
        return None


@lru_cache(maxsize=256)
def _fallbacks(stop: str) -> tuple[int, ...]:
    """For each ``i``, the length of the longest proper prefix of ``stop[: i + 1]`` that is also its suffix: the
    match a partial match falls back to when the next character does not continue it. Cached: the choices of a
    request each follow the same stop strings."""
    table = [0] * len(stop)
    length = 0
    for i in range(1, len(stop)):
        while length and stop[i] != stop[length]:
            length = table[length - 1]
        if stop[i] == stop[length]:
            length += 1
        table[i] = length
    return tuple(table)
