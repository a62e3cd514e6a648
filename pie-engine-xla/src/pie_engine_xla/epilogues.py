"""eta epilogues on the XLA engine's tensors, through eta's own JAX rendering.

``Epilogue.jax_fn()`` is one jitted function; here it runs on engine tensors:
uploads are placed (full and per-row inputs padded to the row bucket, so they
line up with padded launch outputs), launch outputs are used as they are, and
the results keep the real row count. Row-local by construction (elementwise
maps and row reductions), an epilogue never mixes padding into real rows.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from pie.eta import Epilogue, Shape
from pie.eta import compile as compile_eta
from pie.kernels import epilogue_launcher as catalogue_epilogue
from pie.poem.sharding import REPLICATED

from pie_engine_xla.mesh import mesh_device
from pie_engine_xla.tensors import Pad, Placement, Tensor, place

_PADS = {Shape.FULL: Pad.ZEROS, Shape.ROWS: Pad.ZEROS, Shape.COLS: Pad.NONE}
_JITTED: dict[str, Callable[..., dict[str, Any]]] = {}
"""One jitted function per epilogue IR (``Epilogue.key``), so a second call does not retrace."""


def run_epilogue(epilogue: Epilogue, /, **inputs_and_params: Any) -> dict[str, Tensor]:
    """Like ``epilogue.numpy_fn()(**inputs_and_params)``, with engine tensors in and out; params are numbers."""
    mesh = mesh_device()
    replicated = mesh.sharding(())
    arrays: dict[str, Any] = {}
    rows: int | None = None
    for spec in epilogue.inputs:
        tensor = inputs_and_params.get(spec.name)
        if not isinstance(tensor, Tensor):
            raise TypeError(f"epilogue input {spec.name!r} must be an XLA engine tensor, got {type(tensor).__name__}")
        if tensor.host is None and (tensor.rows is not None or _PADS[spec.shape] is Pad.NONE):
            arrays[spec.name] = tensor.array
        else:
            arrays[spec.name] = place(tensor, Placement(_PADS[spec.shape], REPLICATED), replicated)
        if spec.shape is Shape.FULL and rows is None:
            rows = tensor.real_rows()
    params = {name: value for name, value in inputs_and_params.items() if name not in arrays}
    fn = _JITTED.get(epilogue.key)
    if fn is None:
        fn = _JITTED[epilogue.key] = epilogue.jax_fn()
    results = mesh.last = fn(**arrays, **params)
    return {name: Tensor(array=value, rows=rows) for name, value in results.items()}


def epilogue_launcher(source: str, params: tuple[tuple[str, float], ...]) -> Callable[..., Tensor]:
    """The catalogue ``epilogue`` kernel: eta ``source`` with ``params`` bound, inputs in its order."""
    epilogue = compile_eta(source)
    return catalogue_epilogue(epilogue, params, partial(run_epilogue, epilogue))
