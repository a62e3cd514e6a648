"""Errors raised while loading, resolving or storing models."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model file or folder is malformed or uses something Pie does not support.

    The message always names the file and, where there is one, the tensor or field at fault.
    """


class ModelStoreError(OSError):
    """The model store could not pull, import or find a model."""


class ChatTemplateError(ValueError):
    """A chat template is missing, or it rejected the conversation it was given."""
