"""The shared logit rows between the host and an inferlet worker, which holds their descriptor."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pie.inferlet.wire import LogitRows


def test_a_worker_cannot_resize_the_shared_logit_rows() -> None:
    """The worker gets the rows' descriptor. `os.ftruncate(fd, 0)` there (no sandbox layer refuses it on a descriptor
    it holds) made the host's next write to its mapping a SIGBUS: every request of the server gone at once."""
    rows = LogitRows.create(vocab=64)
    try:
        for size in (0, rows.size // 2, rows.size + 4096):
            with pytest.raises(PermissionError):
                os.ftruncate(rows.fd, size)
        assert os.fstat(rows.fd).st_size == rows.size
        rows.write(0, np.ones((2, 64), np.float32))
        assert rows.read(0, 2).sum() == 128
    finally:
        rows.close()
