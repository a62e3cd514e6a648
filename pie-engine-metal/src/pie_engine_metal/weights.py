"""Weights in their stored types (``pie.weights``) on the Metal engine: how they are uploaded and
which code names each type for the kernels (``weight_type`` / ``table_type`` in ``weights.metal``).

A stored weight keeps its bytes: F16 as a float16 tensor, BF16 as its uint16 bits, the block types
as uint8 ``[rows, row_bytes]``; every such tensor also carries the logical ``[rows, cols]`` it holds.
"""

from __future__ import annotations

import numpy as np
from pie.weights import F32, StoredWeight

TYPE_CODES = {F32: 0, "f16": 1, "bf16": 2, "q8_0": 3, "q4_0": 4, "q4_1": 5, "q5_0": 6, "q4_k": 7, "q5_k": 8, "q6_k": 9}
"""The code of each weight type the kernels read (``WEIGHT_*`` in ``weights.metal``)."""
STORED_TYPES = tuple(name for name in TYPE_CODES if name != F32)
"""The stored types the projections and the embedding read directly (``pie_weight_types``)."""
READS_STORED = ("embedding", "linear", "linear_add", "rms_norm_linear", "rms_norm_gate_up_silu")
"""The catalogue kernels that read weights in their stored types (every variant)."""

_HOST_DTYPES = {"f16": np.dtype(np.float16), "bf16": np.dtype(np.uint16)}


def host_bytes(weight: StoredWeight) -> np.ndarray:
    """A stored weight's data as the array its tensor holds (float16 values, bfloat16 bits, or bytes)."""
    dtype = _HOST_DTYPES.get(weight.type)
    data = np.ascontiguousarray(weight.data)
    return data if dtype is None else data.view(dtype).reshape(weight.shape)
