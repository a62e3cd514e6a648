"""Model fixtures: tiny random models, built once per test session (builders in pie.testing.models)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pie.testing.models import make_gguf_model, make_hf_model


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: needs a download or a long run (CI runs these)")


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama Hugging Face folder (2 layers, hidden 64, GQA 4/2, untied head, float32)."""
    pytest.importorskip("transformers")
    return make_hf_model(tmp_path_factory.mktemp("tiny-hf"))


@pytest.fixture(scope="session")
def tiny_gguf_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same shape as `tiny_hf_model` as an F32 GGUF file (weights: `random_weights(tiny_config())`)."""
    return make_gguf_model(tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf", "F32")
