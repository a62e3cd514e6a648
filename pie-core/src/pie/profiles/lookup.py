"""Which profile applies to a device, and why.

Candidates are the user's own profiles (``PIE_PROFILE_PATH``, ``os.pathsep``
separated files or folders, else the ``pie/profiles`` folder of the user config
directory) and the profiles engines ship (``pie_device_profiles``). A candidate
must be for the device's engine and fit it (same engine version, known kernels
and variants); a file that does not is rejected whole, with the reason logged.
The closest match wins: the exact device, then the same architecture, then the
same vendor; at equal closeness the user's profile wins over a shipped one.
Default profiles (``[tune] mode = "default"``, see :mod:`pie.profiles.schema`) are
looked up apart: the one for the device's kind (else the one for any device) lies
beneath the measured profile, for the shapes it does not cover. Nothing matching:
the engine's default variants.

``PIE_PROFILE`` forces one profile (a name or a file) or turns profiles off (``none``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pie.contract import DeviceInfo
from pie.plugins import Device, Engine
from pie.profiles.loader import NAME, check_fits, parse_profile, read_profile_file
from pie.profiles.schema import Profile, ProfileChooser, ProfileError

PROFILE_PATH_ENV = "PIE_PROFILE_PATH"
PROFILE_ENV = "PIE_PROFILE"
LEVELS = ("the exact device", "the same architecture", "the same vendor")
NOT_USABLE = "not usable here: "
"""How a profile's status begins where the engine cannot offer a variant it was measured with (its reason follows)."""

log = logging.getLogger("pie.profiles")


def user_profile_dirs(env: Mapping[str, str] | None = None) -> list[Path]:
    """Where the user's profiles are looked for, in order."""
    raw = (env if env is not None else os.environ).get(PROFILE_PATH_ENV, "")
    entries = [Path(p).expanduser() for p in raw.split(os.pathsep) if p.strip()]
    if entries:
        return entries
    from platformdirs import user_config_dir

    return [Path(user_config_dir("pie")) / "profiles"]


def user_profile_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where `pie tune` writes: the first folder of ``PIE_PROFILE_PATH``, else the user config folder."""
    for entry in user_profile_dirs(env):
        if not entry.suffix == ".toml":
            return entry
    return user_profile_dirs({})[0]


def names_a_file(text: str) -> bool:
    """Whether ``text`` (``PIE_PROFILE``, an argument of `pie profile export`) means a file rather than a profile's
    name: it cannot be a name (a path separator, '..', more than 128 characters), ends in '.toml', or is a file."""
    if not text:
        return False
    if not NAME.fullmatch(text) or text.endswith(".toml"):
        return True
    try:
        return Path(text).expanduser().is_file()
    except OSError:  # a name no file system takes
        return False


@dataclass
class Candidate:
    """One profile file found: parsed, or rejected with the reason."""

    source: str
    origin: str
    """``user`` or ``engine``."""
    profile: Profile | None = None
    error: str = ""

    @property
    def name(self) -> str:
        return self.profile.name if self.profile else Path(self.source).stem


def _read(path: Path, origin: str) -> Candidate:
    try:
        return Candidate(str(path), origin, parse_profile(read_profile_file(path), str(path)))
    except ProfileError as exc:
        return Candidate(str(path), origin, error=str(exc))
    except OSError as exc:
        return Candidate(str(path), origin, error=f"{path}: cannot read: {exc.strerror or exc}")


def user_candidates(env: Mapping[str, str] | None = None) -> list[Candidate]:
    """The user's profile files; an entry of ``PIE_PROFILE_PATH`` that cannot be looked at (a name too long for a
    path, say) is one rejected candidate, so that a lookup warns of it and goes on."""
    found: list[Candidate] = []
    for entry in user_profile_dirs(env):
        try:
            files = sorted(entry.glob("*.toml")) if entry.is_dir() else [entry] if entry.is_file() else []
        except OSError as exc:
            found.append(Candidate(str(entry), "user", error=f"{entry}: cannot read: {exc.strerror or exc}"))
            continue
        found.extend(_read(path, "user") for path in files)
    return found


def engine_candidates(engine: Engine) -> list[Candidate]:
    where = f"{engine.distribution} {engine.version}".strip()
    try:
        texts = engine.profiles()
    except Exception as exc:
        return [Candidate(f"{where} (pie_device_profiles)", "engine", error=f"pie_device_profiles failed: {exc}")]
    found = []
    for index, text in enumerate(texts):
        source = f"{where} (shipped profile {index + 1})"
        try:
            found.append(Candidate(source, "engine", parse_profile(text, source)))
        except ProfileError as exc:
            found.append(Candidate(source, "engine", error=str(exc)))
    return found


def match_level(profile: Profile, info: DeviceInfo) -> int | None:
    """0: exact device, 1: same architecture, 2: same vendor, None: another device. A default profile:
    0 when for the device's kind, 1 when for any device."""

    def same(a: str, b: str) -> bool:
        return a.strip().casefold() == b.strip().casefold()

    meta = profile.device
    if profile.is_default:
        return 0 if meta.kind == info.kind else 1 if not meta.kind else None
    if same(meta.vendor, info.vendor) and same(meta.name, info.name) and same(meta.architecture, info.architecture):
        return 0
    if same(meta.architecture, info.architecture):
        return 1
    if same(meta.vendor, info.vendor):
        return 2
    return None


@dataclass
class Resolution:
    """The outcome of a lookup: the profile (or None) and every candidate with what became of it."""

    profile: Profile | None
    reason: str
    considered: list[tuple[Candidate, str]] = field(default_factory=list)
    base: Profile | None = None
    """The engine's default profile for the device, beneath ``profile``."""


def fit_problem(candidate: Candidate, device: Device) -> str:
    """Empty when ``candidate`` can be applied to ``device``; else why not."""
    if candidate.profile is None:
        return f"rejected: {candidate.error}"
    if candidate.profile.engine != device.name:
        return f"for engine {candidate.profile.engine!r}"
    try:
        check_fits(candidate.profile, device.name, device.engine.version, device.kernels())
    except ProfileError as exc:
        return _unusable(candidate.profile, device) or f"rejected: {exc}"
    return ""


def _unusable(profile: Profile, device: Device) -> str:
    """Where the one thing wrong with ``profile`` is a variant the engine cannot offer here (its native
    kernels cannot be built, say): ``NOT_USABLE`` and the engine's reason; else empty."""
    unavailable = device.unavailable_variants()
    if not unavailable:
        return ""
    offered = dict(device.kernels())
    missing = []
    for tuning in profile.kernels:
        listed = offered.get(tuning.kernel, ())
        lacking = [v for v in tuning.variants if v in unavailable and v not in listed]
        if lacking and tuning.kernel in offered:  # as if offered: the default first, where the profile says so
            offered[tuning.kernel] = (*lacking, *listed) if tuning.default in lacking else (*listed, *lacking)
            missing.extend(lacking)
    if not missing:
        return ""
    try:
        check_fits(profile, device.name, device.engine.version, offered)
    except ProfileError:
        return ""
    return f"{NOT_USABLE}{unavailable[missing[0]]}"


def resolve(device: Device, env: Mapping[str, str] | None = None) -> Resolution:
    """Find the profile for ``device`` and the default profile beneath it; rejected files are logged and
    skipped, never half-applied."""
    env = env if env is not None else os.environ
    candidates = user_candidates(env) + engine_candidates(device.engine)
    forced = env.get(PROFILE_ENV, "").strip()
    if forced:
        return _forced(device, forced, candidates)
    considered: list[tuple[Candidate, str]] = []
    best: dict[bool, tuple[tuple[int, int, int], Candidate]] = {}  # default profile or not -> best rank, candidate
    for order, candidate in enumerate(candidates):
        problem = fit_problem(candidate, device)
        if problem.startswith("rejected"):
            log.warning("profile %s %s", candidate.source, problem)
        elif problem.startswith(NOT_USABLE):
            log.warning("%s; so profile %s (%s), measured with them, does not apply (`pie doctor` says more)",
                        problem[len(NOT_USABLE):], candidate.name, candidate.source)
        if problem or candidate.profile is None:
            considered.append((candidate, problem))
            continue
        level = match_level(candidate.profile, device.info)
        default = candidate.profile.is_default
        meta = candidate.profile.device
        if level is None:
            other = f"{meta.kind} devices" if default else f"{meta.vendor} {meta.name}, {meta.architecture}"
            considered.append((candidate, f"for another device ({other})"))
            continue
        considered.append((candidate, _level_words(candidate.profile, level)))
        rank = (level, 0 if candidate.origin == "user" else 1, order)
        if default not in best or rank < best[default][0]:
            best[default] = (rank, candidate)
    info = device.info
    chosen, base = best.get(False), best.get(True)
    winners = [entry[1] for entry in (chosen, base) if entry]
    considered = [(c, "applies" if any(c is w for w in winners) else status) for c, status in considered]
    base_profile = base[1].profile if base else None
    beneath = f"; beneath it, {_default_words(base[1])}" if base and chosen else ""
    if chosen is None:
        rejected = sum(1 for _, status in considered if status.startswith("rejected"))
        unusable = sum(1 for _, status in considered if status.startswith(NOT_USABLE))
        notes = [f"{rejected} file(s) rejected"] if rejected else []
        notes += [f"{unusable} file(s) not usable here"] if unusable else []
        note = f" ({', '.join(notes)}; see `pie profile list`)" if notes else ""
        what = _default_words(base[1]) if base else "the engine's default variants apply"
        return Resolution(None, f"no profile matches {info.key} ({info.name}); {what}{note}", considered, base_profile)
    (level, _, _), candidate = chosen
    profile = candidate.profile
    assert profile is not None
    kind = "your profile" if candidate.origin == "user" else "the engine's shipped profile"
    reason = (
        f"{kind} {profile.name!r} ({candidate.source}) matches {LEVELS[level]}: "
        f"{profile.device.vendor} {profile.device.name}, {profile.device.architecture}{beneath}"
    )
    return Resolution(profile, reason, considered, base_profile)


def _level_words(profile: Profile, level: int) -> str:
    if profile.is_default:
        return f"the default for {profile.device.kind} devices" if level == 0 else "the default for any device"
    return f"matches {LEVELS[level]}"


def _default_words(candidate: Candidate) -> str:
    profile = candidate.profile
    assert profile is not None
    devices = f"{profile.device.kind} devices" if profile.device.kind else "any device"
    return f"the engine's default profile {profile.name!r} for {devices} applies ({candidate.source})"


def _forced(device: Device, forced: str, candidates: list[Candidate]) -> Resolution:
    if forced.lower() in ("none", "off", "default"):
        return Resolution(None, f"{PROFILE_ENV}={forced}: profiles are off; the engine's default variants apply")
    if names_a_file(forced):
        named = [_read(Path(forced).expanduser(), "user")]
    else:
        named = [c for c in candidates if c.profile is not None and c.profile.name == forced]
        if not named:
            raise ProfileError(
                f"{PROFILE_ENV}={forced}: the {device.name} engine has no profile of that name (`pie profile list` "
                "shows each profile's engine; another engine's applies when that engine runs: --engine)", forced)
    candidate = named[0]
    problem = fit_problem(candidate, device)
    if problem:
        raise ProfileError(f"{PROFILE_ENV}={forced} cannot apply to {device.info.key}: "
                           f"{problem.removeprefix('rejected: ')}", candidate.source, named=True)
    assert candidate.profile is not None
    base = None if candidate.profile.is_default else _default_beneath(device, candidates)
    return Resolution(
        candidate.profile,
        f"{PROFILE_ENV}={forced} asks for {candidate.profile.name!r} ({candidate.source})"
        + (f"; beneath it, {_default_words(base)}" if base else ""),
        [(candidate, "applies")],
        base.profile if base else None,
    )


def _default_beneath(device: Device, candidates: list[Candidate]) -> Candidate | None:
    """The default profile for ``device`` among ``candidates`` (for its kind first, the user's first)."""
    fitting = []
    for order, candidate in enumerate(candidates):
        if candidate.profile is None or not candidate.profile.is_default or fit_problem(candidate, device):
            continue
        level = match_level(candidate.profile, device.info)
        if level is not None:
            fitting.append(((level, 0 if candidate.origin == "user" else 1, order), candidate))
    return min(fitting, key=lambda entry: entry[0])[1] if fitting else None


def active_profile(device: Device, env: Mapping[str, str] | None = None) -> tuple[Profile | None, str]:
    """The profile that applies to ``device`` (a measured one, else the engine's default profile; None:
    the engine's default variants) and the reason, in words."""
    resolution = resolve(device, env)
    return resolution.profile or resolution.base, resolution.reason


def variant_chooser(device: Device, env: Mapping[str, str] | None = None) -> tuple[ProfileChooser | None, str]:
    """The ``choose_variant`` object for ``device`` (None when no profile applies) and why."""
    resolution = resolve(device, env)
    if resolution.profile is None and resolution.base is None:
        return None, resolution.reason
    return ProfileChooser(resolution.profile, resolution.base), resolution.reason
