"""The XLA engine across processes: joining and leaving JAX's multi-controller runtime.

After :func:`initialize` (``jax.distributed.initialize``), every process sees the devices of all of
them in ``jax.devices()``, so the engine's mesh (:mod:`pie_engine_xla.mesh`) and its tensor-parallel
layout (:mod:`pie.poem.sharding`) span the processes unchanged, and XLA's collectives cross between
them (gloo on the CPU, ICI/DCN on TPUs). Every process must then launch the same programs in the same
order: rank 0 leads one model runner and the others replay its operations (:mod:`pie.runtime.replicated`,
``pie serve --process-group``). The plugin's ``pie_join_process_group`` and ``pie_leave_process_group``
are these two functions.
"""

from __future__ import annotations

import os

from pie.runtime.replicated import ProcessGroup

COORDINATOR_ENV = "JAX_COORDINATOR_ADDRESS"
"""JAX's own variable for the coordinator (host:port of process 0); JAX reads it too."""
NUM_PROCESSES_ENV = "JAX_NUM_PROCESSES"
PROCESS_ID_ENV = "JAX_PROCESS_ID"


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
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
        return ProcessGroup(0, 1)
    try:
        jax.distributed.initialize(coordinator, num_processes, process_id)
    except ValueError as exc:  # what JAX could not find itself, in its words ("Number of processes must be defined")
        raise ValueError(
            f"cannot join the process group: {exc} (give --coordinator, --num-processes and --process-id, or "
            f"{COORDINATOR_ENV}, {NUM_PROCESSES_ENV} and {PROCESS_ID_ENV}, where JAX cannot detect them)"
        ) from exc
    coordinator = coordinator or os.environ.get(COORDINATOR_ENV) or _detected_coordinator()
    return ProcessGroup(jax.process_index(), jax.process_count(), coordinator)


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
