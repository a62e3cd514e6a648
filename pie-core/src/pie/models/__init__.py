"""One module per model architecture, and the registry that finds a file's.

A file names its family in config.json (``architectures``, ``model_type``) or in GGUF metadata
(``general.architecture``); `for_hf` and `for_gguf` find the `Architecture` that reads it, and
`architecture_of` the one a `ModelConfig` was read for. Adding a family is adding a module here and
its entry in `ARCHITECTURES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pie.model.config import ModelConfig

from .base import Architecture
from .gemma import Gemma2, Gemma3
from .llama import Llama
from .mistral import Mistral
from .phi3 import Phi3
from .qwen2 import Qwen2
from .qwen3 import Qwen3

ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch for arch in (Llama(), Qwen2(), Qwen3(), Mistral(), Phi3(), Gemma2(), Gemma3())
}
"""Every architecture Pie runs, by `ModelConfig.architecture`."""


def architecture_of(config: ModelConfig) -> Architecture:
    return ARCHITECTURES[config.architecture]


def for_hf(config_json: Mapping[str, Any]) -> Architecture | None:
    """The architecture of a config.json: by its ``model_type`` (what transformers reads it by), or where
    it has none, by its ``architectures`` entries."""
    if "model_type" in config_json:
        return next((a for a in ARCHITECTURES.values() if config_json["model_type"] in a.hf_model_types), None)
    named = config_json.get("architectures")
    for entry in named if isinstance(named, list) else []:
        for arch in ARCHITECTURES.values():
            if entry in arch.hf_architectures:
                return arch
    return None


def for_gguf(general_architecture: str) -> Architecture | None:
    """The architecture of a GGUF file's ``general.architecture``."""
    for arch in ARCHITECTURES.values():
        if arch.gguf_architecture == general_architecture:
            return arch
    return None


__all__ = ["ARCHITECTURES", "Architecture", "architecture_of", "for_gguf", "for_hf"]
