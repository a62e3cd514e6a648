"""`pie run --inferlet FILE.py -- args`: load a model, run one inferlet, print what it returns."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from pie.inferlet.host import DEFAULT_TIMEOUT_S, InferletHost, InferletLoadError, load_inferlet

TIMEOUT_ENV = "PIE_INFERLET_TIMEOUT"
"""Seconds an inferlet may run under `pie run` (default: DEFAULT_TIMEOUT_S)."""


def run_inferlet_file(
    path: str, args: list[str], model: str | None, engine: str | None, *, timeout_s: float | None = None
) -> int:
    """Run the inferlet in ``path``; returns the process exit code (0 ok, 1 failed, 2 unusable file)."""
    try:
        main = load_inferlet(path)
    except InferletLoadError as exc:
        print(f"pie: {exc}", file=sys.stderr)
        return 2
    if timeout_s is None:
        try:
            timeout_s = float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
        except ValueError:
            print(f"pie: {TIMEOUT_ENV} must be a number of seconds", file=sys.stderr)
            return 2
    from pie.runtime.llm import LLM

    try:
        llm = LLM.load(model, engine)
        host = InferletHost.from_llm(llm, timeout_s=timeout_s)  # its host page pool is the CPU engine's
    except (OSError, ValueError, RuntimeError) as exc:
        print(f"pie: {exc}", file=sys.stderr)
        return 1
    result = asyncio.run(host.run(main, args, name=Path(path).stem))
    if not result.ok:
        if result.details:
            print(result.details, file=sys.stderr, end="")
        print(f"pie: {result.error}", file=sys.stderr)
        return 1
    if result.value is not None:
        print(format_value(result.value))
    return 0


def format_value(value: Any) -> str:
    """Text as it is; anything else as indented JSON when it can be, else its repr."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, indent=2, ensure_ascii=False)
    except (TypeError, ValueError):
        return repr(value)
