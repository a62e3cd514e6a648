"""The XLA engine across processes: one mesh over every process's devices, one scheduler on rank 0.

JAX runs multi-controller: after :func:`initialize` (``jax.distributed.initialize``), every
process sees the devices of all of them in ``jax.devices()``, so the engine's mesh
(:mod:`pie_engine_xla.mesh`) and its tensor-parallel layout (:mod:`pie_engine_xla.layout`)
span the processes unchanged, and XLA's collectives cross between them (gloo on the CPU,
ICI/DCN on TPUs). The price of multi-controller is that every process must launch the same
programs in the same order. So every process builds the same model runner from the same
model (each reads the weights itself; each keeps only its shards on its devices), and then:

- rank 0 (the :class:`Leader`) runs the scheduler, and sends each device operation of its
  runner, a forward pass's batch description or a page read or write, to the others before
  running it itself;
- every other rank (:func:`follow`) runs what it receives, in order, until the leader closes.

The pass channel is a plain TCP connection from each follower to the leader, carrying a JSON
header and raw int32/float32 arrays (nothing is unpickled). It is as trusted as JAX's own
coordinator port: keep both on the cluster's private network.

What a forward pass sends is its batch description (FlashInfer-style index arrays: a few
bytes per token), never activations: those stay on the devices.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"
"""JAX's own variable for the coordinator (host:port of process 0); JAX reads it too."""
NUM_PROCESSES_ENV = "JAX_NUM_PROCESSES"
PROCESS_ID_ENV = "JAX_PROCESS_ID"
PASS_ADDRESS_ENV = "PIE_XLA_PASS_ADDRESS"
"""host:port where rank 0 takes the followers' pass channels (default: the coordinator's host, its port + 1)."""
CONNECT_TIMEOUT_S = 300.0
"""How long a follower keeps trying to reach the leader, and the leader waits for every follower."""

_DTYPES = {"<i4": np.int32, "<f4": np.float32}
_HEADER = struct.Struct("<I")


@dataclass(frozen=True)
class ProcessGroup:
    """This process's place in the JAX distributed runtime."""

    process_id: int
    num_processes: int
    coordinator: str | None
    pass_address: tuple[str, int] | None
    """Where the leader takes pass channels (None with one process)."""

    @property
    def leads(self) -> bool:
        return self.process_id == 0


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    pass_address: str | None = None,
) -> ProcessGroup:
    """Join the JAX distributed runtime, before anything else touches JAX.

    Arguments win; then ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``;
    what is still unknown JAX detects itself where it can (Cloud TPU pods, Slurm, Open MPI,
    Kubernetes). A single process (``num_processes=1``) skips the runtime entirely.
    """
    import jax

    coordinator = coordinator or os.environ.get(COORDINATOR_ENV) or None
    num_processes = num_processes if num_processes is not None else _env_int(NUM_PROCESSES_ENV)
    process_id = process_id if process_id is not None else _env_int(PROCESS_ID_ENV)
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"the number of processes must be at least 1, not {num_processes}")
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"process id {process_id} is outside 0..{num_processes - 1}")
    if num_processes == 1:
        return ProcessGroup(0, 1, None, None)
    jax.distributed.initialize(coordinator, num_processes, process_id)
    coordinator = coordinator or os.environ.get(COORDINATOR_ENV) or _detected_coordinator()
    group_size, rank = jax.process_count(), jax.process_index()
    address = pass_address or os.environ.get(PASS_ADDRESS_ENV) or _next_port(coordinator)
    return ProcessGroup(rank, group_size, coordinator, _split(address) if address else None)


def _detected_coordinator() -> str | None:
    """The coordinator JAX found itself (a TPU pod, Slurm); JAX keeps it only in its private state."""
    try:
        from jax._src import distributed

        return getattr(distributed.global_state, "coordinator_address", None)
    except (ImportError, AttributeError):
        return None


def shutdown() -> None:
    import jax

    jax.distributed.shutdown()


def _env_int(name: str) -> int | None:
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number") from None


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{address!r} is not host:port")
    return host.strip("[]"), int(port)


def _next_port(coordinator: str | None) -> str | None:
    if not coordinator:
        return None
    host, port = _split(coordinator)
    return f"{host}:{port + 1}"


# -- the pass channel ----------------------------------------------------------------


class Channel:
    """Frames over a socket: a JSON header (operation, array dtypes and shapes), then the arrays' bytes."""

    def __init__(self, sock: socket.socket):
        sock.settimeout(None)  # a follower waits on an idle leader for as long as it is idle
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._file = sock.makefile("rb")

    def send(self, op: str, arrays: dict[str, np.ndarray] | None = None) -> None:
        arrays = arrays or {}
        parts = {name: np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")) for name, a in arrays.items()}
        header = json.dumps({"op": op, "arrays": [[n, a.dtype.str, list(a.shape)] for n, a in parts.items()]}).encode()
        self.sock.sendall(b"".join([_HEADER.pack(len(header)), header, *(a.tobytes() for a in parts.values())]))

    def receive(self) -> tuple[str, dict[str, np.ndarray]]:
        """The next frame; raises ConnectionError when the other side is gone."""
        header = json.loads(self._read(_HEADER.unpack(self._read(_HEADER.size))[0]))
        arrays = {}
        for name, dtype, shape in header["arrays"]:
            if dtype not in _DTYPES:
                raise ValueError(f"the pass channel carries int32 and float32 arrays, not {dtype}")
            count = int(np.prod(shape, dtype=np.int64))
            data = self._read(count * 4)
            arrays[name] = np.frombuffer(data, dtype=_DTYPES[dtype]).reshape(shape).copy()
        return header["op"], arrays

    def _read(self, size: int) -> bytes:
        data = self._file.read(size)
        if len(data) != size:
            raise ConnectionError("the pass channel closed")
        return data

    def close(self) -> None:
        self._file.close()
        self.sock.close()


# -- rank 0 ----------------------------------------------------------------------------


class Leader:
    """Rank 0's runner, made to send each of its device operations to every follower first.

    Wraps ``runner`` in place: its passes (``forward``, ``forward_top``: every process runs the same
    programs, the device sampling's too) and its page pool's reads, writes and copies (which host offload
    and copy-on-write go through) are sent before they run here.
    """

    def __init__(self, runner: Any, group: ProcessGroup, timeout: float = CONNECT_TIMEOUT_S):
        if not group.leads or group.pass_address is None:
            raise ValueError("only rank 0 of several processes leads")
        self.runner = runner
        self.channels: list[Channel] = []
        listener = socket.create_server(group.pass_address, reuse_port=False)
        listener.settimeout(timeout)
        try:
            deadline = time.monotonic() + timeout
            while len(self.channels) < group.num_processes - 1:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{group.num_processes - 1 - len(self.channels)} follower(s) did not connect "
                                       f"to {group.pass_address[0]}:{group.pass_address[1]} within {timeout:g} s")
                conn, _ = listener.accept()
                channel = Channel(conn)
                op, _ = channel.receive()
                if op != "follow":
                    channel.close()
                    continue
                self.channels.append(channel)
        finally:
            listener.close()
        self._forward, self._forward_top = runner.forward, runner.forward_top
        runner.forward, runner.forward_top = self.forward, self.forward_top
        runner.pages.device = _LeadingDevice(runner.pages.device, self)

    def send(self, op: str, arrays: dict[str, np.ndarray] | None = None) -> None:
        for channel in self.channels:
            channel.send(op, arrays)

    def forward(self, batch: Any) -> np.ndarray:
        self.send("forward", _batch_arrays(batch))
        return self._forward(batch)

    def forward_top(self, batch: Any, top: int) -> Any:
        self.send("forward_top", {**_batch_arrays(batch), TOP: np.array([top], np.int32)})
        return self._forward_top(batch, top)

    def close(self) -> None:
        """Let the followers go (they close their runners and leave the distributed runtime)."""
        for channel in self.channels:
            try:
                channel.send("stop")
            except OSError:
                pass
            channel.close()
        self.channels = []


TOP = "__top__"
"""The ``forward_top`` frame's field holding ``top`` beside the batch's arrays."""


def _batch_arrays(batch: Any) -> dict[str, np.ndarray]:
    return {f.name: getattr(batch, f.name) for f in fields(batch)}


class _LeadingDevice:
    """The leader's page pool's device: page reads, writes and copies are sent to the followers first; the
    rest passes through."""

    def __init__(self, device: Any, leader: Leader):
        self._device = device
        self._leader = leader

    def __getattr__(self, name: str) -> Any:
        return getattr(self._device, name)

    def read_pages(self, pool: Any, page_ids: np.ndarray) -> np.ndarray:
        self._leader.send("read_pages", {"page_ids": np.asarray(page_ids, np.int32)})
        return self._device.read_pages(pool, page_ids)

    def write_pages(self, pool: Any, page_ids: np.ndarray, data: np.ndarray) -> None:
        self._leader.send("write_pages", {"page_ids": np.asarray(page_ids, np.int32),
                                          "data": np.asarray(data, np.float32)})
        self._device.write_pages(pool, page_ids, data)

    def copy_pages(self, pool: Any, source_ids: np.ndarray, destination_ids: np.ndarray) -> None:
        self._leader.send("copy_pages", {"source_ids": np.asarray(source_ids, np.int32),
                                         "destination_ids": np.asarray(destination_ids, np.int32)})
        self._device.copy_pages(pool, source_ids, destination_ids)


# -- the other ranks -------------------------------------------------------------------


def follow(runner: Any, group: ProcessGroup, timeout: float = CONNECT_TIMEOUT_S) -> int:
    """Run rank 0's device operations on this process's ``runner`` until it closes; returns how many ran.

    Raises ConnectionError if the leader goes away without closing (the group cannot go on without it).
    """
    from pie.runtime.model_runner import ForwardBatch

    if group.leads or group.pass_address is None:
        raise ValueError("rank 0 leads; only the other ranks follow")
    channel = _connect(group.pass_address, timeout)
    count = 0
    try:
        channel.send("follow")
        for op, arrays in _frames(channel):
            if op == "stop":
                break
            if op == "forward":
                runner.forward(ForwardBatch(**arrays))
            elif op == "forward_top":
                top = int(arrays.pop(TOP)[0])
                runner.forward_top(ForwardBatch(**arrays), top)
            elif op == "read_pages":
                runner.pages.device.read_pages(runner.pages.handle, arrays["page_ids"])
            elif op == "write_pages":
                runner.pages.device.write_pages(runner.pages.handle, arrays["page_ids"], arrays["data"])
            elif op == "copy_pages":
                runner.pages.device.copy_pages(runner.pages.handle, arrays["source_ids"], arrays["destination_ids"])
            else:
                raise ValueError(f"the leader sent an operation this follower does not know: {op!r}")
            count += 1
    finally:
        channel.close()
    return count


def _frames(channel: Channel) -> Iterator[tuple[str, dict[str, np.ndarray]]]:
    while True:
        yield channel.receive()


def _connect(address: tuple[str, int], timeout: float) -> Channel:
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Channel(socket.create_connection(address, timeout=10))
        except OSError as exc:
            if time.monotonic() > deadline:
                raise ConnectionError(f"cannot reach the leader at {address[0]}:{address[1]}: {exc}") from None
            time.sleep(0.2)
