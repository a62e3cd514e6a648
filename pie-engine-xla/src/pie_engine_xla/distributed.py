"""The XLA engine across processes: joining and leaving JAX's multi-controller runtime.

After :func:`initialize` (``jax.distributed.initialize``), every process sees the devices of all of
them in ``jax.devices()``, so the engine's mesh (:mod:`pie_engine_xla.mesh`) and its tensor-parallel
layout (:mod:`pie.poem.sharding`) span the processes unchanged, and XLA's collectives cross between
them (gloo on the CPU, ICI/DCN on TPUs). Every process must then launch the same programs in the same
order: rank 0 leads one model runner and the others replay its operations (:mod:`pie.runtime.replicated`,
``pie serve --process-group``). The plugin's ``pie_join_process_group`` and ``pie_leave_process_group``
are :func:`initialize` and :func:`shutdown`.

How a group fails to form here:

- The group forms within ``PIE_XLA_GROUP_TIMEOUT`` seconds or not at all: past it the process says so and
  exits 1 (JAX's own timeout, later, would abort it with a C++ stack trace).
- Rank 0's coordinator port must be free (gRPC crashes the process otherwise).
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import socket
import sys
import threading
from collections.abc import Iterator

from pie.plugins import EngineSettingError, env_seconds
from pie.runtime.replicated import ProcessGroup, split_address

COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"
"""JAX's own variable for the coordinator (host:port of process 0); JAX reads it too."""
NUM_PROCESSES_ENV = "JAX_NUM_PROCESSES"
PROCESS_ID_ENV = "JAX_PROCESS_ID"
BIND_ADDRESS_ENV = "JAX_COORDINATOR_BIND_ADDRESS"
"""Where process 0's coordinator listens (JAX's default: every address, at the coordinator's port)."""
GROUP_TIMEOUT_ENV = "PIE_XLA_GROUP_TIMEOUT"
DEFAULT_GROUP_TIMEOUT_S = 300.0
"""How long a process waits for the others to join the group."""
JAX_GRACE_S = 30
"""JAX's own join timeout is this much longer than ours, so that ours speaks first."""


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
    import jax

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
    try:
        with _exit_after(timeout, _not_formed(coordinator, num_processes, process_id, timeout)):
            jax.distributed.initialize(coordinator, num_processes, process_id,
                                       initialization_timeout=math.ceil(timeout) + JAX_GRACE_S)
    except ValueError as exc:  # what JAX could not find itself, in its words ("Number of processes must be defined")
        raise ValueError(
            f"cannot join the process group: {exc} (give --coordinator, --num-processes and --process-id, or "
            f"{COORDINATOR_ENV}, {NUM_PROCESSES_ENV} and {PROCESS_ID_ENV}, where JAX cannot detect them)"
        ) from exc
    coordinator = coordinator or os.environ.get(COORDINATOR_ENV) or _detected_coordinator()
    return ProcessGroup(jax.process_index(), jax.process_count(), coordinator)


def group_timeout() -> float:
    """Seconds from ``PIE_XLA_GROUP_TIMEOUT`` (default 300); EngineSettingError when it is no such number."""
    try:
        return env_seconds(os.environ, GROUP_TIMEOUT_ENV, DEFAULT_GROUP_TIMEOUT_S)
    except ValueError as exc:
        raise EngineSettingError(str(exc)) from None


def shutdown() -> None:
    import jax

    jax.distributed.shutdown()


# -- joining -----------------------------------------------------------------------------------


def _check_coordinator_port(coordinator: str) -> None:
    """ValueError when process 0's coordinator cannot listen where JAX would put it (gRPC crashes the process then)."""
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
