"""Models: loading Hugging Face folders and GGUF files, tokenizers, and the local model store."""

from .config import Llama3RopeScaling, ModelConfig, weight_shapes
from .errors import ChatTemplateError, ModelLoadError, ModelStoreError
from .loader import LoadedModel, load_model
from .store import resolve_model
from .tokenizer import StreamDecoder, Tokenizer

__all__ = [
    "ChatTemplateError",
    "Llama3RopeScaling",
    "LoadedModel",
    "ModelConfig",
    "ModelLoadError",
    "ModelStoreError",
    "StreamDecoder",
    "Tokenizer",
    "load_model",
    "resolve_model",
    "weight_shapes",
]
