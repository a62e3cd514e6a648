"""One entry point for every model format: `load_model(path)`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .config import ModelConfig
from .errors import ModelLoadError
from .tokenizer import Tokenizer
from ..weights import Weight


@dataclass(frozen=True)
class LoadedModel:
    """A model whose config and tokenizer are read and checked, and whose weights are read on demand."""

    config: ModelConfig
    tokenizer: Tokenizer
    source: str
    _read: Callable[[bool], Iterator[tuple[str, Weight]]] = field(repr=False)

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield `(hugging_face_name, float32 array)` pairs one at a time, so a caller that keeps
        only what it converts never holds two copies of the model.

        Arrays are C-contiguous and the caller's to keep or modify.
        """
        return self._read(False)  # type: ignore[return-value]  # float32 arrays only

    def stored_tensors(self) -> Iterator[tuple[str, Weight]]:
        """Like :meth:`tensors`, but each matrix in the type its file stores it in (a
        :class:`pie.weights.StoredWeight` where that is not float32, its data a read-only view of
        the file where rows need no reordering); vectors are float32 arrays."""
        return self._read(True)


def load_model(path: str | Path) -> LoadedModel:
    """Open a Hugging Face model folder or a GGUF file; raise `ModelLoadError` if it is unusable."""
    path = Path(path)
    # Each format's reader is imported when a model of it is opened: each imports its own libraries.
    if path.is_dir():
        from .hf_folder import open_hf_folder

        config, tokenizer, read = open_hf_folder(path)
    elif path.is_file():
        from .gguf_file import open_gguf

        config, tokenizer, read = open_gguf(path)
    elif path.exists():
        raise ModelLoadError(f"{path}: neither a regular file nor a folder")
    else:
        raise ModelLoadError(f"{path}: no such file or folder")
    return LoadedModel(config=config, tokenizer=tokenizer, source=str(path), _read=read)
