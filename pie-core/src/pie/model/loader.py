"""One entry point for every model format: `load_model(path)`."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .config import ModelConfig, weight_shapes
from .errors import ModelLoadError, missing_path
from .tokenizer import Tokenizer
from ..weights import DTYPES, Dtype, Weight, dtype_refusal, dtype_target, row_bytes, to_dtype, weight_type


@dataclass(frozen=True)
class LoadedModel:
    """A model whose config and tokenizer are read and checked, and whose weights are read on demand."""

    config: ModelConfig
    tokenizer: Tokenizer
    source: str
    file_types: Mapping[str, str]
    """Each weight's type as the model's files store it, by Hugging Face name (``f32``, ``bf16``, ``q4_1``...)."""
    _read: Callable[[bool], Iterator[tuple[str, Weight]]] = field(repr=False)
    dtype: Dtype = "auto"
    """What :meth:`stored_tensors` gives the matrices in (a key of `pie.weights.DTYPES`; ``auto``: as stored)."""

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield `(hugging_face_name, float32 array)` pairs one at a time, so a caller that keeps
        only what it converts never holds two copies of the model.

        Arrays are C-contiguous and the caller's to keep or modify.
        """
        return self._read(False)  # type: ignore[return-value]  # float32 arrays only

    def stored_tensors(self) -> Iterator[tuple[str, Weight]]:
        """Like :meth:`tensors`, but each matrix in the type its file stores it in (a
        :class:`pie.weights.StoredWeight` where that is not float32, its data a read-only view of
        the file where rows need no reordering), or in the type ``dtype`` asks for; vectors are float32 arrays."""
        target = DTYPES[self.dtype]
        if target is None:
            return self._read(True)
        return self._converted(target)

    def _converted(self, target: str) -> Iterator[tuple[str, Weight]]:
        for name, weight in self._read(True):
            if len(weight.shape) == 2 and weight_type(weight) != target:
                try:
                    weight = to_dtype(weight, target)
                except ValueError as exc:
                    raise ModelLoadError(f"{self.source}: tensor {name!r} cannot be loaded as dtype "
                                         f"{self.dtype}: {exc}") from exc
            yield name, weight

    def conversions(self) -> dict[str, tuple[str, str]]:
        """The matrices ``dtype`` converts while loading: ``{name: (type in the files, type loaded)}``."""
        target = DTYPES[self.dtype]
        if target is None:
            return {}
        shapes = weight_shapes(self.config)
        return {name: (stored, target) for name, stored in self.file_types.items()
                if len(shapes[name]) == 2 and stored != target}

    def file_weight_bytes(self) -> int:
        """The weights' bytes as the model's files store them."""
        total = 0
        for name, shape in weight_shapes(self.config).items():
            rows, cols = shape if len(shape) == 2 else (1, shape[0])
            total += rows * row_bytes(self.file_types[name], cols)
        return total


def _refuse_a_folder_of_gguf_files(folder: Path) -> None:
    """A folder without config.json, which holds GGUF files, is a `ModelLoadError` that names them: a GGUF model
    is its file, and the loader would say only that config.json is missing."""
    if (folder / "config.json").exists():
        return
    try:
        ggufs = sorted(f.name for f in folder.iterdir() if f.suffix.lower() == ".gguf" and f.is_file())
    except OSError:  # a folder that cannot be listed: the loader says what fails
        return
    if len(ggufs) == 1:
        raise ModelLoadError(f"{folder}: a folder with no config.json, so no Hugging Face model; it holds the GGUF "
                             f"file {ggufs[0]}: pass the file itself ({folder / ggufs[0]})")
    if ggufs:
        listed = ", ".join(ggufs[:5]) + (", ..." if len(ggufs) > 5 else "")
        raise ModelLoadError(f"{folder}: a folder with no config.json, so no Hugging Face model; it holds "
                             f"{len(ggufs)} GGUF files ({listed}): pass one of them")


def load_model(path: str | Path, dtype: Dtype = "auto") -> LoadedModel:
    """Open a Hugging Face model folder or a GGUF file; raise `ModelLoadError` if it is unusable.

    ``dtype`` (``--dtype``) loads every matrix in that float type: float types convert into each other and
    block-quantized ones to float32 (exactly); a block type asked for as a 16-bit float is refused here,
    before any weight is read (see `pie.weights.dtype_refusal`).
    """
    target = dtype_target(dtype)
    path = Path(path)
    # Each format's reader is imported when a model of it is opened: each imports its own libraries.
    if path.is_dir():
        _refuse_a_folder_of_gguf_files(path)
        from .hf_folder import open_hf_folder

        config, tokenizer, file_types, read = open_hf_folder(path)
    elif path.is_file() and path.suffix in (".safetensors", ".json"):
        raise ModelLoadError(f"{path}: a Hugging Face model is its folder (config.json, tokenizer and weights): "
                             f"pass {path.parent}")
    elif path.is_file():
        from .gguf_file import open_gguf

        config, tokenizer, file_types, read = open_gguf(path)
    elif path.exists():
        raise ModelLoadError(f"{path}: neither a regular file nor a folder")
    else:
        raise ModelLoadError(missing_path(path))
    if target is not None:
        shapes = weight_shapes(config)
        for name, stored in file_types.items():
            refusal = dtype_refusal(stored, target) if len(shapes[name]) == 2 else None
            if refusal is not None:
                raise ModelLoadError(f"{path}: tensor {name!r} cannot be loaded as dtype {dtype}: {refusal}")
    return LoadedModel(config=config, tokenizer=tokenizer, source=str(path), file_types=file_types, _read=read,
                       dtype=dtype)
