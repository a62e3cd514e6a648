"""`pie profile list|show|export|diff|plot` and `pie tune`."""

from __future__ import annotations

import logging
import math
import os
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from pie.cli_errors import TERMINATED_EXIT, Terminated, fail, path_argument, sigterm_interrupts, usage
from pie.device_use import DeviceClaim, device_users
from pie.entry import INTERRUPTED
from pie.files import non_regular_kind, write_atomically
from pie.plugins import EngineError, lost_device
from pie.profiles.loader import MAX_TUNE_SECONDS
from pie.profiles.loader import NAME as PROFILE_NAME
from pie.profiles.loader import parse_profile, read_profile_file
from pie.profiles.lookup import (
    Candidate,
    engine_candidates,
    fit_problem,
    match_level,
    names_a_file,
    resolve,
    user_candidates,
    user_profile_dir,
)
from pie.profiles.schema import ANY, Profile, ProfileError
from pie.profiles.writer import dump_profile

if TYPE_CHECKING:
    from pie.contract import DeviceInfo
    from pie.plugins import Device, EngineRegistry
    from pie.profiles.tuner import Tuner

profile_app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="Device profiles: the fastest kernel variant per shape."
)




def _registry() -> EngineRegistry:
    from pie.plugins import EngineRegistry

    return EngineRegistry()


def _all_candidates(registry: EngineRegistry) -> list[tuple[Candidate, str]]:
    """Every profile found, with what it does on each working engine's first device. An engine that passed its
    probe but cannot start in this process is a note on stderr, and its profiles are not listed."""
    devices: dict[str, Device] = {}
    applied: set[str] = set()
    for status in registry.statuses():
        if status.status == "ok":
            try:
                device = devices[status.name] = registry.engine(status.name).open(0)
            except EngineError as exc:
                typer.secho(f"note: {exc}; its profiles are not listed", err=True, fg=typer.colors.YELLOW)
                continue
            try:
                applied.update(c.source for c, what in resolve(device).considered if what == "applies")
            except ProfileError:
                pass  # a PIE_PROFILE that cannot apply: `pie profile show` reports it
    found = [(candidate, _status(candidate, devices, applied)) for candidate in user_candidates()]
    for device in devices.values():
        found.extend((c, _status(c, devices, applied)) for c in engine_candidates(device.engine))
    return found


def _status(candidate: Candidate, devices: dict[str, Device], applied: set[str]) -> str:
    if candidate.profile is None:
        return f"rejected: {candidate.error}"
    device = devices.get(candidate.profile.engine)
    if device is None:
        return f"engine {candidate.profile.engine!r} is not available here"
    problem = fit_problem(candidate, device)
    if problem:
        return problem
    level = match_level(candidate.profile, device.info)
    if level is None:
        return "for another device"
    if candidate.profile.is_default:
        closeness = f"default for {candidate.profile.device.kind or 'any'} devices"
    else:
        closeness = ("exact device", "same architecture", "same vendor")[level]
    return f"applies to {device.info.key} ({closeness})" if candidate.source in applied else f"{closeness}, not chosen"


ORIGINS = ("user", "engine")
"""The prefixes that choose among profiles of one name: ``user:NAME`` (yours), ``engine:NAME`` (shipped)."""


PROFILE_ARGUMENT = "Profile name or file (user:NAME or engine:NAME: yours or the shipped one of that name)."


def _find(name: str) -> Profile:
    """A profile by file path or by name (the user's first, then the engines'), or ``ORIGIN:NAME``: where a tune of
    yours took the name of a profile an engine ships, ``engine:NAME`` is the shipped one, which has no file to name."""
    origin, _, bare = name.partition(":")
    if origin not in ORIGINS or not PROFILE_NAME.fullmatch(bare):
        origin, bare = "", name
        if names_a_file(name):
            path = Path(name).expanduser()
            try:
                return parse_profile(read_profile_file(path), str(path))
            except OSError as exc:
                raise ProfileError(f"cannot read: {exc.strerror or exc}", str(path)) from exc
    found = [candidate for candidate, _ in _all_candidates(_registry())
             if candidate.profile is not None and candidate.profile.name == bare and origin in ("", candidate.origin)]
    if not found:
        whose = {"user": "of yours ", "engine": "shipped by an engine "}.get(origin, "")
        raise ProfileError(f"no profile {whose}named {bare!r} (see `pie profile list`)", name)
    if len(found) > 1:  # said on stderr: `export NAME > NAME.toml` keeps stdout for the profile
        others = ", ".join(candidate.source for candidate in found[1:])
        if not origin and len({candidate.origin for candidate in found}) > 1:
            how = f"user:{bare} or engine:{bare} chooses yours or the shipped one, a file's path any of them"
        else:
            how = "give a file's path to choose another"
        typer.secho(f"note: profile {bare!r} is also in {others}; this is the one in {found[0].source} ({how})",
                    err=True, fg=typer.colors.YELLOW)
    assert found[0].profile is not None
    return found[0].profile


@profile_app.command("list")
def list_profiles() -> None:
    """Every profile found (yours and those engines ship) and whether it fits this machine."""
    lookup_log = logging.getLogger("pie.profiles")
    level = lookup_log.level
    lookup_log.setLevel(logging.ERROR)  # a rejected file's warning: its row below says it already
    try:
        rows = _all_candidates(_registry())
    except EngineError as exc:  # a setting that names no engine, say
        raise fail(str(exc)) from exc
    finally:
        lookup_log.setLevel(level)
    if not rows:
        typer.echo(f"no profiles (yours go in {user_profile_dir()}; `pie tune` writes one)")
        return
    for candidate, status in rows:
        profile = candidate.profile
        what = "?"
        if profile is not None:
            what = f"{profile.engine}: {'(default profile)' if profile.is_default else profile.device.name}"
        typer.echo(f"{candidate.name:<40} {candidate.origin:<6} {what:<40} {status}")
        typer.echo(f"{'':<40} {candidate.source}")


@profile_app.command("show")
def show(
    engine: Annotated[Optional[str], typer.Option(help="Engine (default: the one `pie run` would use).")] = None,
) -> None:
    """Which profile applies to the device and why, with its crossovers."""
    try:
        device, why = _registry().select(engine)
        resolution = resolve(device)
    except (EngineError, ProfileError) as exc:
        raise fail(str(exc)) from exc
    info = device.info
    typer.echo(
        f"device   {info.key}: {info.name} ({info.vendor}, {info.architecture}); "
        f"engine {device.name} {device.engine.version} ({why})"
    )
    typer.echo(f"profile  {resolution.reason}")
    for candidate, status in resolution.considered:
        typer.echo(f"  {status:<24.200} {candidate.name} ({candidate.source})")
    for profile in (resolution.profile, resolution.base):
        if profile is not None:
            typer.echo(describe_choices(profile))


def describe_choices(profile: Profile) -> str:
    """Per kernel, size bucket and KV threshold: the rows where the chosen variant changes."""
    made = "written by hand" if profile.is_default else f"{profile.tune.mode} tune, {profile.tune.measured_at}"
    lines = [f"crossovers of {profile.name!r} ({made}):"]
    for tuning in profile.kernels:
        for (size, min_kv), changes in tuning.crossovers().items():
            group = [b for b in tuning.buckets if (b.size, b.min_kv_tokens) == (size, min_kv)]
            shapes = {shape for b in group for shape in b.shapes}
            shape_text = ", ".join("x".join(map(str, s)) for s in sorted(shapes))
            steps = ", ".join(
                f"{'any rows' if rows == ANY else f'from {rows} rows'}: {variant}" for rows, variant in changes
            )
            top = max(b.rows for b in group)
            size_text = "any size" if size == ANY else f"size 2^{size.bit_length() - 1}"
            keys = "" if min_kv == ANY else f"from {min_kv} keys: "
            measured = "" if profile.is_default else f" (measured to {top} rows)"
            lines.append(f"  {tuning.kernel:<22} {size_text:<9} {shape_text:<14} {keys}{steps}{measured}")
    if len(lines) == 1:
        lines.append("  (no kernel with more than one variant was measured)")
    return "\n".join(lines)


@profile_app.command("export")
def export(name: Annotated[str, typer.Argument(help=PROFILE_ARGUMENT)]) -> None:
    """Print a profile as TOML, to share: `pie profile export NAME > NAME.toml`."""
    try:
        typer.echo(dump_profile(_find(name)), nl=False)
    except (ProfileError, EngineError) as exc:
        raise fail(str(exc)) from exc


@profile_app.command("diff")
def diff(a: Annotated[str, typer.Argument(help=PROFILE_ARGUMENT)], b: Annotated[str, typer.Argument()]) -> None:
    """Compare two profiles: device metadata, and per bucket the choice and its median time."""
    try:
        first, second = _find(a), _find(b)
    except (ProfileError, EngineError) as exc:
        raise fail(str(exc)) from exc
    typer.echo(diff_profiles(first, second))


def diff_profiles(first: Profile, second: Profile) -> str:
    lines = [f"A = {first.name} ({first.source})", f"B = {second.name} ({second.source})"]
    for field in ("engine", "engine_version"):
        if getattr(first, field) != getattr(second, field):
            lines.append(f"{field}: A {getattr(first, field)!r}, B {getattr(second, field)!r}")
    for field in ("vendor", "name", "architecture", "kind", "driver", "memory_bytes"):
        left, right = getattr(first.device, field), getattr(second.device, field)
        if left != right:
            lines.append(f"device.{field}: A {left!r}, B {right!r}")
    changed = 0
    for kernel in dict.fromkeys([k.kernel for k in first.kernels] + [k.kernel for k in second.kernels]):
        left_tuning, right_tuning = first.kernel(kernel), second.kernel(kernel)
        left = {bk.anchors: bk for bk in (left_tuning.buckets if left_tuning else ())}
        right = {bk.anchors: bk for bk in (right_tuning.buckets if right_tuning else ())}
        lines.append(f"{kernel}:")
        for key in sorted(set(left) | set(right)):
            mark = " "
            texts = []
            for bucket in (left.get(key), right.get(key)):
                if bucket is None:
                    texts.append("-")
                    continue
                timing = bucket.time(bucket.variant)
                texts.append(f"{bucket.variant} {timing.median:.1f}us" if timing else bucket.variant)
            if key not in left or key not in right or left[key].variant != right[key].variant:
                mark, changed = "*", changed + 1
            size_text = "any" if key[0] == ANY else f"2^{key[0].bit_length() - 1}"
            keys = "" if key[2] == ANY else f" from {key[2]} keys"
            lines.append(f" {mark} size {size_text:<5} rows {key[1]:<5}{keys} A {texts[0]:<22} B {texts[1]}")
    lines.append(f"{changed} bucket(s) differ in choice or coverage")
    return "\n".join(lines)


STDOUT = "-"
"""``-o -``: standard output, the Unix convention (a file named ``-`` is ``-o ./-``, which a Path would not tell
apart: the options are strings)."""


@profile_app.command("plot")
def plot(
    name: Annotated[str, typer.Argument(help=PROFILE_ARGUMENT)],
    output: Annotated[str, typer.Option("-o", "--output", help="PNG file to write ('-': standard output).")],
) -> None:
    """Plot a profile's times per variant against rows (needs `pip install 'pie-core\\[plot]'`)."""
    from pie.profiles.plot import PlotUnavailable, plot_profile

    path_argument(output, "-o", "the PNG file to write, or '-' for standard output")
    stdout = typer.get_binary_stream("stdout")
    if output == STDOUT and stdout.isatty():
        raise usage("-o -: a PNG on a terminal is noise; redirect it (-o - > plot.png) or give a file's path")
    try:
        png = plot_profile(_find(name))
    except (ProfileError, EngineError, PlotUnavailable) as exc:
        raise fail(str(exc)) from exc
    if output == STDOUT:
        try:
            stdout.write(png)
            stdout.flush()
        except OSError as exc:  # a reader that went away (EPIPE)
            raise fail(f"cannot write the PNG to standard output: {exc.strerror or exc}") from exc
        return
    try:
        write_atomically(output, png)
    except OSError as exc:
        raise fail(f"cannot write {output}: {_os_error(exc, Path(output))}") from exc
    typer.echo(f"wrote {output}")


def tune_command(
    engine: Annotated[
        Optional[str], typer.Option(help="Engine to tune (default: the one `pie run` would use).")
    ] = None,
    full: Annotated[bool, typer.Option("--full", help="Sweep the whole grid (long; resumable).")] = False,
    budget: Annotated[
        Optional[float], typer.Option(help="Seconds to spend (quick: 150 by default; --full: no limit by default).")
    ] = None,
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="Profile file to write (not '-').")] = None,
    name: Annotated[Optional[str], typer.Option(help="Profile name (default: engine, vendor and device).")] = None,
    model: Annotated[Optional[str], typer.Option(help="Measure this model's shapes (default: SmolLM2-135M's).")] = None,
    restart: Annotated[
        bool,
        typer.Option("--restart", help="Measure from scratch: drop an interrupted run's results, and the buckets of "
                     "the profile it replaces that this run does not measure."),
    ] = False,
) -> None:
    """Measure kernel variants on this device and write your profile (quick: a few minutes).

    One tune of a profile runs at a time: a second is refused while the first measures."""
    from pie.profiles.lock import TuneBusyError, tune_lock
    from pie.profiles.tuner import Tuner, TuneSettings, default_profile_name
    from pie.profiles.workloads import REFERENCE_DIMS, Dims

    if budget is not None and not (math.isfinite(budget) and 0 < budget <= MAX_TUNE_SECONDS):
        raise usage(f"--budget must be a number of seconds above 0 and at most {MAX_TUNE_SECONDS:g} (about 16 weeks), "
                   f"not {budget:g}")
    if output == STDOUT:  # `-` is standard output to every command; a tune's profile must be a file
        raise usage("-o -: a tune writes its profile to a file, beside which an interrupted tune's measurements are "
                    "kept for the next run to resume; give a file's path (`pie profile export NAME` prints a profile)")
    if output is not None:  # before the budget is spent, not after
        path_argument(output, "-o", "the profile file to write")
        _refuse_non_regular(Path(output), f"-o {output}")
    if name is not None and not PROFILE_NAME.fullmatch(name):  # before the budget is spent, not after
        raise usage(f"--name {name!r}: a profile's name is letters, digits, '.', '_' and '-', starting with a letter or "
                   "digit (at most 128)")
    try:
        device, why = _registry().select(engine)
        dims = REFERENCE_DIMS
        if model is not None:
            from pie.model.loader import load_model
            from pie.model.store import resolve_model

            source = resolve_model(model)
            dims = Dims.from_config(load_model(source).config, Path(str(source)).name)
    except (EngineError, OSError, ValueError) as exc:
        raise fail(str(exc)) from exc
    settings = TuneSettings.full(budget) if full else TuneSettings.quick(150.0 if budget is None else budget)
    profile_name = name or default_profile_name(device)
    target = Path(output) if output is not None else user_profile_dir() / f"{profile_name}.toml"
    partial = target.with_name(target.stem + ".partial.json")
    _refuse_non_regular(target, str(target))
    _refuse_non_regular(partial, f"{partial}, where an interrupted tune's measurements are kept,")
    tuner = Tuner(device, settings, partial, dims)
    with ExitStack() as held:
        try:
            held.enter_context(tune_lock(target))
        except TuneBusyError as exc:
            holder = "" if exc.holder is None else f" (process {exc.holder})"
            raise fail(f"another `pie tune`{holder} is measuring into {target}: wait for it to end, or tune another "
                       "profile (--name, -o); two at once would slow each other's kernels and skew both") from exc
        except OSError as exc:  # its folder or lock file cannot be made
            raise fail(f"cannot write {target}: {_os_error(exc, target)}") from exc
        held.enter_context(DeviceClaim(device.info, "tune"))
        held.enter_context(sigterm_interrupts())
        _say_device_users(device.info)
        _tune(tuner, target, profile_name, why, restart)


def _say_device_users(info: DeviceInfo) -> None:
    """A note naming the servers and other tunes that use the device being tuned (see :mod:`pie.device_use`)."""
    users = device_users(info)
    if users:
        typer.secho(
            f"note: {' and '.join(map(str, users))} also use{'s' if len(users) == 1 else ''} this device "
            f"({info.key}{', the host CPU' if info.kind == 'cpu' else ''}): the timings will be noisy and its "
            "work slower while this tune runs; tune with it stopped or idle for a profile to trust",
            err=True,
            fg=typer.colors.YELLOW,
        )


def _tune(tuner: Tuner, target: Path, profile_name: str, why: str, restart: bool) -> None:
    """Measure and write ``target``, holding its tune lock."""
    from dataclasses import replace

    from pie.profiles.tuner import (
        PartialFileError,
        PartialOfAnotherTuneError,
        carry_over,
        load_average,
        measured_alike,
    )

    partial = tuner.partial_path
    earlier = _replaced_profile(target, tuner)
    if restart:
        partial.unlink(missing_ok=True)
    else:
        try:
            if tuner.load_partial():
                typer.echo(f"resuming: {tuner.resumed} measurement(s) kept from an interrupted run ({partial})")
        except PartialOfAnotherTuneError as exc:
            raise fail(f"{exc}: run that tune again to finish it, or give --restart to drop them") from exc
        except PartialFileError as exc:
            typer.secho(f"note: {exc}; measuring from scratch", err=True, fg=typer.colors.YELLOW)
    busy = load_average()
    cores = os.cpu_count() or 1
    if busy is not None and busy > cores / 2:
        typer.secho(
            f"note: load average {busy:.1f} on {cores} core(s): timings will be noisy; where noise hides a "
            "difference the default variant is kept",
            err=True,
            fg=typer.colors.YELLOW,
        )
    device = tuner.device
    typer.echo(
        f"tuning {device.info.key} ({device.info.name}; {why}), {tuner.settings.mode} mode, "
        f"{len(tuner.cells())} cells over {', '.join(tuner.tunable()) or 'no kernel with variants'}"
    )
    try:
        profile = _run_with_progress(tuner)
    except KeyboardInterrupt as exc:
        kept = (f"{tuner.kept} measurement(s) kept in {partial}; run the same command to resume" if tuner.kept
                else "before any measurement was kept")
        stopped = "terminated" if isinstance(exc, Terminated) else "interrupted"
        typer.secho(
            f"\n{stopped}: {kept}" + ("" if earlier is None else f"; {target} is as it was"),
            err=True,
            fg=typer.colors.YELLOW,
        )
        raise typer.Exit(TERMINATED_EXIT if isinstance(exc, Terminated) else INTERRUPTED) from None
    except OSError as exc:
        raise fail(f"cannot keep the measurements in {partial}: {_os_error(exc, partial)}") from exc
    except EngineError as exc:
        kept = ""
        if lost_device(exc) and tuner.kept:
            kept = (f"; {tuner.kept} measurement(s) kept in {partial}: once the device works again (a driver "
                    "or machine restart), run the same command to resume")
        raise fail(f"{exc}{kept}") from exc
    for reason in tuner.left_out.values():
        typer.secho(f"note: {reason}; that variant is not measured", err=True, fg=typer.colors.YELLOW)
    profile = replace(profile, name=profile_name)
    kept = 0
    if earlier is not None and not restart and measured_alike(earlier, profile):
        profile, kept = carry_over(profile, earlier)
    text = dump_profile(profile)
    parse_profile(text, str(target))  # what is written must load
    try:
        write_atomically(target, text)
    except OSError as exc:
        stay = f" (the measurements stay in {partial})" if tuner.kept else ""
        raise fail(f"cannot write {target}: {_os_error(exc, target)}{stay}") from exc
    partial.unlink(missing_ok=True)
    if tuner.budget_exhausted:
        typer.echo(
            f"the budget ran out: {len(tuner.results)} of {len(tuner.cells())} cells measured; "
            "the rest keep the defaults" + (" or what the profile held" if kept else "")
        )
    if kept:
        typer.echo(f"kept {kept} bucket(s) of the earlier profile that this run did not measure (--restart drops them)")
    typer.echo(f"measured in {profile.tune.seconds:.0f} s; wrote {target}")
    typer.echo(describe_choices(profile))


def _replaced_profile(target: Path, tuner: Tuner) -> Profile | None:
    """The profile at ``target``, which the tune replaces (None: no file there).

    Fails, before anything is measured, where that file is not one a tune may replace: one that does not load
    (a hand edit gone wrong, say) or that is another engine's or device's; its measurements would be lost."""
    try:
        data = read_profile_file(target)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise fail(f"cannot read {target}, which this tune would replace: {_os_error(exc, target)}; remove it, or "
                   "give another --name or -o") from exc
    try:
        earlier = parse_profile(data, str(target))
    except ProfileError as exc:
        raise fail(f"{exc}; `pie tune` replaces only a profile that loads: fix that file or move it away, or give "
                   "another --name or -o") from exc
    mine = tuner.device_meta()
    same_device = (earlier.device.vendor, earlier.device.name, earlier.device.architecture) == (
        mine.vendor, mine.name, mine.architecture)
    if earlier.is_default or earlier.engine != tuner.device.name or not same_device:
        what = "an engine's default profile" if earlier.is_default else (
            f"measured with engine {earlier.engine!r} on {earlier.device.vendor} {earlier.device.name}")
        raise fail(f"{target} holds profile {earlier.name!r}, {what}, not engine {tuner.device.name!r} on "
                   f"{mine.vendor} {mine.name}; this tune would replace it: move it away first, or give another "
                   "--name or -o")
    return earlier


def _refuse_non_regular(path: Path, what: str) -> None:
    """Fail, naming ``what``, when ``path`` is a folder, device or FIFO: a profile never replaces one."""
    kind = non_regular_kind(path)
    if kind == "a folder":
        raise fail(f"{what} is a folder: give the profile file's path (for example {path / 'mine.toml'})")
    if kind is not None:
        raise fail(f"{what} is {kind}, not a regular file: give the path of a profile file to write "
                   "(pie never replaces a device or a FIFO)")


def _os_error(exc: OSError, path: Path) -> str:
    """What went wrong, naming the file it concerns where that is not ``path`` (a temporary file beside it)."""
    reason = exc.strerror or str(exc)
    if exc.filename is not None and Path(os.fsdecode(exc.filename)) != path:
        return f"{reason}: {os.fsdecode(exc.filename)}"
    return reason


def _run_with_progress(tuner) -> Profile:
    from rich.markup import escape  # a cell's description is text, not markup
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("{task.description:<44}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[budget]}"),
    )
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task("starting", total=None, budget="")

        def report(what: str, done: int, total: int, left: float | None) -> None:
            budget = "" if left is None else f"budget left {left:.0f}s"
            progress.update(task, description=escape(what), completed=done, total=total, budget=budget)

        return tuner.run(report)
