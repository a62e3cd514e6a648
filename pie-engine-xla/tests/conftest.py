"""Fixtures shared by the XLA engine's test files."""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest
from xla_helpers import smollm2_greedy


@pytest.fixture(scope="session", autouse=True)
def compile_cache_of_this_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The engine's persistent compile cache in a folder of this test run, not the user's (child processes too)."""
    before = os.environ.get("PIE_XLA_CACHE_DIR")
    os.environ["PIE_XLA_CACHE_DIR"] = str(tmp_path_factory.mktemp("xla-compile-cache"))
    yield
    if before is None:
        del os.environ["PIE_XLA_CACHE_DIR"]
    else:
        os.environ["PIE_XLA_CACHE_DIR"] = before


@pytest.fixture(scope="session")
def smollm2_on_cpu() -> tuple[list[int], np.ndarray]:
    """The CPU engine's SmolLM2 greedy tokens and prompt logits: the reference of every SmolLM2 test here."""
    return smollm2_greedy("cpu")
