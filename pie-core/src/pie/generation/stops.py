"""Stop strings over streamed text: emit what can no longer be part of a stop string."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feed text pieces; get back text safe to show, and whether a stop string was reached.

    Text that might be the start of a stop string is held back until it is
    either completed (generation stops, the stop string is not shown) or ruled out.
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
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        buffer = self._held + text
        found = [at for at in (buffer.find(stop) for stop in self.stop_strings) if at >= 0]
        if found:  # the earliest in the text, whatever the list's order: no stop string is ever shown
            self.stopped = True
            self._held = ""
            return buffer[: min(found)]
        hold = 0
        for stop in self.stop_strings:
            for size in range(min(len(stop) - 1, len(buffer)), 0, -1):
                if buffer.endswith(stop[:size]):
                    hold = max(hold, size)
                    break
        self._held = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held

