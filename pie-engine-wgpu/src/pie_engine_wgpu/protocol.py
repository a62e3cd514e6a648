"""The wire format between the browser device's backend and its page (``static/host.js`` mirrors it).

Every WebSocket frame is binary and little-endian, in 4-byte words. A message from the
engine is a header ``seq, flags, params_bytes`` followed by the uniform block of the
message's dispatches (padded to 4 bytes) and then commands, each an opcode and its
words; byte payloads (written data, names, WGSL) are a length word and the bytes, padded
to 4. The page records all GPU work of one message into one command buffer and submits
it once; a message whose flags ask for a reply is answered with the bytes its ``READ``
copied back (or none). Frames from the page are ``kind, seq, submissions, page_ms, record_ms``
(float32 milliseconds the page spent on the message, and of those until it was submitted) and
a payload: a reply's bytes, an error's or a lost device's text, the hello's JSON.
"""

from __future__ import annotations

import struct
from enum import IntEnum


class Op(IntEnum):
    CREATE_BUFFER = 1
    """id, size: a storage buffer (STORAGE | COPY_SRC | COPY_DST)."""
    DESTROY_BUFFER = 2
    """id: destroyed after the message's submission."""
    WRITE = 3
    """id, offset, size, bytes: in order with the message's recorded work."""
    CLEAR = 4
    """id, offset, size: zero-filled."""
    PIPELINE = 5
    """id, params_size, count, (binding, binding kind) * count, name, WGSL: a compute pipeline."""
    BIND_GROUP = 6
    """id, pipeline id, count, (binding, buffer id, offset, size) * count; buffer 0 is the uniform block."""
    DISPATCH = 7
    """bind group id, uniform offset, x, y, z."""
    FORGET_BIND_GROUPS = 8
    """drop every bind group."""
    READ = 9
    """count, (buffer id, offset, size) * count: copied back, concatenated, in the reply."""


class Frame(IntEnum):
    REPLY = 1
    ERROR = 2
    LOST = 3
    HELLO = 4
    FATAL = 5


BINDING_KINDS = {"uniform": 0, "read": 1, "read_write": 2}
WANT_REPLY = 1
PARAMS_BUFFER = 0
"""Buffer id of the page's uniform-block buffer, written from each message's params."""
PARAMS_CAPACITY = 1 << 20
MESSAGE_HEADER = struct.Struct("<3I")
FRAME_HEADER = struct.Struct("<3I2f")
FRAME_HEADER_BYTES = FRAME_HEADER.size
