"""The XLA engine across processes: joining and leaving JAX's multi-controller runtime.

After :func:`initialize` (``jax.distributed.initialize``), every process sees the devices of all of
them in ``jax.devices()``, so the engine's mesh (:mod:`pie_engine_xla.mesh`) and its tensor-parallel
layout (:mod:`pie.poem.sharding`) span the processes unchanged, and XLA's collectives cross between
them (gloo on the CPU, ICI/DCN on TPUs). Every process must then launch the same programs in the same
order: rank 0 leads one model runner and the others replay its operations (:mod:`pie.runtime.replicated`,
``pie serve --process-group``). The plugin's ``pie_join_process_group`` and ``pie_leave_process_group``
are :func:`initialize` and :func:`shutdown`.

How a group fails here, and what each process does then:

- The group forms within ``PIE_XLA_GROUP_TIMEOUT`` seconds or not at all: past it the process says so and
  exits 1 (JAX's own timeout, later, would abort it with a C++ stack trace).
- Rank 0's coordinator port must be free (gRPC crashes the process otherwise); a process started with another
  process count than rank 0's leaves, and rank 0 learns why.
- Before the KV pool is allocated, every process compares its model (each weight's type, shape and sampled
  values), its mesh and its pool with rank 0's (:func:`agree_on_setup`): a process started with another model or
  other settings would launch other programs than the rest, so the group stops there, naming the difference.
- A device operation that fails in a group leaves its processes out of step for good (each launch is a
  collective of all of them): it is a :class:`GroupLost` (a :class:`pie.plugins.DeviceLost`), so ``pie serve``
  stops serving and says why. The runtime is recoverable (``jax_enable_recoverability``), so a follower that
  dies does not make JAX abort rank 0 when its heartbeats stop.
- Rank 0 is the coordinator: when its process ends without letting the others go, JAX aborts them at once,
  with its own log lines (nothing in this process can catch that).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import socket
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import wraps
from typing import TYPE_CHECKING, Any

import numpy as np
from pie.contract import PageLayout
from pie.plugins import DeviceLost, EngineSettingError, env_seconds, what_raised

from pie_engine_xla.mesh import DEVICES_ENV

if TYPE_CHECKING:  # the plugin imports this module, and listing engines stays cheap
    from pie.runtime.replicated import ProcessGroup

COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"
"""JAX's own variable for the coordinator (host:port of process 0); JAX reads it too."""
NUM_PROCESSES_ENV = "JAX_NUM_PROCESSES"
PROCESS_ID_ENV = "JAX_PROCESS_ID"
BIND_ADDRESS_ENV = "JAX_COORDINATOR_BIND_ADDRESS"
"""Where process 0's coordinator listens (JAX's default: every address, at the coordinator's port)."""
GROUP_TIMEOUT_ENV = "PIE_XLA_GROUP_TIMEOUT"
DEFAULT_GROUP_TIMEOUT_S = 300.0
"""How long a process waits for the others: to join the group, and to load the model."""
JAX_GRACE_S = 30
"""JAX's own join timeout is this much longer than ours, so that ours speaks first."""
LEAVE_TIMEOUT_S = 10.0
"""How long rank 0, leaving, waits for the others to leave first (they do as soon as it lets them go). JAX learns
that a process died only when its heartbeats stop (100 s), so a dead one holds rank 0 up this long."""
SAMPLED_VALUES = 1024
"""Values read from each end of a weight for the setup comparison (a model's weights are not hashed whole)."""
KEY_PREFIX = "pie/xla/"


class GroupLost(DeviceLost):
    """The process group cannot go on: an operation failed on one process, so the processes are out of step."""


@dataclass
class _Joined:
    """The group this process belongs to, and what it learned since joining."""

    group: ProcessGroup
    client: Any
    """JAX's DistributedRuntimeClient: its key-value store and its barrier of live processes."""
    timeout: float
    weights: list[tuple[str, str]] = field(default_factory=list)
    """Each uploaded weight's type and shape, and a digest of its sampled values, in upload order."""
    lost: GroupLost | None = None


_joined: _Joined | None = None


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> ProcessGroup:
    """Join the JAX distributed runtime, before anything else touches JAX.

    Arguments win; then ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``;
    what is still unknown JAX detects itself where it can (Cloud TPU pods, Slurm, Open MPI,
    Kubernetes). A single process (``num_processes=1``) skips the runtime entirely. A group that does not form
    within the group timeout ends the process (see :func:`_exit_after`).
    """
    global _joined
    import jax
    from pie.runtime.replicated import ProcessGroup, split_address

    coordinator = coordinator or os.environ.get(COORDINATOR_ENV) or None
    num_processes = num_processes if num_processes is not None else _env_int(NUM_PROCESSES_ENV)
    process_id = process_id if process_id is not None else _env_int(PROCESS_ID_ENV)
    if num_processes is not None and num_processes < 1:
        raise ValueError(f"the number of processes must be at least 1, not {num_processes}")
    if num_processes is not None and process_id is not None and not 0 <= process_id < num_processes:
        raise ValueError(f"process id {process_id} is outside 0..{num_processes - 1}")
    if num_processes == 1:
        return ProcessGroup(0, 1)
    timeout = group_timeout()
    if coordinator is not None:
        try:
            split_address(coordinator)
        except ValueError:
            raise ValueError(f"the coordinator {coordinator!r} is not HOST:PORT") from None
        if process_id == 0:
            _check_coordinator_port(coordinator)
    jax.config.update("jax_enable_recoverability", True)  # a follower's death does not abort the others
    jax.config.update("jax_enable_preemption_service", False)  # unused here, and its barrier holds up leaving
    try:
        with _exit_after(timeout, _not_formed(coordinator, num_processes, process_id, timeout)):
            jax.distributed.initialize(coordinator, num_processes, process_id,
                                       initialization_timeout=math.ceil(timeout) + JAX_GRACE_S)
    except ValueError as exc:  # what JAX could not find itself, in its words ("Number of processes must be defined")
        raise ValueError(
            f"cannot join the process group: {exc} (give --coordinator, --num-processes and --process-id, or "
            f"{COORDINATOR_ENV}, {NUM_PROCESSES_ENV} and {PROCESS_ID_ENV}, where JAX cannot detect them)"
        ) from exc
    from jax._src import distributed

    coordinator = coordinator or os.environ.get(COORDINATOR_ENV) or _detected_coordinator()
    group = ProcessGroup(jax.process_index(), jax.process_count(), coordinator)
    if group.num_processes > 1:
        _joined = _Joined(group, distributed.global_state.client, timeout)
    if num_processes is not None and num_processes != group.num_processes:
        refusal = (f"process {group.process_id} was started with --num-processes {num_processes}, but process 0 "
                   f"formed the group for {group.num_processes}: give every process the same --num-processes")
        _publish({"refused": refusal})
        shutdown()
        raise ValueError(refusal)
    return group


def group_timeout() -> float:
    """Seconds from ``PIE_XLA_GROUP_TIMEOUT`` (default 300); EngineSettingError when it is no such number."""
    try:
        return env_seconds(os.environ, GROUP_TIMEOUT_ENV, DEFAULT_GROUP_TIMEOUT_S)
    except ValueError as exc:
        raise EngineSettingError(str(exc)) from None


def shutdown() -> None:
    """Leave JAX's runtime. Rank 0 first waits (up to LEAVE_TIMEOUT_S) for the others to leave: its coordinator
    stops with it, and JAX aborts a process still in the group then."""
    global _joined
    import jax

    joined, _joined = _joined, None
    waiting = None
    if joined is not None and joined.group.leads:
        everyone = list(range(joined.group.num_processes))
        # Returns once every process still connected has called it too, or left: the followers leave instead.
        waiting = threading.Thread(target=_ignoring_errors(joined.client.get_live_nodes), args=(everyone,),
                                   name="pie-xla-leave", daemon=True)
        waiting.start()
        waiting.join(LEAVE_TIMEOUT_S)
    jax.distributed.shutdown()
    if waiting is not None:
        # A wait cut short (a process gone) is still inside JAX's client, and the shutdown makes it return: let it
        # before the interpreter finalizes. A daemon thread that comes back from C++ then is ended by an unwind that
        # aborts the process ("FATAL: exception not rethrown", status -6: rank 0 stopped after losing a follower).
        waiting.join(LEAVE_TIMEOUT_S)


# -- the same model and settings on every process ----------------------------------------


def record_weights(arrays: Sequence[Any]) -> None:
    """Note the weights this process uploads (in a group), for :func:`agree_on_setup`."""
    if _joined is None:
        return
    from pie.weights import StoredWeight

    for array in arrays:
        if isinstance(array, StoredWeight):
            kind, values = array.type, np.asarray(array.data).reshape(-1)
        else:
            kind, values = str(array.dtype), np.asarray(array).reshape(-1)
        digest = hashlib.blake2b(digest_size=8)
        digest.update(values[:SAMPLED_VALUES].tobytes())
        digest.update(values[-SAMPLED_VALUES:].tobytes())
        _joined.weights.append((f"{kind} {list(array.shape)}", digest.hexdigest()))


def agree_on_setup(layout: PageLayout, devices: Sequence[Any]) -> None:
    """Compare this process's model (its uploaded weights), mesh and KV pool with rank 0's; ValueError naming the
    first difference, or a process that did not get this far within the group timeout."""
    joined = _joined
    if joined is None:
        return
    ours = {
        "weights": joined.weights,
        "devices": f"a mesh of {len(devices)} device(s) (ids {', '.join(str(d.id) for d in devices)})",
        "pages": f"a KV cache of {layout.num_pages} pages of {layout.page_size} tokens in {layout.dtype}",
    }
    _publish(ours)
    group = joined.group
    for other in range(1, group.num_processes) if group.leads else (0,):
        _compare(ours, _published(joined, other), f"process {other}")


def _compare(ours: dict[str, Any], theirs: dict[str, Any], other: str) -> None:
    """ValueError naming the first difference between this process's setup and ``other``'s."""
    if "refused" in theirs:
        raise ValueError(f"{other} left the group: {theirs['refused']}")
    mine, others = ours["weights"], [tuple(w) for w in theirs["weights"]]
    fix = "start every process with the same --model and --dtype"
    if len(mine) != len(others):
        raise ValueError(f"{other} loaded another model: it has {len(others)} weights, this process {len(mine)} ({fix})")
    for index, ((kind, digest), (their_kind, their_digest)) in enumerate(zip(mine, others)):
        if kind != their_kind:
            raise ValueError(f"{other} loaded another model: its weight {index} is {their_kind}, this process's {kind} "
                             f"({fix})")
        if digest != their_digest:
            raise ValueError(f"{other} loaded another model: its weight {index} ({kind}) holds other values than this "
                             f"process's ({fix})")
    for part, fix in (("devices", f"give every process the same {DEVICES_ENV}"),
                      ("pages", "give every process the same --kv-tokens and --kv-dtype")):
        if ours[part] != theirs[part]:
            raise ValueError(f"{other} has {theirs[part]}, this process {ours[part]} ({fix})")


def _publish(value: dict[str, Any]) -> None:
    assert _joined is not None
    _joined.client.key_value_set(f"{KEY_PREFIX}{_joined.group.process_id}", json.dumps(value))


def _published(joined: _Joined, process_id: int) -> dict[str, Any]:
    """What process ``process_id`` published, waiting for it up to the group timeout."""
    try:
        text = joined.client.blocking_key_value_get(f"{KEY_PREFIX}{process_id}", int(joined.timeout * 1000))
    except Exception as exc:  # JAX's own error type; DEADLINE_EXCEEDED for the timeout
        if "DEADLINE_EXCEEDED" in str(exc):
            raise ValueError(f"process {process_id} did not load the model within {joined.timeout:g} s "
                             f"({GROUP_TIMEOUT_ENV}): see its log") from None
        raise ValueError(f"cannot learn process {process_id}'s model: {what_raised(exc)}") from None
    return json.loads(text)


# -- a failed operation ends the group -------------------------------------------------------


def guarded(operation: Callable[..., Any], what: str) -> Callable[..., Any]:
    """``operation`` (a launcher, a page operation), raising :class:`GroupLost` where it fails in a group (and at
    once when an earlier one did): the processes are out of step from then on."""
    if _joined is None:
        return operation

    @wraps(operation)
    def run(*args: Any) -> Any:
        joined = _joined
        if joined is not None and joined.lost is not None:
            raise joined.lost
        try:
            return operation(*args)
        except Exception as exc:
            if joined is None or isinstance(exc, GroupLost):
                raise
            group = joined.group
            joined.lost = GroupLost(
                f"{what} failed on process {group.process_id} of the group of {group.num_processes} "
                f"({what_raised(exc)}); every process runs each operation together, so the group cannot go on "
                "(a process that stopped says why in its own log)")
            raise joined.lost from exc

    return run


# -- joining -----------------------------------------------------------------------------------


def _check_coordinator_port(coordinator: str) -> None:
    """ValueError when process 0's coordinator cannot listen where JAX would put it (gRPC crashes the process then)."""
    from pie.runtime.replicated import split_address

    host, port = split_address(os.environ.get(BIND_ADDRESS_ENV) or f"[::]:{split_address(coordinator)[1]}")
    try:
        _try_bind(host, port)
    except OSError as exc:
        raise ValueError(f"process 0 cannot start the group's coordinator on port {port} (--coordinator "
                         f"{coordinator}): {exc.strerror or exc}; give a free port") from None


def _try_bind(host: str, port: int) -> None:
    """Bind ``host:port`` as gRPC would (address reuse, both IP versions for ``::``) and let it go."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        if family != socket.AF_INET6 or exc.errno != errno.EAFNOSUPPORT:
            raise
        family, host, sock = socket.AF_INET, "0.0.0.0", socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    with sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((host, port))


def _not_formed(coordinator: str | None, num_processes: int | None, process_id: int | None, timeout: float) -> str:
    who = "this process" if process_id is None else f"process {process_id}"
    count = "every process" if num_processes is None else f"all {num_processes} processes"
    where = f" at {coordinator}" if coordinator else ""
    ids = "" if num_processes is None else f" (0 to {num_processes - 1})"
    return (f"the process group did not form within {timeout:g} s ({GROUP_TIMEOUT_ENV}): {who} waited for {count} to "
            f"join the coordinator{where}. Start the same command on every host, each with its own --process-id{ids}, "
            "and a --coordinator naming process 0's host and a free port that the others can reach")


@contextlib.contextmanager
def _exit_after(seconds: float, message: str) -> Iterator[None]:
    """Say ``message`` and exit 1 if the block is still running after ``seconds``.

    The join blocks inside JAX, where nothing can interrupt it, and JAX ends a join that outlives its own timeout
    with an abort and a C++ stack trace; this timer, shorter, ends the process first with one line instead."""
    timer = threading.Timer(seconds, _exit, (message,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def _exit(message: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stderr.write(f"pie: {message}\n")
        sys.stderr.flush()
    os._exit(1)


def _ignoring_errors(call: Callable[..., Any]) -> Callable[..., None]:
    def run(*args: Any) -> None:
        with contextlib.suppress(Exception):  # the coordinator already gone: nothing to wait for
            call(*args)

    return run


def _detected_coordinator() -> str | None:
    """The coordinator JAX found itself (a TPU pod, Slurm); JAX keeps it only in its private state."""
    try:
        from jax._src import distributed

        return getattr(distributed.global_state, "coordinator_address", None)
    except (ImportError, AttributeError):
        return None


def _env_int(name: str) -> int | None:
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a number") from None
