"""The device profile: hardware metadata and measured kernel timings, nothing else.

A profile says, for one engine on one device, which kernel variant is fastest
per shape bucket, with the times that justify each choice. Buckets are anchored
on powers of two: ``rows`` buckets the launch's row count, ``size`` the element
count of its static operand (see :func:`pie.poem.lower.static_size`). A bucket
that picks a variant other than the engine's default carries times showing it
faster with confidence; shapes no bucket covers run the default.

Attention's buckets may also name ``min_kv_tokens``, a power of two: the bucket holds
for passes whose longest KV length (keys of one sequence, cached and new) is at least
that, up to the next larger ``min_kv_tokens`` among the buckets of the same kernel,
size and row count. A bucket without it (every bucket of a file older than the key)
holds for every KV length those leave. Unlike ``size`` and ``rows`` it is a lower bound,
not one anchor: a variant that wins over long contexts (split-KV) wins over longer ones
too, and no bucket can anchor every length a model may reach. Where buckets of one file
overlap, the more specific holds: one naming a size over one for every size, then one
naming a row count, then the larger ``min_kv_tokens``. A launch outside a pass (a
kernel test) has no KV length and takes the buckets without the key. The key changes
the meaning of no file written without it, so the schema version stays 1; a pie-core
older than the key rejects a file that names it (an unknown key), never misreads it.

An engine also ships *default profiles* (``[tune] mode = "default"``): its choice
per row count for a kind of device, written by hand rather than measured. Their
buckets may leave out ``size`` or ``rows`` (every size, every row count) and
carry no times. One applies beneath whatever measured profile applies, for the
shapes that profile does not cover; there is no other variant policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pie.poem.lower import ShapeBuckets, pow2_floor

SCHEMA_VERSION = 1
"""Version of the profile file format; a file of any other version is rejected whole."""

TUNE_MODES = ("quick", "full", "default")
DEFAULT_MODE = "default"
"""The tune mode of an engine's default profile: choices by rule, not measured."""
ANY = 0
"""A default profile's bucket ``size`` or ``rows`` that covers every size or row count; a bucket's
``min_kv_tokens`` when it names none (every KV length)."""


class ProfileError(ValueError):
    """A profile file is malformed or does not fit this runtime; nothing of it is applied."""

    def __init__(self, message: str, source: str = "<profile>", line: int | None = None, *, named: bool = False):
        """``named``: the message names its source itself, and is said as it is (else ``source:line: message``)."""
        self.message = message
        self.source = source
        self.line = line
        where = f"{source}:{line}" if line is not None else source
        super().__init__(message if named else f"{where}: {message}")


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
    """Anchor of the static operand's element count; :data:`ANY` (default profiles only): every size."""
    rows: int
    """Anchor of the row count; :data:`ANY` (default profiles only): every row count."""
    variant: str
    times: tuple[tuple[str, Timing], ...]
    """Per measured variant; holds the default and the chosen variant (empty in a default profile)."""
    shapes: tuple[tuple[int, ...], ...] = ()
    """Shapes of the static operands measured for this bucket."""
    min_kv_tokens: int = ANY
    """Attention only: the least longest-KV-length of the passes it holds for (see the module docstring)."""

    @property
    def anchors(self) -> tuple[int, int, int]:
        """What identifies the bucket in its kernel: (size, rows, min_kv_tokens)."""
        return self.size, self.rows, self.min_kv_tokens

    def time(self, variant: str) -> Timing | None:
        return dict(self.times).get(variant)


@dataclass(frozen=True)
class KernelTuning:
    kernel: str
    default: str
    """The engine's default variant; empty in a default profile that does not name it (whichever it is)."""
    variants: tuple[str, ...]
    buckets: tuple[Bucket, ...]
    """Sorted by (size, min_kv_tokens, rows), each :attr:`Bucket.anchors` once."""

    def choices(self) -> dict[tuple[int, int, int], str]:
        return {b.anchors: b.variant for b in self.buckets}

    def speedups(self) -> list[tuple[Bucket, float]]:
        """Per bucket, the default variant's median time over the chosen one's: what the profile
        gains there (1.0 where it keeps the default)."""
        result = []
        for bucket in self.buckets:
            default, chosen = bucket.time(self.default), bucket.time(bucket.variant)
            if default is not None and chosen is not None and chosen.median > 0:
                result.append((bucket, default.median / chosen.median))
        return result

    def crossovers(self) -> dict[tuple[int, int], list[tuple[int, str]]]:
        """Per (size, min_kv_tokens): the row counts where the chosen variant changes, with the new variant."""
        result: dict[tuple[int, int], list[tuple[int, str]]] = {}
        for bucket in self.buckets:
            changes = result.setdefault((bucket.size, bucket.min_kv_tokens), [])
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
    """In a default profile: the kind of device it is for (empty: any)."""
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

    @property
    def is_default(self) -> bool:
        """An engine's default profile (hand-written choices) rather than a measured one."""
        return self.tune.mode == DEFAULT_MODE


@dataclass(frozen=True)
class ProfileBuckets(ShapeBuckets):
    """Buckets of a profile laid over the engine's default profile, for :func:`pie.poem.lower`.

    ``entries`` are ``(size, rows, min_kv_tokens, variant)`` in rising precedence (the default profile's
    first, each layer's more specific buckets after its others, see the module docstring); a size or
    row count of :data:`ANY` covers every one. An entry naming ``default`` runs the engine's default
    variant: a measured profile's bucket that kept the default thus hides the default profile's choice there.
    """

    entries: tuple[tuple[int, int, int, str], ...]  # type: ignore[assignment]  # and the KV threshold
    default: str = ""

    def variants(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(v for *_, v in self.entries if v != self.default))

    def kv_thresholds(self) -> tuple[int, ...]:
        return tuple(sorted({kv for _, _, kv, _ in self.entries if kv != ANY}))

    def rows_for(self, size: int, kv_tokens: int = 0) -> dict[int, str]:
        anchor = pow2_floor(size)
        chosen: dict[int, str] = {}
        for bucket_size, rows, min_kv, variant in self.entries:
            if bucket_size in (ANY, anchor) and min_kv <= kv_tokens:
                chosen.update({1 << bit: variant for bit in range(64)} if rows == ANY else {rows: variant})
        return chosen

    def restricted(self, supported: tuple[str, ...]) -> ProfileBuckets:
        """Without entries for variants ``supported`` lacks; none at all when every entry left names its
        default (its first), which then runs without a dispatcher."""
        default = supported[0]
        entries = tuple(e for e in self.entries if e[3] in supported)
        if all(variant == default for *_, variant in entries):
            entries = ()
        return ProfileBuckets(entries, default)

    def describe(self) -> str:
        """E.g. ``gemv at 1,2 rows (any size); split_kv at 1,2 rows (any size, from 2048 keys)``; the
        default-profile choices that measured buckets hide are still listed."""
        parts = []
        for variant in self.variants():
            groups = dict.fromkeys((size, kv) for size, _, kv, v in self.entries if v == variant)
            cells = []
            for size, kv in groups:
                rows = [r for s, r, k, v in self.entries if (s, k) == (size, kv) and v == variant]
                counts = "any rows" if ANY in rows else ",".join(str(r) for r in sorted(rows)) + " rows"
                where = "any size" if size == ANY else f"size 2^{size.bit_length() - 1}"
                cells.append(f"{counts} ({where}{f', from {kv} keys' if kv != ANY else ''})")
            parts.append(f"{variant} at {', '.join(cells)}")
        return "; ".join(parts)


def _layer(tuning: KernelTuning | None) -> list[tuple[int, int, int, str]]:
    if tuning is None:
        return []
    ordered = sorted(
        tuning.buckets, key=lambda b: (b.size != ANY, b.rows != ANY, b.size, b.rows, b.min_kv_tokens)
    )
    return [(*b.anchors, b.variant) for b in ordered]


def _overlap(entry: tuple[int, int, int, str], other: tuple[int, int, int, str]) -> bool:
    """Whether two entries hold for some launch alike (every two KV thresholds do)."""
    return all(a == b or ANY in (a, b) for a, b in zip(entry[:2], other[:2], strict=True))


class ProfileChooser:
    """The ``choose_variant`` object for :func:`pie.poem.lower`/``ModelRunner``: per kernel, a profile's
    buckets over those of the engine's default profile (``base``), either may be absent.

    Kernels whose buckets all keep the default get None, so their steps launch
    the engine's default launcher directly, with no dispatch in between.
    """

    def __init__(self, profile: Profile | None, base: Profile | None = None):
        if profile is None and base is None:
            raise ValueError("a ProfileChooser needs a profile, a default profile or both")
        self.profile = profile
        self.base = base
        layers = [p for p in (base, profile) if p is not None]
        names = dict.fromkeys(t.kernel for p in layers for t in p.kernels)
        self._buckets: dict[str, ShapeBuckets] = {}
        for kernel in names:
            tunings = [p.kernel(kernel) for p in layers]
            default = next((t.default for t in reversed(tunings) if t is not None and t.default), "")
            bottom, *above = [_layer(t) for t in tunings]
            # Buckets that keep the default matter only where they hide another beneath them.
            kept = [
                e for i, e in enumerate(bottom)
                if e[3] != default or any(x[3] != default and _overlap(e, x) for x in bottom[:i])
            ]
            entries = tuple(kept + [e for layer in above for e in layer])
            if not any(variant != default for *_, variant in entries):
                continue
            plain = all(
                ANY not in (size, rows) and kv == ANY and variant != default for size, rows, kv, variant in entries
            )
            if plain:
                self._buckets[kernel] = ShapeBuckets(tuple((size, rows, v) for size, rows, _, v in entries))
            else:
                self._buckets[kernel] = ProfileBuckets(entries, default)

    def __call__(self, kernel: str) -> ShapeBuckets | None:
        return self._buckets.get(kernel)

    def __repr__(self) -> str:
        names = " over ".join(repr(p.name) for p in (self.profile, self.base) if p is not None)
        return f"<ProfileChooser {names}: {', '.join(sorted(self._buckets)) or 'defaults only'}>"
