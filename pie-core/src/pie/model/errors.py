"""Errors raised while loading, resolving or storing models."""

from __future__ import annotations

from pathlib import Path


class ModelLoadError(ValueError):
    """A model file or folder is malformed or uses something Pie does not support.

    The message always names the file and, where there is one, the tensor or field at fault.
    """


class ModelStoreError(OSError):
    """The model store could not pull, import or find a model."""


class ChatTemplateError(ValueError):
    """A chat template is missing, or it rejected the conversation it was given."""


class TemplateVariableError(ChatTemplateError):
    """A caller's variable for the chat template is refused (see ``Tokenizer.template_variables``)."""


def missing_path(path: Path | str) -> str:
    """Why ``path``, which does not exist as a file or folder, cannot be opened: a symbolic link that leads nowhere
    (its target is missing, or the links form a loop) is named as such, not as an absent file."""
    if Path(path).is_symlink():
        return f"{path}: a symbolic link that leads nowhere (its target is missing, or the links form a loop)"
    return f"{path}: no such file or folder"


def is_rust_panic(exc: BaseException) -> bool:
    """Whether ``exc`` is a panic of a Rust library (tokenizers, safetensors) raised through pyo3: its
    ``pyo3_runtime.PanicException`` derives from BaseException, so ``except Exception`` misses it, and each library
    defines its own, so it is known by name."""
    return type(exc).__name__ == "PanicException"


def is_library_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a library's refusal of what it was given: an Exception, or a Rust library's panic (which
    tokenizers raises for some malformed vocabularies), not an interrupt or an exit."""
    return isinstance(exc, Exception) or is_rust_panic(exc)
