"""One model runner over several controller processes: rank 0 leads, the others replay its device operations.

An engine whose runtime is multi-controller (JAX after ``jax.distributed.initialize``: the XLA engine)
spreads one model's shards over the devices of several processes, and each of them must then launch
the same programs in the same order. So every process builds the same :class:`ModelRunner` from the
same model, and then:

- rank 0 (the :class:`Leader`) runs the scheduler, and sends each device operation of its runner, a
  forward pass's batch description or a page read, write or copy, to the others before running it
  itself (through :meth:`ModelRunner.replicate_to`);
- every other rank (:func:`follow`) runs what it receives, in order, until the leader closes.

A follower sends nothing after its greeting, so the leader watches every channel (see :meth:`Leader.watch`): one that
ends (the follower's process died, or its host is gone and keepalive's probes went unanswered) is the group's end,
known at once rather than at the next operation, which would fail.

The engine joins and leaves the group (``pie_join_process_group``); what is here knows nothing of it.
The pass channel is a plain TCP connection from each follower to the leader, carrying a JSON header
and raw int32/float32 arrays (nothing is unpickled). It is as trusted as the engine's own coordinator
port: keep both on the cluster's private network. What a forward pass sends is its batch description
(a few bytes per token), never activations: those stay on the devices.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

import numpy as np

from pie.plugins import DeviceLost
from pie.runtime.model_runner import ForwardBatch, ModelRunner
from pie.sockets import keep_alive

PASS_ADDRESS_ENV = "PIE_PASS_ADDRESS"
"""host:port where rank 0 takes the followers' pass channels (default: the coordinator's host, its port + 1)."""
CONNECT_TIMEOUT_S = 300.0
"""How long a follower keeps trying to reach the leader, and the leader waits for every follower."""
HANDSHAKE_TIMEOUT_S = 10.0
"""How long the leader waits for a connection's first frame (a follower sends it as it connects): anything else on
the pass port (a port scan, a health check, an HTTP client) is dropped after this, and the leader goes on accepting."""
MAX_HEADER_BYTES = 1 << 20
"""The largest frame header a channel takes (a forward pass's is a few hundred bytes): a longer one is no pie frame."""
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 60, 10, 6
"""TCP keepalive on the pass channel: a leader (or follower) whose host vanished from the network sends no reset, and
an idle channel would wait on it for ever; probed, the wait ends within about two minutes as a ConnectionError."""

_DTYPES = {"<i4": np.int32, "<f4": np.float32}
_HEADER = struct.Struct("<I")
TOP = "__top__"
"""The ``forward_top`` frame's field holding ``top`` beside the batch's arrays."""
RANK = "process_id"
"""The ``follow`` greeting's field holding the follower's rank."""


@dataclass(frozen=True)
class ProcessGroup:
    """This process's place in an engine's multi-process runtime (``pie_join_process_group``'s answer)."""

    process_id: int
    num_processes: int
    coordinator: str | None = None
    """host:port of process 0's coordinator, where the engine knows it."""

    @property
    def leads(self) -> bool:
        return self.process_id == 0


def pass_address(group: ProcessGroup, given: str | None = None) -> tuple[str, int]:
    """Where the leader takes pass channels: ``given``, else ``PIE_PASS_ADDRESS``, else the coordinator's
    port + 1. ValueError when none is known or one is not host:port."""
    address = given or os.environ.get(PASS_ADDRESS_ENV)
    if address:
        return split_address(address)
    if not group.coordinator:
        raise ValueError(f"the engine did not say where its coordinator is: give the pass address ({PASS_ADDRESS_ENV})")
    host, port = split_address(group.coordinator)
    return host, port + 1


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{address!r} is not host:port")
    return host.strip("[]"), int(port)


# -- the pass channel ----------------------------------------------------------------


class Channel:
    """Frames over a socket: a JSON header (operation, array dtypes and shapes), then the arrays' bytes."""

    def __init__(self, sock: socket.socket):
        sock.settimeout(None)  # a follower waits on an idle leader for as long as it is idle (and its host answers)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        keep_alive(sock, KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES)
        self.sock = sock
        self._file = sock.makefile("rb")

    def send(self, op: str, arrays: dict[str, np.ndarray] | None = None) -> None:
        arrays = arrays or {}
        parts = {name: np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")) for name, a in arrays.items()}
        header = json.dumps({"op": op, "arrays": [[n, a.dtype.str, list(a.shape)] for n, a in parts.items()]}).encode()
        self.sock.sendall(b"".join([_HEADER.pack(len(header)), header, *(a.tobytes() for a in parts.values())]))

    def receive(self) -> tuple[str, dict[str, np.ndarray]]:
        """The next frame; raises ConnectionError when the other side is gone (or its socket's timeout passed), and
        ValueError for bytes that are no frame."""
        size = _HEADER.unpack(self._read(_HEADER.size))[0]
        if size > MAX_HEADER_BYTES:
            raise ValueError(f"a pass-channel frame header of {size} bytes (at most {MAX_HEADER_BYTES}): not a pie frame")
        op, described = _parse_header(self._read(size))
        arrays = {}
        for name, dtype, shape in described:
            if dtype not in _DTYPES:
                raise ValueError(f"the pass channel carries int32 and float32 arrays, not {dtype}")
            count = int(np.prod(shape, dtype=np.int64))
            data = self._read(count * 4)
            arrays[name] = np.frombuffer(data, dtype=_DTYPES[dtype]).reshape(shape).copy()
        return op, arrays

    def _read(self, size: int) -> bytes:
        try:
            data = self._file.read(size)
        except OSError as exc:  # reset, timed out (a socket timeout, or keepalive's probes unanswered)
            raise ConnectionError(f"the pass channel broke: {str(exc) or type(exc).__name__}") from None
        if len(data) != size:
            raise ConnectionError("the pass channel closed")
        return data

    def close(self) -> None:
        self._file.close()
        self.sock.close()


# -- rank 0 ----------------------------------------------------------------------------


class FollowerLost(DeviceLost):
    """A follower's pass channel ended while rank 0 led: every operation is run by all the processes together, so
    the group cannot go on."""


@dataclass(frozen=True)
class Follower:
    """A follower the leader took: its rank (from its greeting), the host it connected from, and its channel."""

    rank: int
    host: str
    channel: Channel


class Leader:
    """Rank 0's side: takes every follower's channel from ``listener`` (a socket listening at the pass address, which
    it closes), then is ``runner``'s replicas (:meth:`ModelRunner.replicate_to`): its passes (every process
    runs the same programs, the device sampling's too) and its page pool's reads, writes and copies (which host
    offload and copy-on-write go through) are sent to the followers before they run here."""

    def __init__(self, runner: ModelRunner, group: ProcessGroup, listener: socket.socket,
                 timeout: float = CONNECT_TIMEOUT_S):
        if not group.leads or group.num_processes < 2:
            listener.close()
            raise ValueError("only rank 0 of several processes leads")
        self.runner = runner
        self.num_processes = group.num_processes
        self.followers: list[Follower] = []
        dropped = 0
        address = listener.getsockname()
        try:
            deadline = time.monotonic() + timeout
            while len(self.followers) < group.num_processes - 1:
                left = deadline - time.monotonic()
                if left <= 0:
                    strays = f" ({dropped} other connection(s) sent no follower's greeting)" if dropped else ""
                    raise TimeoutError(f"{group.num_processes - 1 - len(self.followers)} follower(s) did not connect "
                                       f"to {address[0]}:{address[1]} within {timeout:g} s{strays}")
                listener.settimeout(left)
                try:
                    conn, (host, *_) = listener.accept()
                except TimeoutError:
                    continue  # the deadline passed: said above
                follower = _greeted(conn, host, min(left, HANDSHAKE_TIMEOUT_S))
                if follower is None:
                    dropped += 1
                else:
                    self.followers.append(follower)
        except BaseException:
            for follower in self.followers:
                follower.channel.close()
            raise
        finally:
            listener.close()
        self.lost: FollowerLost | None = None
        """Why the group cannot go on, once a follower is gone: every later operation raises it."""
        self._on_lost: Callable[[BaseException], object] | None = None
        self._lock = threading.Lock()
        self._wake, woken = socket.socketpair()
        self._watcher = threading.Thread(target=self._watch, args=(woken,), name="pie-pass-watch", daemon=True)
        self._watcher.start()
        runner.replicate_to(self)

    def watch(self, on_lost: Callable[[BaseException], object] | None) -> None:
        """Call ``on_lost`` with :attr:`lost` once a follower is gone (at once if one is already; None: no longer),
        on the thread that learned it: the watcher's, as soon as the follower's channel ends, or an operation's."""
        with self._lock:  # held while on_lost runs: none runs after watch(None) returns
            self._on_lost = on_lost
            if on_lost is not None and self.lost is not None:
                on_lost(self.lost)

    def send(self, op: str, arrays: dict[str, np.ndarray] | None = None) -> None:
        if self.lost is not None:
            raise self.lost
        for follower in self.followers:
            try:
                follower.channel.send(op, arrays)
            except OSError as exc:
                raise self._lose(follower, f"broke ({exc.strerror or exc})") from None

    def forward(self, batch: ForwardBatch, top: int | None) -> None:
        arrays = {f.name: getattr(batch, f.name) for f in fields(batch)}
        if top is None:
            self.send("forward", arrays)
        else:
            self.send("forward_top", {**arrays, TOP: np.array([top], np.int32)})

    def read_pages(self, page_ids: np.ndarray) -> None:
        self.send("read_pages", {"page_ids": np.asarray(page_ids, np.int32)})

    def write_pages(self, page_ids: np.ndarray, data: np.ndarray) -> None:
        self.send("write_pages", {"page_ids": np.asarray(page_ids, np.int32), "data": np.asarray(data, np.float32)})

    def copy_pages(self, source_ids: np.ndarray, destination_ids: np.ndarray) -> None:
        self.send("copy_pages", {"source_ids": np.asarray(source_ids, np.int32),
                                 "destination_ids": np.asarray(destination_ids, np.int32)})

    def close(self) -> None:
        """Let the followers go (they close their runners and leave the group); the runner runs alone again."""
        self.runner.replicate_to(None)
        with contextlib.suppress(OSError):  # (a watcher that saw a follower go has stopped already)
            self._wake.send(b"\0")
        self._watcher.join()
        self._wake.close()
        for follower in self.followers:
            try:
                follower.channel.send("stop")
            except OSError:
                pass
            follower.channel.close()
        self.followers = []

    def _watch(self, woken: socket.socket) -> None:
        """Wait until a follower's channel ends, or :meth:`close` wakes this up. A follower sends nothing after its
        greeting: its channel turns readable when it closes, is reset, or keepalive's probes go unanswered."""
        with woken, selectors.DefaultSelector() as selector:
            selector.register(woken, selectors.EVENT_READ)
            for follower in self.followers:
                selector.register(follower.channel.sock, selectors.EVENT_READ, follower)
            while True:
                for key, _ in selector.select():
                    if key.fileobj is woken:
                        return
                    follower = key.data
                    try:
                        if follower.channel.sock.recv(4096):
                            continue  # bytes out of turn: no follower sends them, and they end nothing
                        how = "closed"
                    except OSError as exc:
                        how = f"broke ({exc.strerror or exc})"
                    self._lose(follower, how)
                    return

    def _lose(self, follower: Follower, how: str) -> FollowerLost:
        """Note that ``follower`` is gone (the first time only) and tell the watcher of :meth:`watch`."""
        with self._lock:
            if self.lost is None:
                self.lost = FollowerLost(
                    f"process {follower.rank} of the group of {self.num_processes} (at {follower.host}) is gone: its "
                    f"pass channel {how}; every process runs each operation together, so the group cannot go on "
                    f"(see process {follower.rank}'s log)")
                if self._on_lost is not None:
                    self._on_lost(self.lost)
            return self.lost


# -- the other ranks -------------------------------------------------------------------


def follow(runner: ModelRunner, group: ProcessGroup, address: tuple[str, int],
           timeout: float = CONNECT_TIMEOUT_S) -> int:
    """Run rank 0's device operations on this process's ``runner`` until it closes; returns how many ran.

    Raises ConnectionError if the leader goes away without closing (the group cannot go on without it).
    """
    if group.leads:
        raise ValueError("rank 0 leads; only the other ranks follow")
    channel = _connect(address, timeout)
    device, pool = runner.pages.device, runner.pages.handle
    count = 0
    try:
        channel.send("follow", {RANK: np.array([group.process_id], np.int32)})
        for op, arrays in _frames(channel):
            if op == "stop":
                break
            if op == "forward":
                runner.forward(ForwardBatch(**arrays))
            elif op == "forward_top":
                top = int(arrays.pop(TOP)[0])
                runner.forward_top(ForwardBatch(**arrays), top)
            elif op == "read_pages":
                device.read_pages(pool, arrays["page_ids"])
            elif op == "write_pages":
                device.write_pages(pool, arrays["page_ids"], arrays["data"])
            elif op == "copy_pages":
                device.copy_pages(pool, arrays["source_ids"], arrays["destination_ids"])
            else:
                raise ValueError(f"the leader sent an operation this follower does not know: {op!r}")
            count += 1
    finally:
        channel.close()
    return count


def _greeted(conn: socket.socket, host: str, timeout: float) -> Follower | None:
    """The follower at ``conn`` if its first frame, within ``timeout``, is a follower's ``follow`` (with its rank);
    else None, closed."""
    channel = Channel(conn)
    channel.sock.settimeout(timeout)
    try:
        op, arrays = channel.receive()
    except (ConnectionError, ValueError):
        op, arrays = None, {}
    rank = arrays.get(RANK)
    if op != "follow" or rank is None or rank.shape != (1,):
        channel.close()
        return None
    channel.sock.settimeout(None)
    return Follower(int(rank[0]), host, channel)


def _parse_header(data: bytes) -> tuple[str, list[tuple[str, str, list[int]]]]:
    """A frame header's operation and its arrays' (name, dtype, shape); ValueError if it is not one."""
    try:
        header = json.loads(data)
        op, arrays = header["op"], [(str(n), str(d), [int(x) for x in shape]) for n, d, shape in header["arrays"]]
    except (ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"not a pass-channel frame header ({type(exc).__name__}: {exc})") from None
    if not isinstance(op, str):
        raise ValueError(f"not a pass-channel frame header (its op is {op!r})")
    return op, arrays


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
