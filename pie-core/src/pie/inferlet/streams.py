"""pie's standard output and error under ``pie run --inferlet``, kept from what the inferlet does to them.

The inferlet runs in pie's process: it may replace ``sys.stdout`` or ``sys.stderr`` (with a StringIO, None,
anything), close them, or close descriptors 1 and 2. pie prints what the inferlet emits and returns on the standard
output it was started with, and its own messages on that standard error: :class:`StandardStreams` holds both from
before the inferlet's code runs and puts them back after. An inferlet that closed standard output (or put another
file at descriptor 1) has left its values nowhere to go: that is its failure (:class:`StdoutClosed`). One that closed
standard error still has pie's messages reach it, through a copy of its descriptor taken before.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO


class StdoutClosed(RuntimeError):
    """The inferlet closed pie's standard output (``sys.stdout``, or descriptor 1), where its values are printed."""

    def __init__(self) -> None:
        super().__init__("the inferlet closed standard output, where pie prints what it emits and returns")


class _Kept:
    """One of pie's standard streams as it was: the object, its descriptor and the file that descriptor was."""

    def __init__(self, stream: TextIO | None):
        self.stream = stream
        self.fd = _descriptor(stream)
        self.file = _file_of(self.fd)
        self.encoding = getattr(stream, "encoding", None) or "utf-8"
        self.errors = getattr(stream, "errors", None) or "backslashreplace"

    def intact(self) -> bool:
        """Whether the stream is open and its descriptor (where it has one) is still the file it was."""
        if self.stream is None or getattr(self.stream, "closed", False):
            return False
        return self.fd is None or _file_of(self.fd) == self.file


class StandardStreams:
    """``sys.stdout`` and ``sys.stderr`` as pie had them before an inferlet's code ran: to print to, to put back."""

    def __init__(self) -> None:
        self._out = _Kept(sys.stdout)
        self._err = _Kept(sys.stderr)
        self._err_copy = _copy(self._err.fd)
        self._err_again: TextIO | None = None

    @property
    def stdout_closed(self) -> bool:
        """Whether the inferlet closed standard output (there was one to close)."""
        return self._out.stream is not None and not self._out.intact()

    def print_value(self, text: str) -> None:
        """``text`` and a newline on pie's standard output, flushed (nothing where pie had none); StdoutClosed where
        the inferlet closed it. Other failures (a full disk, a closed pipe) are pie's to report, as for any output."""
        stream = self._out.stream
        if stream is None:
            return
        if not self._out.intact():
            raise StdoutClosed
        try:
            stream.write(text + "\n")  # one write: a line no thread of the inferlet's can cut in two
            stream.flush()
        except (OSError, ValueError):
            if self._out.intact():
                raise
            raise StdoutClosed from None  # closed while printing (by a thread of the inferlet's)

    def say(self, text: str) -> None:
        """``text`` on pie's standard error (through the copy of its descriptor where the inferlet closed it), while
        the inferlet may still hold ``sys.stderr``; nothing where even that cannot be written."""
        stream = self._err.stream if self._err.intact() else self._stderr_again()
        try:
            stream.write(text)
            stream.flush()
        except (OSError, ValueError, AttributeError):  # AttributeError: pie had no stderr (None)
            pass

    def restore(self) -> None:
        """Put pie's streams back in ``sys``. A standard output the inferlet closed becomes /dev/null: what it still
        holds is lost either way, and flushing it at exit would fail as a traceback. A standard error it closed is
        written again through the copy of its descriptor."""
        if self.stdout_closed:
            sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - open for the process's life
        else:
            sys.stdout = self._out.stream  # type: ignore[assignment]  # None where pie had none, as it was
        sys.stderr = self._err.stream if self._err.intact() else self._stderr_again()  # type: ignore[assignment]

    def __enter__(self) -> StandardStreams:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Put the streams back (an exception on its way out is told on pie's standard error) and close the copy of
        standard error's descriptor, unless pie writes through it now."""
        self.restore()
        if self._err_copy is not None and self._err_again is None:
            os.close(self._err_copy)
            self._err_copy = None

    def _stderr_again(self) -> TextIO:
        if self._err_again is None:
            if self._err_copy is None:
                self._err_again = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - open for the process's life
            else:
                self._err_again = open(  # noqa: SIM115 - open for the process's life
                    self._err_copy, "w", buffering=1, encoding=self._err.encoding, errors=self._err.errors
                )
        return self._err_again


def _descriptor(stream: TextIO | None) -> int | None:
    try:
        return stream.fileno() if stream is not None else None
    except (OSError, ValueError, AttributeError):  # io.UnsupportedOperation is both: a StringIO, pytest's capture
        return None


def _file_of(fd: int | None) -> tuple[int, int] | None:
    if fd is None:
        return None
    try:
        status = os.fstat(fd)
    except OSError:
        return None
    return status.st_dev, status.st_ino


def _copy(fd: int | None) -> int | None:
    if fd is None:
        return None
    try:
        return os.dup(fd)
    except OSError:  # closed already, or no descriptor left: messages then go where the stream goes
        return None
