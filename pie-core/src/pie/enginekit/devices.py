"""How the shader engines order their devices and let the user put one first."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from pie.plugins import EngineSettingError

T = TypeVar("T")

KIND_RANK = {"gpu": 0, "integrated-gpu": 1, "virtual-gpu": 2, "cpu": 3, "other": 4}
"""Sort key of a device kind: discrete GPU > integrated GPU > virtual GPU > CPU (lavapipe, WARP, SwiftShader)."""


def put_first(devices: Sequence[T], wanted: str, name: Callable[[T], str], variable: str, noun: str) -> list[T]:
    """``devices`` with the one ``wanted`` names first: an index into them, or else the first whose name holds
    ``wanted`` (any case). ``variable`` is where ``wanted`` came from, for the error when it names none: an
    EngineSettingError, since the user's setting is theirs to correct (not a reason to run another engine)."""
    if wanted.isdigit():
        index = int(wanted)
        if index >= len(devices):
            raise EngineSettingError(f"{variable}={wanted}: only {len(devices)} {noun}(s) found")
    else:
        matches = [i for i, device in enumerate(devices) if wanted.lower() in name(device).lower()]
        if not matches:
            names = ", ".join(name(device) for device in devices) or "none"
            raise EngineSettingError(f"{variable}={wanted!r} matches no {noun} (found: {names})")
        index = matches[0]
    return [devices[index], *devices[:index], *devices[index + 1 :]]
