"""Strict reading of profile files: a complete :class:`Profile`, or a :class:`ProfileError` naming the line.

Every key is known, every value has its type and a plausible range, and the
choices are consistent with the times recorded beside them. Nothing is applied
from a file that fails any check.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from pie.contract import MAX_MEMORY_BYTES
from pie.files import read_regular_file
from pie.kernels import CATALOG
from pie.poem.lower import KV_BUCKETED
from pie.profiles.locate import Path, format_path, key_lines, line_of
from pie.profiles.schema import (
    ANY,
    DEFAULT_MODE,
    SCHEMA_VERSION,
    TUNE_MODES,
    Bucket,
    DeviceMeta,
    KernelTuning,
    Profile,
    ProfileError,
    Timing,
    TuneMeta,
)

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

MAX_BYTES = 4 << 20
MAX_ROWS = 1 << 20
MAX_SIZE = 1 << 40
MAX_KV_TOKENS = 1 << 30
MAX_MICROSECONDS = 1e9
"""A launch measured at more than 1000 s is not a measurement."""
MAX_TUNE_SECONDS = 1e7
"""The longest a tune may have measured (about 16 weeks); `pie tune --budget` is bounded by it too."""
MAX_TEXT = 256
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
IDENTIFIER = re.compile(r"[A-Za-z0-9_-]{1,64}")
DEVICE_KINDS = ("cpu", "gpu", "integrated-gpu", "virtual-gpu", "tpu", "npu", "other")

TOP_KEYS = ("schema", "name", "engine", "engine_version", "device", "tools", "tune", "kernels")
DEVICE_KEYS = ("vendor", "name", "architecture", "kind", "driver", "memory_bytes")
TUNE_KEYS = ("mode", "measured_at", "seconds", "warmup", "repeats", "margin", "workload", "load_average")
KERNEL_KEYS = ("default", "variants", "buckets")
BUCKET_KEYS = ("size", "rows", "min_kv_tokens", "variant", "shapes", "times_us")


class _Reader:
    """Type and range checks over the parsed document, failing with the line of the offending key."""

    def __init__(self, text: str, source: str):
        self.source = source
        self.lines = key_lines(text)

    def fail(self, path: Path, message: str) -> ProfileError:
        return ProfileError(f"{format_path(path)}: {message}", self.source, line_of(self.lines, path))

    def table(
        self, value: Any, path: Path, keys: tuple[str, ...], required: tuple[str, ...] | None = None, noun: str = "key"
    ) -> dict:
        if not isinstance(value, dict):
            raise self.fail(path, f"must be a table, not {_kind(value)}")
        for key in value:
            if key not in keys:
                raise self.fail((*path, key), f"unknown {noun} {key!r} (expected one of: {', '.join(keys)})")
        for key in keys if required is None else required:
            if key not in value:
                raise self.fail(path, f"missing key {key!r}")
        return value

    def text(self, value: Any, path: Path, *, empty: bool = False, pattern: re.Pattern[str] | None = None) -> str:
        if not isinstance(value, str):
            raise self.fail(path, f"must be a string, not {_kind(value)}")
        if not value and not empty:
            raise self.fail(path, "must not be empty")
        if len(value) > MAX_TEXT:
            raise self.fail(path, f"is longer than {MAX_TEXT} characters")
        if not value.isprintable():
            raise self.fail(path, "contains control or unprintable characters")
        if pattern is not None and not pattern.fullmatch(value):
            raise self.fail(path, f"{value!r} does not match {pattern.pattern}")
        return value

    def integer(self, value: Any, path: Path, low: int, high: int) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(path, f"must be an integer, not {_kind(value)}")
        if not low <= value <= high:
            raise self.fail(path, f"{value} is outside {low}..{high}")
        return value

    def power_of_two(self, value: Any, path: Path, high: int) -> int:
        number = self.integer(value, path, 1, high)
        if number & (number - 1):
            raise self.fail(path, f"{number} is not a power of two (buckets are anchored on powers of two)")
        return number

    def number(self, value: Any, path: Path, low: float, high: float, *, low_open: bool = False) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(path, f"must be a number, not {_kind(value)}")
        number = float(value)
        if not math.isfinite(number):
            raise self.fail(path, f"{value} is not a finite number")
        if number < low or number > high or (low_open and number == low):
            bound = f"above {low}" if low_open else f"at least {low}"
            raise self.fail(path, f"{value} must be {bound} and at most {high}")
        return number

    def array(self, value: Any, path: Path, most: int) -> list:
        if not isinstance(value, list):
            raise self.fail(path, f"must be an array, not {_kind(value)}")
        if len(value) > most:
            raise self.fail(path, f"has {len(value)} entries; at most {most} are allowed")
        return value


def _kind(value: Any) -> str:
    return {
        dict: "a table",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a float",
    }.get(type(value), type(value).__name__)


def read_profile_file(path: str | os.PathLike[str]) -> bytes:
    """A profile file's bytes for :func:`parse_profile`: a regular file of at most ``MAX_BYTES`` (a FIFO or a
    device is refused, never waited on or read without end), else the OSError saying why."""
    return read_regular_file(path, MAX_BYTES)


def parse_profile(text: str | bytes, source: str = "<profile>") -> Profile:
    """Parse and validate one profile file; raise :class:`ProfileError` for anything wrong."""
    if isinstance(text, bytes):
        if len(text) > MAX_BYTES:
            raise ProfileError(f"file is larger than {MAX_BYTES} bytes", source)
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProfileError(f"not UTF-8 text ({exc.reason} at byte {exc.start})", source) from None
    if len(text) > MAX_BYTES:
        raise ProfileError(f"file is larger than {MAX_BYTES} characters", source)
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"not valid TOML: {exc}", source, _decode_error_line(exc)) from None
    except RecursionError:
        raise ProfileError("not valid TOML: values nested too deeply", source) from None
    reader = _Reader(text, source)
    return _profile(reader, document, text)


def _decode_error_line(exc: Exception) -> int | None:
    line = getattr(exc, "lineno", None)
    if isinstance(line, int):
        return line
    match = re.search(r"line (\d+)", str(exc))
    return int(match.group(1)) if match else None


def _profile(reader: _Reader, document: dict, text: str) -> Profile:
    # The schema version is checked before anything else: a newer file fails for that reason alone.
    if "schema" not in document:
        raise reader.fail((), f"missing key 'schema' (this pie-core reads schema version {SCHEMA_VERSION})")
    schema = document["schema"]
    if isinstance(schema, bool) or not isinstance(schema, int):
        raise reader.fail(("schema",), f"must be an integer, not {_kind(schema)}")
    if schema != SCHEMA_VERSION:
        raise reader.fail(
            ("schema",), f"schema version {schema} is not supported (this pie-core reads version {SCHEMA_VERSION})"
        )
    reader.table(document, (), TOP_KEYS)
    name = reader.text(document["name"], ("name",), pattern=NAME)
    engine = reader.text(document["engine"], ("engine",), pattern=IDENTIFIER)
    engine_version = reader.text(document["engine_version"], ("engine_version",))
    tune = _tune(reader, document["tune"])
    default = tune.mode == DEFAULT_MODE
    device = _device(reader, document["device"], default)
    tools = _tools(reader, document["tools"])
    kernels_table = reader.table(document["kernels"], ("kernels",), tuple(CATALOG), required=(), noun="kernel")
    kernels = tuple(_kernel(reader, kernel, body, tune.margin, default) for kernel, body in kernels_table.items())
    return Profile(name, engine, engine_version, device, tools, tune, kernels, source=reader.source, text=text)


def _device(reader: _Reader, value: Any, default: bool) -> DeviceMeta:
    """In a default profile every key may be left out: it is for any device of the engine (of ``kind``)."""
    path = ("device",)
    table = reader.table(value, path, DEVICE_KEYS, required=() if default else None)

    def text(key: str, empty: bool = False) -> str:
        return reader.text(table[key], (*path, key), empty=empty) if key in table else ""

    kind = text("kind")
    if kind not in DEVICE_KINDS and (kind or not default):
        raise reader.fail((*path, "kind"), f"{kind!r} is not one of {', '.join(DEVICE_KINDS)}")
    memory = table.get("memory_bytes", 0)
    return DeviceMeta(
        vendor=text("vendor"),
        name=text("name"),
        architecture=text("architecture"),
        kind=kind,
        driver=text("driver", empty=True),
        memory_bytes=reader.integer(memory, (*path, "memory_bytes"), 0, MAX_MEMORY_BYTES),
    )


def _tools(reader: _Reader, value: Any) -> tuple[tuple[str, str], ...]:
    path = ("tools",)
    if not isinstance(value, dict):
        raise reader.fail(path, f"must be a table, not {_kind(value)}")
    if len(value) > 64:
        raise reader.fail(path, "lists more than 64 tools")
    tools = []
    for key, version in value.items():
        if not IDENTIFIER.fullmatch(key):
            raise reader.fail((*path, key), f"tool name {key!r} does not match {IDENTIFIER.pattern}")
        tools.append((key, reader.text(version, (*path, key))))
    return tuple(tools)


def _tune(reader: _Reader, value: Any) -> TuneMeta:
    """A default profile was not measured: it needs only its mode (and may say what its rule is in ``workload``)."""
    path = ("tune",)
    if isinstance(value, dict) and value.get("mode") == DEFAULT_MODE:
        table = reader.table(value, path, ("mode", "workload"), required=("mode",))
        workload = reader.text(table["workload"], (*path, "workload")) if "workload" in table else ""
        return TuneMeta(DEFAULT_MODE, "", 0.0, 0, 0, 0.0, workload)
    table = reader.table(value, path, TUNE_KEYS, required=TUNE_KEYS[:-1])
    mode = reader.text(table["mode"], (*path, "mode"))
    if mode not in TUNE_MODES:
        raise reader.fail((*path, "mode"), f"{mode!r} is not one of {', '.join(TUNE_MODES)}")
    measured_at = reader.text(table["measured_at"], (*path, "measured_at"))
    try:
        datetime.fromisoformat(measured_at)
    except ValueError:
        raise reader.fail((*path, "measured_at"), f"{measured_at!r} is not an ISO 8601 date and time") from None
    return TuneMeta(
        mode=mode,
        measured_at=measured_at,
        seconds=reader.number(table["seconds"], (*path, "seconds"), 0.0, MAX_TUNE_SECONDS),
        warmup=reader.integer(table["warmup"], (*path, "warmup"), 0, 10_000),
        repeats=reader.integer(table["repeats"], (*path, "repeats"), 1, 100_000),
        margin=reader.number(table["margin"], (*path, "margin"), 0.0, 0.9),
        workload=reader.text(table["workload"], (*path, "workload")),
        load_average=None
        if "load_average" not in table
        else reader.number(table["load_average"], (*path, "load_average"), 0.0, 1e6),
    )


def _kernel(reader: _Reader, kernel: str, value: Any, margin: float, default_profile: bool) -> KernelTuning:
    """In a default profile ``default`` and ``variants`` may be left out: the engine's own default, and
    the variants its buckets name."""
    path: Path = ("kernels", kernel)
    table = reader.table(value, path, KERNEL_KEYS, required=("buckets",) if default_profile else None)
    variants_path = (*path, "variants")
    variants = tuple(
        reader.text(v, (*variants_path, i), pattern=IDENTIFIER)
        for i, v in enumerate(reader.array(table.get("variants", []), variants_path, 32))
    )
    if not variants and "variants" in table:
        raise reader.fail(variants_path, "must list at least one variant")
    if len(set(variants)) != len(variants):
        raise reader.fail(variants_path, "lists a variant twice")
    default = ""
    if "default" in table:
        default = reader.text(table["default"], (*path, "default"), pattern=IDENTIFIER)
        if default not in variants:
            raise reader.fail((*path, "default"), f"default {default!r} is not among the variants {list(variants)}")
    elif variants:
        raise reader.fail(path, "missing key 'default' (the first of the engine's variants)")
    buckets_path = (*path, "buckets")
    raw = reader.array(table["buckets"], buckets_path, 4096)
    buckets = [
        _bucket(reader, kernel, (*buckets_path, i), entry, default, variants, margin, default_profile)
        for i, entry in enumerate(raw)
    ]
    seen: dict[tuple[int, int, int], int] = {}
    for index, bucket in enumerate(buckets):
        key = bucket.anchors
        if key in seen:
            raise reader.fail(
                (*buckets_path, index), f"{_cell(bucket)} is already given by bucket {seen[key]}"
            )
        seen[key] = index
    ordered = sorted(buckets, key=lambda b: (b.size, b.min_kv_tokens, b.rows))
    if not variants:  # in the order the buckets are kept, and written: read back, the same
        variants = tuple(dict.fromkeys(b.variant for b in ordered))
    return KernelTuning(kernel, default, variants, tuple(ordered))


def _cell(bucket: Bucket) -> str:
    size = "every size" if bucket.size == ANY else f"size {bucket.size}"
    rows = "every row count" if bucket.rows == ANY else f"rows {bucket.rows}"
    keys = "" if bucket.min_kv_tokens == ANY else f", from {bucket.min_kv_tokens} keys"
    return f"{size}, {rows}{keys}"


def _bucket(
    reader: _Reader,
    kernel: str,
    path: Path,
    value: Any,
    default: str,
    variants: tuple[str, ...],
    margin: float,
    default_profile: bool,
) -> Bucket:
    """A default profile's bucket may leave out ``size`` or ``rows`` (every one) and its times; any bucket of
    a kernel in ``KV_BUCKETED`` may name ``min_kv_tokens``."""
    required = ("variant",) if default_profile else ("size", "rows", "variant", "times_us")
    table = reader.table(value, path, BUCKET_KEYS, required=required)
    size = reader.power_of_two(table["size"], (*path, "size"), MAX_SIZE) if "size" in table else ANY
    rows = reader.power_of_two(table["rows"], (*path, "rows"), MAX_ROWS) if "rows" in table else ANY
    min_kv = ANY
    if "min_kv_tokens" in table:
        if kernel not in KV_BUCKETED:
            raise reader.fail(
                (*path, "min_kv_tokens"),
                f"only {', '.join(KV_BUCKETED)} buckets depend on the pass's KV length, not {kernel}'s",
            )
        min_kv = reader.power_of_two(table["min_kv_tokens"], (*path, "min_kv_tokens"), MAX_KV_TOKENS)
    variant = reader.text(table["variant"], (*path, "variant"), pattern=IDENTIFIER)
    if variants and variant not in variants:
        raise reader.fail(
            (*path, "variant"), f"unknown variant {variant!r} (this kernel's variants: {', '.join(variants)})"
        )
    if "shapes" in table and size == ANY:
        raise reader.fail((*path, "shapes"), "shapes need the size bucket they fall in")
    shapes = _shapes(reader, (*path, "shapes"), table.get("shapes", []), size)
    if "times_us" not in table:
        return Bucket(size, rows, variant, (), shapes, min_kv)
    times_path = (*path, "times_us")
    if not isinstance(table["times_us"], dict):
        raise reader.fail(times_path, f"must be a table, not {_kind(table['times_us'])}")
    times = {}
    for measured, triple in table["times_us"].items():
        if variants and measured not in variants:
            raise reader.fail((*times_path, measured), f"times for unknown variant {measured!r}")
        times[measured] = _timing(reader, (*times_path, measured), triple)
    for needed in dict.fromkeys(v for v in (default, variant) if v):
        if needed not in times:
            raise reader.fail(times_path, f"has no times for variant {needed!r}")
    if default and variant != default and not times[variant].beats(times[default], margin):
        raise reader.fail(
            (*path, "variant"),
            f"chooses {variant!r}, but its times {_triple(times[variant])} do not beat the default "
            f"{default!r} {_triple(times[default])} with confidence "
            f"(upper quantile under the lower one by {margin:.0%})",
        )
    return Bucket(size, rows, variant, tuple(sorted(times.items())), shapes, min_kv)


def _shapes(reader: _Reader, path: Path, value: Any, size: int) -> tuple[tuple[int, ...], ...]:
    shapes = []
    for index, shape in enumerate(reader.array(value, path, 64)):
        dims = tuple(
            reader.integer(d, (*path, index, axis), 1, MAX_SIZE)
            for axis, d in enumerate(reader.array(shape, (*path, index), 8))
        )
        if not dims or not size <= math.prod(dims) < 2 * size:
            raise reader.fail((*path, index), f"shape {list(dims)} does not fall in the size bucket {size}")
        shapes.append(dims)
    return tuple(shapes)


def _timing(reader: _Reader, path: Path, value: Any) -> Timing:
    triple = reader.array(value, path, 3)
    if len(triple) != 3:
        raise reader.fail(path, "must be [lower quantile, median, upper quantile] in microseconds")
    low, median, high = (
        reader.number(t, (*path, i), 0.0, MAX_MICROSECONDS, low_open=True) for i, t in enumerate(triple)
    )
    if not low <= median <= high:
        raise reader.fail(path, f"quantiles {low}, {median}, {high} are not in increasing order")
    return Timing(low, median, high)


def _triple(timing: Timing) -> str:
    return f"[{timing.low:g}, {timing.median:g}, {timing.high:g}] us"


def check_fits(profile: Profile, engine: str, engine_version: str, kernels: Mapping[str, tuple[str, ...]]) -> None:
    """Raise :class:`ProfileError` unless ``profile`` was measured for this engine build and its kernels.

    ``engine_version`` may be empty (an engine registered in-process has none); the version is then
    not compared.
    """
    lines = key_lines(profile.text) if profile.text else {}

    def fail(path: Path, message: str) -> ProfileError:
        return ProfileError(f"{format_path(path)}: {message}", profile.source, line_of(lines, path))

    if profile.engine != engine:
        raise fail(("engine",), f"measured for engine {profile.engine!r}, not {engine!r}")
    if engine_version and profile.engine_version != engine_version:
        raise fail(
            ("engine_version",),
            f"measured with {engine} {profile.engine_version}, but {engine} {engine_version} is installed; "
            "run `pie tune` again",
        )
    for tuning in profile.kernels:
        listed = kernels.get(tuning.kernel)
        if listed is None:
            raise fail(("kernels", tuning.kernel), f"engine {engine!r} does not implement kernel {tuning.kernel!r}")
        unknown = [v for v in tuning.variants if v not in listed]
        if unknown:
            index = tuning.variants.index(unknown[0])
            raise fail(
                ("kernels", tuning.kernel, "variants", index),
                f"engine {engine!r} has no variant {unknown[0]!r} of {tuning.kernel} (it has: {', '.join(listed)})",
            )
        if tuning.default and tuning.default != listed[0]:
            raise fail(
                ("kernels", tuning.kernel, "default"),
                f"default {tuning.default!r} is not the engine's default variant {listed[0]!r}",
            )
