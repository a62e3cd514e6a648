"""Models: loading Hugging Face folders and GGUF files, tokenizers, and the local model store.

Names are imported on first use, so `pie` commands that never load a model (``pie engines``)
do not pay for gguf, safetensors and tokenizers.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "Llama3RopeScaling": "config",
    "ModelConfig": "config",
    "weight_shapes": "config",
    "ChatTemplateError": "errors",
    "ModelLoadError": "errors",
    "ModelStoreError": "errors",
    "LoadedModel": "loader",
    "load_model": "loader",
    "resolve_model": "store",
    "StreamDecoder": "tokenizer",
    "Tokenizer": "tokenizer",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pie.model' has no attribute {name!r}")
    return getattr(import_module(f"pie.model.{module}"), name)
