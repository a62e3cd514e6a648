"""The device profile: hardware metadata and measured kernel timings, nothing else.

A profile says, for one engine on one device, which kernel variant is fastest
per shape bucket, with the times that justify each choice. Buckets are anchored
on powers of two: ``rows`` buckets the launch's row count, ``size`` the element
count of its static operand (see :func:`pie.poem.lower.static_size`). A bucket
that picks a variant other than the engine's default carries times showing it
faster with confidence; shapes no bucket covers run the default.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pie.poem.lower import ShapeBuckets

SCHEMA_VERSION = 1
"""Version of the profile file format; a file of any other version is rejected whole."""

TUNE_MODES = ("quick", "full")


class ProfileError(ValueError):
    """A profile file is malformed or does not fit this runtime; nothing of it is applied."""

    def __init__(self, message: str, source: str = "<profile>", line: int | None = None):
        self.message = message
        self.source = source
        self.line = line
        where = f"{source}:{line}" if line is not None else source
        super().__init__(f"{where}: {message}")


@dataclass(frozen=True)
class Timing:
    """Microseconds per launch: lower quantile, median, upper quantile."""

    low: float
    median: float
    high: float

    def beats(self, other: Timing, margin: float = 0.0) -> bool:
        """Faster with confidence: this upper quantile under ``other``'s lower one by ``margin``."""
        return self.high < other.low * (1.0 - margin)


@dataclass(frozen=True)
class Bucket:
    size: int
    rows: int
    variant: str
    times: tuple[tuple[str, Timing], ...]
    """Per measured variant; always holds the default and the chosen variant."""
    shapes: tuple[tuple[int, ...], ...] = ()
    """Shapes of the static operands measured for this bucket."""

    def time(self, variant: str) -> Timing | None:
        return dict(self.times).get(variant)


@dataclass(frozen=True)
class KernelTuning:
    kernel: str
    default: str
    variants: tuple[str, ...]
    buckets: tuple[Bucket, ...]
    """Sorted by (size, rows), each (size, rows) once."""

    def choices(self) -> dict[tuple[int, int], str]:
        return {(b.size, b.rows): b.variant for b in self.buckets}

    def speedups(self) -> list[tuple[Bucket, float]]:
        """Per bucket, the default variant's median time over the chosen one's: what the profile
        gains there (1.0 where it keeps the default)."""
        result = []
        for bucket in self.buckets:
            default, chosen = bucket.time(self.default), bucket.time(bucket.variant)
            if default is not None and chosen is not None and chosen.median > 0:
                result.append((bucket, default.median / chosen.median))
        return result

    def crossovers(self) -> dict[int, list[tuple[int, str]]]:
        """Per size bucket: the row counts where the chosen variant changes, with the new variant."""
        result: dict[int, list[tuple[int, str]]] = {}
        for bucket in self.buckets:
            changes = result.setdefault(bucket.size, [])
            current = changes[-1][1] if changes else self.default
            if bucket.variant != current or not changes:
                changes.append((bucket.rows, bucket.variant))
        return result


@dataclass(frozen=True)
class DeviceMeta:
    vendor: str
    name: str
    architecture: str
    kind: str
    driver: str
    memory_bytes: int


@dataclass(frozen=True)
class TuneMeta:
    mode: str
    measured_at: str
    seconds: float
    warmup: int
    repeats: int
    margin: float
    workload: str
    load_average: float | None = None
    """The machine's one-minute load average when the tune began (None where the OS has none)."""


@dataclass(frozen=True)
class Profile:
    name: str
    engine: str
    engine_version: str
    device: DeviceMeta
    tools: tuple[tuple[str, str], ...]
    tune: TuneMeta
    kernels: tuple[KernelTuning, ...]
    source: str = field(default="<profile>", compare=False)
    text: str = field(default="", compare=False, repr=False)
    """The file's text as read (empty for a profile built in memory)."""

    def kernel(self, name: str) -> KernelTuning | None:
        return next((k for k in self.kernels if k.kernel == name), None)

    def shape_buckets(self) -> dict[str, ShapeBuckets]:
        """Per kernel, the buckets that choose a variant other than the default (for :func:`pie.poem.lower`)."""
        result = {}
        for tuning in self.kernels:
            entries = tuple((b.size, b.rows, b.variant) for b in tuning.buckets if b.variant != tuning.default)
            if entries:
                result[tuning.kernel] = ShapeBuckets(entries)
        return result


class ProfileChooser:
    """The ``choose_variant`` object for :func:`pie.poem.lower`/``ModelRunner``: a profile's buckets per kernel.

    Kernels whose buckets all keep the default get None, so their steps launch
    the engine's default launcher directly, with no dispatch in between.
    """

    def __init__(self, profile: Profile):
        self.profile = profile
        self._buckets = profile.shape_buckets()

    def __call__(self, kernel: str) -> ShapeBuckets | None:
        return self._buckets.get(kernel)

    def __repr__(self) -> str:
        return f"<ProfileChooser {self.profile.name!r}: {', '.join(sorted(self._buckets)) or 'defaults only'}>"
