"""The WebGPU engine's browser device: the shared launchers' backend, run by a page in a browser.

The same split as :class:`pie_engine_wgpu.backend.WgpuBackend` (and the Vulkan engine's): the
shared launchers record dispatches, the shared host transfers sit on two copy primitives. Here
nothing touches a GPU API: buffers are numbered handles, and everything is recorded as binary
commands (:mod:`pie_engine_wgpu.protocol`) into one message, sent when a result is needed (a
download, page reads, synchronize). The page runs a message as one command buffer, so a forward
pass — its inputs' writes, every dispatch, the logits' copy — is one message out and one answer
back. Weights cross once, in chunks the page acknowledges (which bounds what waits in the
browser); pipelines and bind groups are created once and named by number afterwards.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
from pie.enginekit.shaders import Entry, wgsl
from pie.enginekit.shaders.launch import BufferRange
from pie.enginekit.shaders.pooled import PooledBackend

from pie_engine_wgpu.browser import BrowserTarget
from pie_engine_wgpu.page import PageSession
from pie_engine_wgpu.protocol import (
    BINDING_KINDS,
    MESSAGE_HEADER,
    PARAMS_BUFFER,
    PARAMS_CAPACITY,
    WANT_REPLY,
    Op,
)

CHUNK_BYTES = 8 << 20
"""Writes larger than this cross in pieces."""
MESSAGE_BYTES = 16 << 20
"""A message that grows past this is sent (and acknowledged) before more is recorded."""
_MAX_BIND_GROUPS = 8192
_MAX_WIRE_BYTES = 2**32 - 1
"""The largest buffer the wire format can name (a u32)."""
_TWO = struct.Struct("<3I")
_THREE = struct.Struct("<4I")
_DISPATCH = struct.Struct("<6I")


def _padded(data: bytes | bytearray | memoryview) -> bytes:
    tail = -len(data) % 4
    return bytes(data) + bytes(tail) if tail else bytes(data)


def _text(value: str) -> bytes:
    encoded = value.encode("utf-8")
    return struct.pack("<I", len(encoded)) + _padded(encoded)


class BrowserBackend(PooledBackend):
    """A browser page's WebGPU device with the state the shared launchers need (see :class:`pie.enginekit.shaders.launch.Backend`)."""

    def __init__(self, target: BrowserTarget, timeout: float):
        self.session = PageSession(target, timeout)
        hello = self.session.hello
        limits = hello["limits"]
        self.adapter: dict[str, Any] = hello
        self._commands = bytearray()
        self._seq = 0
        self._next_id = PARAMS_BUFFER + 1
        self._pipelines: dict[str, int] = {}
        self._bind_groups: dict[tuple[Any, ...], int] = {}
        super().__init__(
            int(limits["min_storage_buffer_offset_alignment"]),
            int(limits["max_storage_buffer_binding_size"]),
            int(limits["min_uniform_buffer_offset_alignment"]),
            PARAMS_CAPACITY,
            # the adapter's max buffer size, within what the wire format names: the page's device, asked for a
            # larger one, would report an error and be lost for good
            min(int(limits["max_buffer_size"]), _MAX_WIRE_BYTES),
        )

    @property
    def adapter_name(self) -> str:
        """What the adapter says it is (its description where the browser tells it), and its Dawn backend."""
        info = self.adapter
        name = info.get("description") or " ".join(str(info.get(k) or "") for k in ("vendor", "architecture", "device"))
        backend = f" ({info['backend']} backend)" if info.get("backend") else ""
        return (name.strip() or "unnamed adapter") + backend

    @property
    def submissions(self) -> int:
        """Command buffers the page has submitted (as of its last answer)."""
        return self.session.submissions

    def close(self) -> None:
        self.session.close()

    # -- buffers -------------------------------------------------------------------

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def _create_buffer(self, capacity: int) -> int:
        buffer = self._new_id()
        self._commands += _TWO.pack(Op.CREATE_BUFFER, buffer, capacity)
        return buffer

    def _destroy_buffer(self, buffer: int) -> None:
        # Ids are never reused, so a cached bind group of this buffer is never looked up again.
        self._commands += struct.pack("<2I", Op.DESTROY_BUFFER, buffer)

    def _clear(self, buffer: int, size: int) -> None:
        self._commands += _THREE.pack(Op.CLEAR, buffer, 0, size)

    def _write(self, buffer: int, offset: int, data: np.ndarray) -> None:
        """Recorded in order with what is recorded around it; a large write crosses in chunks."""
        for start in range(0, data.nbytes, CHUNK_BYTES):
            piece = data[start : start + CHUNK_BYTES]
            if len(self._commands) + piece.nbytes > MESSAGE_BYTES:
                self._send(reply=True)
            self._commands += _THREE.pack(Op.WRITE, buffer, offset + start, -(-piece.nbytes // 4) * 4)
            self._commands += piece.tobytes()
            self._commands += bytes(-piece.nbytes % 4)

    def _read(self, ranges: list[tuple[Any, int, int]]) -> np.ndarray:
        """Copy buffer ranges, concatenated, to the host: sends everything recorded and waits for the answer."""
        self._commands += struct.pack("<2I", Op.READ, len(ranges))
        for buffer, offset, size in ranges:
            self._commands += _TWO.pack(buffer, offset, size)
        answer = self._send(reply=True)
        assert answer is not None
        return np.frombuffer(answer, dtype=np.uint8).copy()

    # -- pipelines and dispatch ------------------------------------------------------

    def _pipeline(self, entry: Entry) -> int:
        found = self._pipelines.get(entry.name)
        if found is None:
            found = self._pipelines[entry.name] = self._new_id()
            command = bytearray(struct.pack("<4I", Op.PIPELINE, found, entry.params_size, len(entry.bindings)))
            for index, kind in entry.bindings:
                command += struct.pack("<2I", index, BINDING_KINDS[kind])
            command += _text(entry.name) + _text(entry.code or wgsl(entry.name))
            self._commands += command
        return found

    def _bind_group(self, entry: Entry, pipeline: int, bindings: Sequence[BufferRange]) -> int:
        key = (pipeline, *bindings)
        found = self._bind_groups.get(key)
        if found is not None:
            return found
        if len(self._bind_groups) >= _MAX_BIND_GROUPS:
            self._bind_groups.clear()
            self._commands += struct.pack("<I", Op.FORGET_BIND_GROUPS)
        found = self._bind_groups[key] = self._new_id()
        command = bytearray(struct.pack("<4I", Op.BIND_GROUP, found, pipeline, 1 + len(bindings)))
        command += struct.pack("<4I", entry.uniform_binding, PARAMS_BUFFER, 0, entry.params_size)
        for (index, _), (buffer, offset, size) in zip(entry.storage_bindings, bindings, strict=True):
            command += struct.pack("<4I", index, buffer, offset, size)
        self._commands += command
        return found

    def dispatch(
        self, entry: Entry, params: bytes, bindings: Sequence[BufferRange], groups: tuple[int, int, int]
    ) -> None:
        group = self._bind_group(entry, self._pipeline(entry), bindings)
        offset = self._place_params(params)
        self._commands += _DISPATCH.pack(Op.DISPATCH, group, offset, *groups)

    # -- messages --------------------------------------------------------------------

    def _send(self, reply: bool) -> bytes | None:
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        params, commands = self._take_params(), self._commands
        self._commands = bytearray()
        header = MESSAGE_HEADER.pack(self._seq, WANT_REPLY if reply else 0, len(params))
        return self.session.exchange(b"".join((header, _padded(params), commands)), self._seq, reply)

    def flush(self) -> None:
        """Send everything recorded so far (without waiting for it to run)."""
        if self._commands:
            self._send(reply=False)

    def synchronize(self) -> None:
        """Send everything recorded and wait until the page's device has run it."""
        self._send(reply=True)
