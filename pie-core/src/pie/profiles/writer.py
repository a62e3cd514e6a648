"""Writing profiles as TOML, in a stable layout that :func:`parse_profile` reads back unchanged."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from pie.profiles.schema import ANY, SCHEMA_VERSION, Profile, Timing

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")

HEADER = """\
# Pie device profile (schema {schema}). Written by `pie tune`; share it with `pie profile export`.
# Per kernel and shape bucket, the fastest variant and the times behind the choice:
# size = elements of the static operand (the weight), rows = rows launched, both bucket
# anchors (a bucket covers [n, 2n)); min_kv_tokens (attention) = the least longest-KV-length of the
# passes a bucket holds for, up to the next larger one; times_us = [lower quantile, median, upper
# quantile] microseconds per launch. Shapes no bucket covers run the engine's default variant.
"""


def toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else toml_value(key)


def toml_value(value: Any) -> str:
    """One TOML value (inline tables and arrays included) for plain Python data."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        # JSON string escapes are a subset of TOML basic-string escapes; DEL needs its own.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return (
            "{ " + ", ".join(f"{toml_key(str(k))} = {toml_value(v)}" for k, v in value.items()) + " }"
            if value
            else "{}"
        )
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def dumps_document(document: dict[str, Any]) -> str:
    """A whole TOML document: each table's plain keys first, then its sub-tables and arrays of tables."""
    out: list[str] = []
    _emit_table(out, (), document)
    return "\n".join(out).lstrip("\n") + "\n"


class _Inline(dict):
    """A table written inline (``{ a = 1 }``), never as a ``[header]`` section."""


def _is_section(value: Any) -> bool:
    if isinstance(value, dict):
        return not isinstance(value, _Inline)
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(v, dict) and not isinstance(v, _Inline) for v in value)
    )


def _emit_table(out: list[str], path: tuple[str, ...], table: dict[str, Any]) -> None:
    for key, value in table.items():
        if not _is_section(value):
            out.append(f"{toml_key(key)} = {toml_value(value)}")
    for key, value in table.items():
        if not _is_section(value):
            continue
        sub = (*path, key)
        header = ".".join(toml_key(k) for k in sub)
        if isinstance(value, dict):
            # A table holding only sub-tables needs no header of its own, unless it is empty.
            if not value or not all(_is_section(v) for v in value.values()):
                out.extend(["", f"[{header}]"])
            _emit_table(out, sub, value)
        else:
            for item in value:
                out.extend(["", f"[[{header}]]"])
                _emit_table(out, sub, item)


def _times(timing: Timing) -> list[float]:
    return [timing.low, timing.median, timing.high]


def profile_document(profile: Profile) -> dict[str, Any]:
    """The profile as plain data in file layout."""
    kernels: dict[str, Any] = {}
    for tuning in profile.kernels:
        buckets = []
        for bucket in tuning.buckets:
            # A default profile's bucket for every size or row count leaves the key out.
            keys = (("size", bucket.size), ("rows", bucket.rows), ("min_kv_tokens", bucket.min_kv_tokens))
            entry: dict[str, Any] = {k: v for k, v in keys if v != ANY}
            entry["variant"] = bucket.variant
            if bucket.shapes:
                entry["shapes"] = [list(shape) for shape in bucket.shapes]
            if bucket.times or not profile.is_default:
                # An inline table keeps each bucket's times on one line.
                entry["times_us"] = _Inline({variant: _times(timing) for variant, timing in bucket.times})
            buckets.append(entry)
        named = {"default": tuning.default, "variants": list(tuning.variants)} if tuning.default else {}
        kernels[tuning.kernel] = {**named, "buckets": buckets}
    device = profile.device
    tune = profile.tune
    if profile.is_default:
        meta = {"kind": device.kind} if device.kind else {}
        return {
            "schema": SCHEMA_VERSION,
            "name": profile.name,
            "engine": profile.engine,
            "engine_version": profile.engine_version,
            "device": meta,
            "tools": dict(profile.tools),
            "tune": {"mode": tune.mode, **({"workload": tune.workload} if tune.workload else {})},
            "kernels": kernels,
        }
    return {
        "schema": SCHEMA_VERSION,
        "name": profile.name,
        "engine": profile.engine,
        "engine_version": profile.engine_version,
        "device": {
            "vendor": device.vendor,
            "name": device.name,
            "architecture": device.architecture,
            "kind": device.kind,
            "driver": device.driver,
            "memory_bytes": device.memory_bytes,
        },
        "tools": dict(profile.tools),
        "tune": {
            "mode": tune.mode,
            "measured_at": tune.measured_at,
            "seconds": tune.seconds,
            "warmup": tune.warmup,
            "repeats": tune.repeats,
            "margin": tune.margin,
            "workload": tune.workload,
            **({} if tune.load_average is None else {"load_average": tune.load_average}),
        },
        "kernels": kernels,
    }


def dump_profile(profile: Profile) -> str:
    return HEADER.format(schema=SCHEMA_VERSION) + "\n" + dumps_document(profile_document(profile))
