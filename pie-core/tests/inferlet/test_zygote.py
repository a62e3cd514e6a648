"""The fork server's child: whatever happens in it, it ends with its exit status and never returns."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from pie.inferlet import zygote


class _BrokenStream:
    def write(self, text: str) -> int:
        raise OSError("the stream is gone")

    def flush(self) -> None:
        raise OSError("the stream is gone")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="the fork server runs where os.fork exists (Linux)")
def test_a_worker_whose_streams_fail_as_it_ends_still_exits_and_never_returns(tmp_path: Path) -> None:
    """A run that failed past serve_one, with stderr an object that raises (an inferlet can leave one): printing
    its traceback raised, and the child returned into the fork server's own code, a second fork server."""
    reads, writes = zip(*(os.pipe() for _ in range(3)), strict=True)
    pid = os.fork()
    if pid == 0:  # the child: exit 99 only if become_worker returned
        try:
            def failing_run(*args: object) -> int:
                raise RuntimeError("the run failed")

            zygote.serve_one = failing_run  # type: ignore[assignment]
            sys.stderr = sys.stdout = _BrokenStream()  # type: ignore[assignment]
            parent = object.__new__(zygote._Parent)
            parent.tokenizer = parent.vocab = parent.sandbox = parent.python = None  # type: ignore[attr-defined]
            parent.become_worker(list(writes), str(tmp_path))
        finally:
            os._exit(99)
    for fd in (*reads, *writes):
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 1
