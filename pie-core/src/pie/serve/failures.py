"""What a client is answered when the engine fails its work: one mapping for completions and inferlet runs."""

from __future__ import annotations

from collections.abc import Callable

from pie.generation.sampling import NonFiniteLogits
from pie.plugins import lost_device
from pie.poem.lower import KernelFailed
from pie.serve.engine import NoWorkerReady
from pie.serve.protocol import APIError


def engine_error(error: BaseException, lose_device: Callable[[BaseException], APIError]) -> APIError:
    """The error that answers a request (or run) that ``error`` ended: a lost device is ``lose_device``'s 503 (the
    server stops serving), a kernel short of memory a 503 to retry, a kernel's failure a 500 naming the kernel,
    logits no token can come from a 500 saying so, an inferlet run that got no worker a 503 to retry, an APIError
    itself, anything else a 500 naming what was raised."""
    if isinstance(error, APIError):
        return error
    if lost_device(error):
        return lose_device(error)
    if isinstance(error, KernelFailed) and isinstance(error.__cause__, MemoryError):
        # The device (or host) was short of memory for this batch: it may fit when fewer requests run, and a 500
        # would count against the replica (the Ray ingress routes around replicas whose requests fail).
        return APIError(503, f"out of memory for this request: {error}; retry later, or ask for less (a shorter "
                             "prompt or max_tokens)", code="out_of_memory", headers={"Retry-After": "1"})
    if isinstance(error, KernelFailed):
        return APIError(500, str(error), code="kernel_failed")
    if isinstance(error, NoWorkerReady):
        return APIError(503, f"{error}; retry later", code="no_inferlet_worker", headers={"Retry-After": "5"})
    if isinstance(error, NonFiniteLogits):
        return APIError(500, f"the model cannot continue this request: {error}", code="non_finite_logits")
    return APIError(500, f"the request failed: {type(error).__name__}: {error}")


def internal_error(error: BaseException) -> APIError:
    """The 500 for a fault of the server's own (a bug) met while answering; the caller logs its traceback."""
    return APIError(500, f"internal error: {type(error).__name__}: {error}")
