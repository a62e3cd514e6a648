"""The boundary between the host and an inferlet's worker process: framed JSON messages, logits in shared memory.

Messages are JSON objects, each sent as a 4-byte big-endian length and its UTF-8
bytes over a Unix socket pair (the fork server's messages also carry descriptors).
Nothing is pickled: the host reads what an
untrusted worker writes, so it parses only JSON, of bounded size, and checks
every field it uses (see :mod:`pie.inferlet.workers`).

Logit rows travel through one shared memory file (``memfd``) per worker, made
by the host and mapped by both: the worker reserves rows for a pass, names them
in its request, and the host writes the pass's logits there.
"""

from __future__ import annotations

import fcntl
import json
import math
import mmap
import os
import socket
import struct
from typing import Any

import numpy as np

HEADER = struct.Struct(">I")
MAX_WORKER_MESSAGE = 1 << 20
"""Largest message the host accepts from a worker (its own messages, the tokenizer, can be larger)."""
LOGIT_ROWS = 256
"""Logit rows in a worker's shared memory: the most a pass can return (``all_logits``) and the most in flight."""


class WireError(RuntimeError):
    """The other side broke the protocol (or went away)."""


class BadMessage(WireError):
    """The other side sent what the protocol does not allow: not JSON, no object with an ``op``, too large."""


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is past the range of a float")
    return value


def json_text(value: Any) -> bytes:
    """``value`` as compact JSON in UTF-8, as a client is sent it. ValueError for what strict JSON text cannot
    carry: NaN, infinities, a lone surrogate (half of a UTF-16 pair, which no UTF-8 text holds: refused, not
    replaced, as NaN is) and nesting deeper than the encoder's recursion reaches; TypeError for what is not JSON at
    all."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    except UnicodeEncodeError as exc:
        lone = exc.object[exc.start : exc.start + 1]
        raise ValueError(f"a string holds {lone!r}, a lone surrogate, which is no Unicode text") from None
    except RecursionError:
        raise ValueError("lists or objects nested too deeply for JSON") from None


def encode(message: dict[str, Any]) -> bytes:
    """A message as sent: its JSON in UTF-8, as :func:`json_text` measures a value (escaped as ``\\uXXXX``, a
    character outside ASCII took up to 12 bytes, and a value that passed the check came to several times the
    limit), but for a lone surrogate, which only an escape can carry."""
    try:
        body = json.dumps(message, separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        body = json.dumps(message, separators=(",", ":"), allow_nan=False).encode()
    return HEADER.pack(len(body)) + body


def decode(body: bytes) -> dict[str, Any]:
    try:
        # NaN and Infinity are not JSON, nor is 1e400 a float: none is passed on
        message = json.loads(body, parse_constant=_no_constant, parse_float=_finite)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadMessage(f"a message is not JSON: {exc}") from None
    except RecursionError:
        raise BadMessage("a message nests too deeply to be read") from None
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise BadMessage("a message is not an object with an 'op'")
    return message


def read_blocking(sock: socket.socket, limit: int | None = None) -> dict[str, Any]:
    """The next message from a blocking socket (the worker's side)."""
    (size,) = HEADER.unpack(_exactly(sock, HEADER.size))
    if limit is not None and size > limit:
        raise BadMessage(f"a message of {size} bytes is over the limit of {limit}")
    return decode(_exactly(sock, size))


def send_with_fds(sock: socket.socket, message: dict[str, Any], fds: list[int]) -> None:
    """One message and copies of ``fds`` (SCM_RIGHTS) in one ``sendmsg``: the descriptors ride on its first byte."""
    data = encode(message)
    sent = socket.send_fds(sock, [data], fds)
    if sent < len(data):
        sock.sendall(data[sent:])


def read_with_fds(sock: socket.socket, max_fds: int) -> tuple[dict[str, Any], list[int]]:
    """The next message from a blocking socket and the descriptors sent with it (see :func:`send_with_fds`)."""
    header, fds, _, _ = socket.recv_fds(sock, HEADER.size, max_fds)
    if not header:
        raise WireError("the other side closed the connection")
    try:
        header += _exactly(sock, HEADER.size - len(header))
        (size,) = HEADER.unpack(header)
        return decode(_exactly(sock, size)), fds
    except WireError:
        for fd in fds:
            os.close(fd)
        raise


def _exactly(sock: socket.socket, size: int) -> bytes:
    chunks, left = [], size
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise WireError("the other side closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


class LogitRows:
    """``LOGIT_ROWS`` rows of ``vocab`` float32 logits in a shared memory file."""

    def __init__(self, fd: int, vocab: int, *, writable: bool):
        self.fd = fd
        self.vocab = vocab
        self.size = LOGIT_ROWS * vocab * 4
        access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
        self._map = mmap.mmap(fd, self.size, access=access)
        self.rows = np.ndarray((LOGIT_ROWS, vocab), np.float32, buffer=self._map)

    @classmethod
    def create(cls, vocab: int) -> LogitRows:
        """A new shared memory file of the right size (the host's side), sealed at that size: the worker gets this
        descriptor, and a file it could shrink would end the host's next write to the mapping with SIGBUS (the
        whole server gone)."""
        fd = os.memfd_create("pie-logits", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, LOGIT_ROWS * vocab * 4)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        return cls(fd, vocab, writable=True)

    def write(self, start: int, logits: np.ndarray) -> None:
        self.rows[start : start + len(logits)] = logits

    def read(self, start: int, count: int) -> np.ndarray:
        """A copy of ``count`` rows: the inferlet may keep it after the rows are reused."""
        return np.array(self.rows[start : start + count])

    def close(self) -> None:
        del self.rows
        self._map.close()
        os.close(self.fd)


class RowAllocator:
    """Which of the ``LOGIT_ROWS`` rows are reserved by passes in flight (first fit of a contiguous run)."""

    def __init__(self, rows: int = LOGIT_ROWS):
        self._free = [(0, rows)]  # (start, count), sorted by start

    def take(self, count: int) -> int | None:
        for index, (start, free) in enumerate(self._free):
            if free >= count:
                if free == count:
                    del self._free[index]
                else:
                    self._free[index] = (start + count, free - count)
                return start
        return None

    def give(self, start: int, count: int) -> None:
        runs = sorted([*self._free, (start, count)])
        merged: list[tuple[int, int]] = []
        for begin, size in runs:
            if merged and merged[-1][0] + merged[-1][1] == begin:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                merged.append((begin, size))
        self._free = merged
