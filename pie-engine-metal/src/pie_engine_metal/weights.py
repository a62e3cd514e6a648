"""Weights in their stored types (``pie.weights``) on the Metal engine: which code names each type for the
kernels (``weight_type`` / ``table_type`` in ``weights.metal``).

A stored weight keeps its bytes as stored (:class:`pie.enginekit.tensor.StoredTensor`), which carries the
logical ``[rows, cols]`` it holds.
"""

from __future__ import annotations

from pie.weights import F32

TYPE_CODES = {F32: 0, "f16": 1, "bf16": 2, "q8_0": 3, "q4_0": 4, "q4_1": 5, "q5_0": 6, "q4_k": 7, "q5_k": 8, "q6_k": 9}
"""The code of each weight type the kernels read (``WEIGHT_*`` in ``weights.metal``)."""
STORED_TYPES = tuple(name for name in TYPE_CODES if name != F32)
"""The stored types the projections and the embedding read directly (``pie_weight_types``)."""
