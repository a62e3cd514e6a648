"""Inferlet host: user programs (`async def main(ctx, args)`) that drive generation, batched together."""

from pie.inferlet.context import Context, ContextError, LogitProcessor, log_softmax
from pie.inferlet.host import (
    DEFAULT_TIMEOUT_S,
    InferletHost,
    InferletLoadError,
    InferletMain,
    InferletResult,
    load_inferlet,
    positive_int,
)
from pie.inferlet.session import Session

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "Context",
    "ContextError",
    "InferletHost",
    "InferletLoadError",
    "InferletMain",
    "InferletResult",
    "LogitProcessor",
    "Session",
    "load_inferlet",
    "log_softmax",
    "positive_int",
]
