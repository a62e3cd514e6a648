"""One runner over several processes (pie.runtime.replicated), here as two CPU-engine runners in one
process: the leader's passes and page operations reach the follower's runner, in order, over loopback."""

from __future__ import annotations

import socket
import struct
import threading
from typing import Any

import numpy as np
import pytest
from pie.hookspecs import hookimpl
from pie.plugins import DeviceLost, EngineError, EngineRegistry
from pie.runtime.model_runner import ForwardBatch, ModelRunner, SequenceWork
import pie.runtime.replicated as replicated
from pie.runtime.replicated import (
    PASS_ADDRESS_ENV,
    Channel,
    Leader,
    ProcessGroup,
    follow,
    pass_address,
    split_address,
)
from pie.testing.models import random_weights, tiny_config


def _runner() -> ModelRunner:
    config = tiny_config()
    device = EngineRegistry(env={"PIE_ENGINES": "cpu"}).engine("cpu").open(0)
    return ModelRunner(config, random_weights(config).items(), device, page_size=4, max_cached_tokens=64)


def _listener() -> socket.socket:
    """Where a leader takes its followers, on a free loopback port."""
    return socket.create_server(("127.0.0.1", 0))


class Recorder:
    """Replicas that write down what they were sent."""

    def __init__(self) -> None:
        self.operations: list[tuple[Any, ...]] = []

    def forward(self, batch: ForwardBatch, top: int | None) -> None:
        self.operations.append(("forward", top, batch.ids.tolist()))

    def read_pages(self, page_ids: np.ndarray) -> None:
        self.operations.append(("read", page_ids.tolist()))

    def write_pages(self, page_ids: np.ndarray, data: np.ndarray) -> None:
        self.operations.append(("write", page_ids.tolist(), data.shape))

    def copy_pages(self, source_ids: np.ndarray, destination_ids: np.ndarray) -> None:
        self.operations.append(("copy", source_ids.tolist(), destination_ids.tolist()))


def test_replicas_get_every_pass_and_page_operation_before_it_runs_and_none_after_they_are_dropped() -> None:
    runner = _runner()
    recorder = Recorder()
    runner.replicate_to(recorder)
    first = runner.new_sequence()
    runner.step([SequenceWork(first, [1, 2, 3, 4, 5])])
    fork = first.fork()  # 5 tokens in pages of 4: the fork shares a half-full page, copied on its first write
    runner.step_top([SequenceWork(fork, [6])], 3)
    with pytest.raises(ValueError, match="top must be"):
        runner.step_top([SequenceWork(first, [7])], 0)  # refused here: nothing to send
    data = runner.pages.read([0])
    runner.pages.write([1], data)
    assert recorder.operations == [
        ("forward", None, [1, 2, 3, 4, 5]),
        ("copy", [first.pages[1]], [fork.pages[1]]),
        ("forward", 3, [6]),
        ("read", [0]),
        ("write", [1], data.shape),
    ]
    runner.replicate_to(None)
    runner.step([SequenceWork(first, [8])])
    assert len(recorder.operations) == 5
    runner.close()


def test_a_follower_replays_the_leaders_operations_and_ends_with_the_same_pool() -> None:
    leading, following = _runner(), _runner()
    listener = _listener()
    address = listener.getsockname()
    followed: list[int] = []
    thread = threading.Thread(target=lambda: followed.append(follow(following, ProcessGroup(1, 2), address)))
    thread.start()
    leader = Leader(leading, ProcessGroup(0, 2), listener, timeout=60)
    lost: list[BaseException] = []
    leader.watch(lost.append)
    sequences = [leading.new_sequence() for _ in range(2)]
    logits = leading.step([SequenceWork(s, p) for s, p in zip(sequences, ([3, 1, 4, 1, 5, 9], [2, 6]))])
    sequences.append(sequences[0].fork())
    for step in range(3):
        leading.step_top([SequenceWork(s, [10 + step + i]) for i, s in enumerate(sequences)], 1)
    pages = np.arange(leading.layout.num_pages, dtype=np.int32)
    leading_pool = leading.pages.read(pages)
    leader.close()
    thread.join(60)
    # 4 passes, the fork's copy-on-write, the pool read back.
    assert followed == [6]
    assert lost == []  # a follower let go is not lost
    assert logits.shape[0] == 2 and leading.replicas is None
    # Equal but for rounding: the two runners share this process's kernel threads, and a kernel launched while the
    # other runner's holds them runs as one chunk, its rows cut into other blocks (seen once, on a loaded machine).
    np.testing.assert_allclose(following.pages.read(pages), leading_pool, rtol=1e-5, atol=1e-6)
    assert np.abs(leading_pool).sum() > 0
    leading.close()
    following.close()


def test_a_follower_whose_leader_vanishes_raises_connection_error() -> None:
    runner = _runner()
    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()

    def leave_without_stop() -> None:
        conn, _ = listener.accept()
        Channel(conn).receive()  # its "follow"
        conn.close()

    thread = threading.Thread(target=leave_without_stop)
    thread.start()
    with pytest.raises(ConnectionError, match="closed"):
        follow(runner, ProcessGroup(1, 2), address, timeout=30)
    thread.join(30)
    listener.close()
    runner.close()


class Unreplicated:
    """A runner the leader only hands itself to: what these tests look at is how the leader starts."""

    def __init__(self) -> None:
        self.replicas: Any = None

    def replicate_to(self, replicas: Any) -> None:
        self.replicas = replicas


def test_a_leader_no_follower_joins_says_where_it_waited() -> None:
    """The listener's own timeout ended the wait first, with a bare "timed out"."""
    listener = _listener()
    port = listener.getsockname()[1]
    with pytest.raises(TimeoutError, match=rf"1 follower\(s\) did not connect to 127.0.0.1:{port} within 0.5 s"):
        Leader(Unreplicated(), ProcessGroup(0, 2), listener, timeout=0.5)  # type: ignore[arg-type]


@pytest.mark.parametrize("greeting", [b"", b"GET / HTTP/1.1\r\nHost: pie\r\n\r\n"], ids=["silent", "http"])
def test_a_leader_drops_a_stray_connection_and_takes_the_follower_behind_it(
    monkeypatch: pytest.MonkeyPatch, greeting: bytes
) -> None:
    """A connection that sent nothing held the leader for as long as it stayed open, whatever its timeout; one that
    sent HTTP had its "GET " read as a 542 MB header, waited for. The follower behind either was never taken."""
    monkeypatch.setattr(replicated, "HANDSHAKE_TIMEOUT_S", 0.5)
    listener = _listener()
    address = listener.getsockname()
    runner = Unreplicated()
    led: list[Leader | Exception] = []

    def lead() -> None:
        try:
            led.append(Leader(runner, ProcessGroup(0, 2), listener, timeout=60))  # type: ignore[arg-type]
        except Exception as exc:  # the test's to report
            led.append(exc)

    thread = threading.Thread(target=lead, daemon=True)
    thread.start()
    stray = replicated._connect(address, 30)  # accepted first: it connects before the follower
    try:
        stray.sock.sendall(greeting)
        follower = replicated._connect(address, 30)
        follower.send("follow", {replicated.RANK: np.array([1], np.int32)})
        thread.join(30)
    finally:
        stray.close()  # (what ends the wait of a leader that waits on it)
    thread.join(30)
    assert len(led) == 1 and isinstance(led[0], Leader), led
    assert runner.replicas is led[0]
    led[0].close()
    assert follower.receive()[0] == "stop"
    follower.close()


def _led_by(listener: socket.socket, runner: Any) -> tuple[Leader, Channel]:
    """A leader of two processes, and the channel of its follower (played here)."""
    led: list[Leader] = []
    thread = threading.Thread(target=lambda: led.append(Leader(runner, ProcessGroup(0, 2), listener, timeout=30)))
    thread.start()
    follower = replicated._connect(listener.getsockname(), 30)
    follower.send("follow", {replicated.RANK: np.array([1], np.int32)})
    thread.join(30)
    assert len(led) == 1
    return led[0], follower


@pytest.mark.parametrize("end", ["close", "reset"])
def test_a_follower_gone_between_operations_is_reported_at_once_and_fails_the_next_one(end: str) -> None:
    """The leader learned that a follower was gone only when an operation failed: a server went on saying it was
    ready until a request came."""
    leader, follower = _led_by(_listener(), Unreplicated())
    told = threading.Event()
    lost: list[BaseException] = []
    leader.watch(lambda error: (lost.append(error), told.set()))
    if end == "reset":  # a follower's host that answers with a reset (SO_LINGER 0 sends one on close)
        follower.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    follower.close()
    assert told.wait(30), "the leader was not told"
    assert len(lost) == 1 and isinstance(lost[0], replicated.FollowerLost) and isinstance(lost[0], DeviceLost)
    how = "closed" if end == "close" else "broke (Connection reset by peer)"
    assert str(lost[0]).startswith(f"process 1 of the group of 2 (at 127.0.0.1) is gone: its pass channel {how}; ")
    with pytest.raises(replicated.FollowerLost, match="process 1 of the group of 2"):
        leader.copy_pages(np.array([0]), np.array([1]))
    late: list[BaseException] = []
    leader.watch(late.append)  # one who asks later learns it at once
    assert late == lost
    leader.close()
    assert len(lost) == 1


def test_a_leader_that_closes_stops_watching_before_its_followers_go() -> None:
    leader, follower = _led_by(_listener(), Unreplicated())
    lost: list[BaseException] = []
    leader.watch(lost.append)
    leader.close()
    assert follower.receive()[0] == "stop"
    follower.close()
    assert lost == [] and leader.lost is None


def test_only_rank_0_leads_and_only_the_others_follow() -> None:
    runner = _runner()
    with pytest.raises(ValueError, match="only rank 0"):
        Leader(runner, ProcessGroup(1, 2), _listener())
    with pytest.raises(ValueError, match="only the other ranks"):
        follow(runner, ProcessGroup(0, 2), ("127.0.0.1", 1))
    runner.close()


def test_the_channel_carries_int32_and_float32_arrays_exactly_and_refuses_others() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        left = socket.create_connection(listener.getsockname())
        right, _ = listener.accept()
    sender, receiver = Channel(left), Channel(right)
    arrays = {"ids": np.array([[1, -2], [3, 2**31 - 1]], np.int32), "data": np.linspace(-1, 1, 7, dtype=np.float32)}
    sender.send("forward", arrays)
    op, received = receiver.receive()
    assert op == "forward" and set(received) == {"ids", "data"}
    for name, array in arrays.items():
        np.testing.assert_array_equal(received[name], array)
        assert received[name].dtype == array.dtype
    sender.send("write_pages", {"data": np.zeros(2, np.float64)})
    with pytest.raises(ValueError, match="int32 and float32"):
        receiver.receive()
    sender.close()
    receiver.close()


def _channel_pair() -> tuple[Channel, Channel]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        left = socket.create_connection(listener.getsockname())
        right, _ = listener.accept()
    return Channel(left), Channel(right)


@pytest.mark.parametrize(
    "sent", [b"GET / HTTP/1.1\r\nHost: pie\r\n\r\n", b"\x05\x00\x00\x00hello", b'\x0c\x00\x00\x00{"op": "x"}  '],
    ids=["http", "no json", "no arrays"],
)
def test_the_channel_refuses_bytes_that_are_no_frame(sent: bytes) -> None:
    sender, receiver = _channel_pair()
    sender.sock.sendall(sent)
    sender.sock.shutdown(socket.SHUT_WR)  # nothing more comes: a reader that waits for more gets the end
    with pytest.raises(ValueError, match="not a pie frame|not a pass-channel frame header"):
        receiver.receive()
    sender.close()
    receiver.close()


def test_the_channel_probes_an_idle_peer_and_a_broken_one_is_a_connection_error() -> None:
    """A peer whose host left the network sends no reset: an idle channel waited on it for ever. And a read that
    failed (a timeout, keepalive's probes unanswered) was an OSError the follower's caller does not catch."""
    sender, receiver = _channel_pair()
    for channel in (sender, receiver):
        assert channel.sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        if hasattr(socket, "TCP_KEEPIDLE"):
            assert channel.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == replicated.KEEPALIVE_IDLE_S
    receiver.sock.settimeout(0.05)  # (as a read whose peer stopped answering ends)
    with pytest.raises(ConnectionError, match="the pass channel broke: timed out"):
        receiver.receive()
    sender.close()
    receiver.close()


def test_the_pass_address_is_the_given_one_else_the_environments_else_the_coordinators_next_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    group = ProcessGroup(0, 2, "10.0.0.5:8476")
    monkeypatch.delenv(PASS_ADDRESS_ENV, raising=False)
    assert pass_address(group) == ("10.0.0.5", 8477)
    assert pass_address(group, "[::1]:9000") == ("::1", 9000)
    monkeypatch.setenv(PASS_ADDRESS_ENV, "10.0.0.6:7000")
    assert pass_address(group) == ("10.0.0.6", 7000)
    assert pass_address(ProcessGroup(1, 2), "h:1") == ("h", 1)
    monkeypatch.delenv(PASS_ADDRESS_ENV)
    with pytest.raises(ValueError, match="did not say where its coordinator is"):
        pass_address(ProcessGroup(1, 2))
    with pytest.raises(ValueError, match="is not host:port"):
        split_address("10.0.0.5")


class GroupEngine:
    """The CPU engine's hooks, and a process group of its own (the hooks an XLA-like engine adds)."""

    def __init__(self, plugin: Any):
        vars(self).update({name: getattr(plugin, name) for name in dir(plugin) if name.startswith("pie_")})
        self.joined: list[tuple[Any, ...]] = []
        self.left = 0

    @hookimpl
    def pie_join_process_group(self, coordinator: str | None, num_processes: int | None,
                               process_id: int | None) -> ProcessGroup:
        self.joined.append((coordinator, num_processes, process_id))
        return ProcessGroup(process_id or 0, num_processes or 1, coordinator)

    @hookimpl
    def pie_leave_process_group(self) -> None:
        self.left += 1


def test_the_process_group_hooks_reach_the_engine_before_its_devices_are_probed() -> None:
    import pie_engine_cpu.plugin as cpu_plugin

    registry = EngineRegistry(autoload=False)
    plugin = GroupEngine(cpu_plugin)
    registry.register("cpu", plugin)
    engine = registry.loaded("cpu")
    assert engine._devices is None  # nothing probed yet
    assert engine.join_process_group("h:1", 4, 2) == ProcessGroup(2, 4, "h:1")
    engine.leave_process_group()
    assert (plugin.joined, plugin.left, engine._devices) == ([("h:1", 4, 2)], 1, None)
    plain = EngineRegistry(env={"PIE_ENGINES": "cpu"}).loaded("cpu")
    with pytest.raises(EngineError, match="runs in one process: it has no pie_join_process_group"):
        plain.join_process_group(None, None, None)


def test_an_engine_that_joins_a_group_but_cannot_leave_it_is_refused() -> None:
    import pie_engine_cpu.plugin as cpu_plugin
    from pie.plugins import EngineSelectionError

    plugin = GroupEngine(cpu_plugin)
    plugin.pie_leave_process_group = None  # type: ignore[method-assign]
    registry = EngineRegistry(autoload=False)
    registry.register("cpu", plugin)
    with pytest.raises(EngineSelectionError, match="unpaired hooks: pie_join_process_group without pie_leave"):
        registry.loaded("cpu")
