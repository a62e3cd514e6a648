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


def missing_path(path: Path | str) -> str:
    """Why ``path``, which does not exist as a file or folder, cannot be opened: a symbolic link that leads nowhere
    (its target is missing, or the links form a loop) is named as such, not as an absent file."""
    if Path(path).is_symlink():
        return f"{path}: a symbolic link that leads nowhere (its target is missing, or the links form a loop)"
    return f"{path}: no such file or folder"
