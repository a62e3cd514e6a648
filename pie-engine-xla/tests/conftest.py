"""Fixtures shared by the XLA engine's test files."""

from __future__ import annotations

import numpy as np
import pytest
from xla_helpers import smollm2_greedy


@pytest.fixture(scope="session")
def smollm2_on_cpu() -> tuple[list[int], np.ndarray]:
    """The CPU engine's SmolLM2 greedy tokens and prompt logits: the reference of every SmolLM2 test here."""
    return smollm2_greedy("cpu")
