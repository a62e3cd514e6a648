"""Hostile frames from a worker: whatever bytes arrive, the host reads a message (an object with a string ``op``)
or a `BadMessage`/`WireError`, never another exception.

Hypothesis draws random bytes, valid messages with bytes flipped, inserted or cut, JSON values of every shape,
and known hostile bodies (deep nesting, huge numbers, NaN, lone surrogates); the run is derandomized (the same
examples every run). A wider sweep (20,000 examples) found nothing more."""

from __future__ import annotations

import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pie.inferlet.wire import HEADER, BadMessage, WireError, decode, encode, json_text, read_blocking

VALID = [
    encode({"op": "forward", "run": 1, "seq": 1, "tokens": [1, 2, 3], "logits": True, "all_logits": False, "row": 0,
            "id": 7})[HEADER.size:],
    encode({"op": "emit", "run": 1, "value": {"a": [1.5, "x\u2028", None, True]}})[HEADER.size:],
    encode({"op": "result", "run": 1, "value": 1e308, "error": None, "where": "", "threads_left": 0,
            "engine_failure": False})[HEADER.size:],
]
HOSTILE = [
    b'{"op":"x","v":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"op":"x","v":' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}",
    b'{"op":"x","v":1' + b"0" * 5000 + b"}",
    b'{"op":"x","v":1e999}',
    b'{"op":"x","v":-Infinity}',
    b'{"op":"x","v":"\\ud800"}',
    b'{"op":"x","v":"\xff"}',
    b'\xef\xbb\xbf{"op":"x"}',
    b'{"op":"x"}\x00',
    b'{"op":1}',
    b"[]",
]


@st.composite
def damaged(draw) -> bytes:
    body = draw(st.sampled_from(VALID))
    at = draw(st.integers(0, len(body)))
    return body[:at] + draw(st.binary(max_size=8)) + body[at + draw(st.integers(0, 4)):]


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner),
    max_leaves=20,
)
BODIES = st.one_of(
    st.binary(max_size=200),
    damaged(),
    JSON_VALUES.map(lambda v: encode({"op": "x", "v": v})[HEADER.size:]),
    st.sampled_from(HOSTILE),
)


@settings(max_examples=400, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(BODIES)
def test_any_body_is_a_message_or_bad_message(body: bytes) -> None:
    try:
        message = decode(body)
    except BadMessage:
        return
    assert isinstance(message, dict) and isinstance(message["op"], str)
    try:
        json_text(message)  # what the host passes on to a client: strict JSON text, or ValueError
    except ValueError:
        pass


@pytest.mark.parametrize(("size", "body"), [(2**32 - 1, b""), (5, b"{}"), (0, b""), (3, b""), (12, b'{"op":"x"}')])
def test_a_frame_that_lies_about_its_size_is_a_wire_error(size: int, body: bytes) -> None:
    host, worker = socket.socketpair()
    with host, worker:
        host.settimeout(5)
        worker.sendall(HEADER.pack(size) + body)
        worker.close()
        with pytest.raises(WireError):
            read_blocking(host, limit=1 << 20)
