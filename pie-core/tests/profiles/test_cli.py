"""`pie tune` and `pie profile ...` end to end on the CPU engine (tiny budget)."""

from __future__ import annotations

import errno
import json
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from pie.profiles import parse_profile
from pie.profiles.cli import profile_app, tune_command
from profile_fakes import VALID_TEXT
from typer.testing import CliRunner

pytest.importorskip("pie_engine_cpu")

app = typer.Typer()
app.add_typer(profile_app, name="profile")
app.command("tune")(tune_command)


@pytest.fixture
def cli(profile_dir: Path, monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.setenv("PIE_ENGINES", "cpu")
    monkeypatch.setenv("COLUMNS", "160")
    return CliRunner()


@pytest.fixture
def one_row_cells(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tunes measure only their 1-row cells, and to the end: a test that needs a measurement gets one whatever the
    machine's load (a 2-second budget measured none on a busy CI machine, serial or beside another worker)."""
    from pie.profiles.tuner import Tuner

    cells = Tuner.cells
    monkeypatch.setattr(Tuner, "cells", lambda self: [cell for cell in cells(self) if cell.rows == 1])


@pytest.fixture
def tuned(cli: CliRunner, profile_dir: Path, one_row_cells: None) -> Path:
    result = cli.invoke(app, ["tune", "--engine", "cpu", "--budget", "600", "--name", "mine"])
    assert result.exit_code == 0, result.output
    path = profile_dir / "mine.toml"
    assert path.is_file() and f"wrote {path}" in result.output
    assert not (profile_dir / "mine.partial.json").exists()
    return path


def test_tune_then_show_export_list(cli: CliRunner, tuned: Path) -> None:
    profile = parse_profile(tuned.read_bytes(), str(tuned))
    assert profile.name == "mine" and profile.engine == "cpu" and profile.tune.mode == "quick"

    shown = cli.invoke(app, ["profile", "show", "--engine", "cpu"])
    assert shown.exit_code == 0, shown.output
    assert "your profile 'mine'" in shown.output and "exact device" in shown.output

    exported = cli.invoke(app, ["profile", "export", "mine"])
    assert exported.exit_code == 0, exported.output
    assert parse_profile(exported.output) == profile

    listed = cli.invoke(app, ["profile", "list"])
    assert listed.exit_code == 0 and "mine" in listed.output and "applies to cpu:0 (exact device)" in listed.output


def test_export_of_a_name_two_files_hold_says_which_one_it_gives(cli: CliRunner, tuned: Path) -> None:
    """It took the first silently."""
    twin = tuned.with_name("zz-copy.toml")
    twin.write_text(tuned.read_text())
    exported = cli.invoke(app, ["profile", "export", "mine"])
    assert exported.exit_code == 0, exported.output
    assert parse_profile(exported.stdout) == parse_profile(tuned.read_bytes()), "stdout holds the profile alone"
    assert f"profile 'mine' is also in {twin}; this is the one in {tuned}" in exported.stderr


def test_diff_and_plot(cli: CliRunner, tuned: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.toml"
    other.write_text(
        tuned.read_text().replace('name = "mine"', 'name = "other"').replace('vendor = "', 'vendor = "Not', 1)
    )
    result = cli.invoke(app, ["profile", "diff", "mine", str(other)])
    assert result.exit_code == 0, result.output
    assert "device.vendor" in result.output and "0 bucket(s) differ" in result.output
    pytest.importorskip("matplotlib")
    png = tmp_path / "mine.png"
    result = cli.invoke(app, ["profile", "plot", "mine", "-o", str(png)])
    assert result.exit_code == 0, result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def profile_file(tmp_path: Path) -> Path:
    path = tmp_path / "fake.toml"
    path.write_text(VALID_TEXT)
    return path


def test_an_interrupted_plot_leaves_the_old_png_whole(
    cli: CliRunner, profile_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    matplotlib_figure = pytest.importorskip("matplotlib.figure")
    png = tmp_path / "plot.png"
    png.write_bytes(b"the old plot")

    def write_half_then_interrupt(self: object, target: object, **kwargs: object) -> None:
        if isinstance(target, (str, os.PathLike)):
            Path(target).write_bytes(b"\x89PNG half")
        else:
            target.write(b"\x89PNG half")
        raise KeyboardInterrupt

    monkeypatch.setattr(matplotlib_figure.Figure, "savefig", write_half_then_interrupt)
    result = cli.invoke(app, ["profile", "plot", str(profile_file), "-o", str(png)])
    assert result.exit_code != 0
    assert png.read_bytes() == b"the old plot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fake.toml", "plot.png", "profiles"]


def test_plot_to_a_fifo_or_a_folder_is_a_clear_error(cli: CliRunner, profile_file: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    fifo, folder = tmp_path / "fifo.png", tmp_path / "folder.png"
    os.mkfifo(fifo)
    folder.mkdir()
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a writer would not block: it would write
    try:
        for target, kind in ((fifo, "a FIFO"), (folder, "a folder")):
            result = cli.invoke(app, ["profile", "plot", str(profile_file), "-o", str(target)])
            assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
            assert f"pie: cannot write {target}: {kind}, not a regular file" in result.output
        assert os.read(reader, 1) == b""  # nothing was written into it
    finally:
        os.close(reader)
    assert list(folder.iterdir()) == []


def test_plot_into_a_folder_it_cannot_make_is_a_clear_error(
    cli: CliRunner, profile_file: Path, tmp_path: Path
) -> None:
    pytest.importorskip("matplotlib")
    target = profile_file / "plot.png"  # under a regular file
    result = cli.invoke(app, ["profile", "plot", str(profile_file), "-o", str(target)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"pie: cannot write {target}: " in result.output


def test_plot_to_dash_writes_the_png_on_standard_output_and_no_file(
    cli: CliRunner, profile_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`-o -` is standard output, as to every Unix tool; it wrote a file named `-`. `-o ./-` names that file."""
    pytest.importorskip("matplotlib")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    result = cli.invoke(app, ["profile", "plot", str(profile_file), "-o", "-"])
    assert result.exit_code == 0, result.output
    assert result.stdout_bytes[:8] == b"\x89PNG\r\n\x1a\n" and b"wrote" not in result.stdout_bytes
    assert os.listdir(work) == []
    result = cli.invoke(app, ["profile", "plot", str(profile_file), "-o", "./-"])
    assert result.exit_code == 0 and "wrote ./-" in result.output, result.output
    assert (work / "-").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_to_dash_on_a_terminal_is_refused(profile_file: Path, tmp_path: Path) -> None:
    """A PNG's bytes on a terminal garble it: `-o -` there asks for a redirection or a file instead."""
    pytest.importorskip("matplotlib")
    leader, follower = os.openpty()
    try:
        done = subprocess.run([sys.executable, "-m", "pie", "profile", "plot", str(profile_file), "-o", "-"],
                              stdin=subprocess.DEVNULL, stdout=follower, stderr=subprocess.PIPE, cwd=tmp_path,
                              timeout=120)
    finally:
        os.close(follower)
        os.close(leader)
    assert done.returncode == 2 and b"-o -: a PNG on a terminal" in done.stderr, done.stderr
    assert b"Traceback" not in done.stderr and sorted(os.listdir(tmp_path)) == ["fake.toml"]


def test_tune_to_dash_is_a_usage_error_before_tuning(
    cli: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tune resumes into its profile's file and keeps its measurements beside it: `-` cannot be that file, and
    is not taken as a file named `-` either (it was)."""
    monkeypatch.chdir(tmp_path)
    result = cli.invoke(app, ["tune", "--engine", "cpu", "--budget", "2", "-o", "-"])
    assert result.exit_code == 2, result.output
    assert "-o -: a tune writes its profile to a file" in result.output and "tuning" not in result.output
    assert sorted(os.listdir(tmp_path)) == ["profiles"]


def test_unknown_profile_is_a_clear_error(cli: CliRunner) -> None:
    result = cli.invoke(app, ["profile", "export", "nobody"])
    assert result.exit_code == 1 and "no profile named 'nobody'" in result.output


def test_interrupted_tune_resumes(cli: CliRunner, profile_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pie.profiles.tuner import Tuner

    measure = Tuner._measure
    calls = []

    def measure_then_interrupt(self: Tuner, *args: object, **kwargs: object) -> object:
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return measure(self, *args, **kwargs)

    monkeypatch.setattr(Tuner, "_measure", measure_then_interrupt)
    command = ["tune", "--engine", "cpu", "--name", "resumed", "--budget"]
    result = cli.invoke(app, [*command, "60"])
    assert result.exit_code == 130, result.output
    partial = profile_dir / "resumed.partial.json"
    assert "interrupted: 2 measurement(s) kept" in result.output and partial.is_file()
    assert not (profile_dir / "resumed.toml").exists()

    monkeypatch.setattr(Tuner, "_measure", measure)
    result = cli.invoke(app, [*command, "2"])  # the budget is per run; it does not make the runs differ
    assert result.exit_code == 0, result.output
    assert "resuming: 2 measurement(s) kept from an interrupted run" in result.output
    assert parse_profile((profile_dir / "resumed.toml").read_bytes()).name == "resumed"
    assert not partial.exists()


def test_a_bad_name_is_refused_before_tuning_and_list_says_each_rejection_once(
    cli: CliRunner, profile_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in ("a b", "../evil"):
        result = cli.invoke(app, ["tune", "--engine", "cpu", "--budget", "600", "--name", name])
        assert result.exit_code == 2 and f"--name {name!r}: a profile's name is" in result.output, result.output
        assert "tuning" not in result.output, "refused before any measurement"
    result = cli.invoke(app, ["tune", "--engine", "cpu", "--budget", "600", "-o", str(tmp_path)])
    assert result.exit_code == 1 and f"-o {tmp_path} is a folder" in result.output, result.output
    assert "tuning" not in result.output, "a folder was found out only once the budget was spent"
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "bad"\nschema = 99\n')
    monkeypatch.setenv("PIE_PROFILE_PATH", str(bad))
    with caplog.at_level(logging.WARNING, logger="pie.profiles"):
        listed = cli.invoke(app, ["profile", "list"])
    assert listed.exit_code == 0 and listed.output.count("schema version 99") == 1, listed.output
    assert not [r for r in caplog.records if "schema version 99" in r.getMessage()], "its row says it; no warning too"


def test_a_target_or_partial_file_that_is_not_a_regular_file_is_refused_before_tuning(
    cli: CliRunner, profile_dir: Path, tmp_path: Path
) -> None:
    """`-o /dev/null` as root once deleted /dev/null and left a profile in its place (written beside it, then
    renamed over it), with its partial file in /dev. A FIFO stands in for the device here."""
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    result = cli.invoke(app, ["tune", "--engine", "cpu", "--budget", "2", "-o", str(fifo)])
    assert result.exit_code == 1 and f"-o {fifo} is a FIFO, not a regular file" in result.output, result.output
    assert "tuning" not in result.output and stat.S_ISFIFO(os.stat(fifo).st_mode)
    partial = profile_dir / "mine.partial.json"
    partial.symlink_to(os.devnull)
    result = cli.invoke(app, ["tune", "--engine", "cpu", "--budget", "2", "--name", "mine"])
    assert result.exit_code == 1, result.output
    assert f"{partial}, where an interrupted tune's measurements are kept, is a character device" in result.output
    assert "tuning" not in result.output and os.readlink(partial) == os.devnull
    assert sorted(os.listdir(tmp_path)) == ["fifo.toml", "profiles"] and os.listdir(profile_dir) == [partial.name]


def test_a_tune_writes_through_a_temporary_file_of_its_own(cli: CliRunner, profile_dir: Path) -> None:
    """The temporary file's name was fixed (`mine.toml.tmp`): another tune's, or a folder of that name,
    stopped the write with a message naming the profile instead of what failed."""
    (profile_dir / "mine.toml.tmp").mkdir()
    result = cli.invoke(app, ["tune", "--engine", "cpu", "--budget", "2", "--name", "mine"])
    assert result.exit_code == 0, result.output
    assert parse_profile((profile_dir / "mine.toml").read_bytes()).name == "mine"
    assert sorted(os.listdir(profile_dir)) == ["mine.toml", "mine.toml.tmp"], "a temporary or partial file was left"


def test_a_failed_write_names_the_file_it_failed_on(
    cli: CliRunner, profile_dir: Path, monkeypatch: pytest.MonkeyPatch, one_row_cells: None
) -> None:
    from pie.profiles import cli as profiles_cli

    temporary = profile_dir / ".mine.toml.1a2b3c.tmp"

    def disk_full(path: Path, data: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(temporary))  # as write_atomically says it

    monkeypatch.setattr(profiles_cli, "write_atomically", disk_full)
    result = cli.invoke(app, ["tune", "--engine", "cpu", "--budget", "600", "--name", "mine"])
    assert result.exit_code == 1
    target = profile_dir / "mine.toml"
    assert f"cannot write {target}: No space left on device: {temporary}" in result.output, result.output
    assert "the measurements stay in" in result.output and (profile_dir / "mine.partial.json").is_file()
    # Where the budget held no whole cell, no measurement stays anywhere, and none is said to.
    (profile_dir / "mine.partial.json").unlink()
    result = cli.invoke(app, ["tune", "--engine", "cpu", "--budget", "0.001", "--name", "mine"])
    assert result.exit_code == 1 and "No space left on device" in result.output, result.output
    assert "the measurements stay in" not in result.output and not (profile_dir / "mine.partial.json").exists()


def test_a_setting_that_names_no_engine_is_an_error_not_a_crash(cli: CliRunner) -> None:
    """`pie profile list` (and export, diff, plot) let the registry's error out as an internal error."""
    for command in (["profile", "list"], ["profile", "export", "mine"], ["profile", "diff", "a", "b"]):
        result = cli.invoke(app, command, env={"PIE_DISABLE_PLUGIN_AUTOLOAD": "abc"})
        assert result.exit_code == 1 and "PIE_DISABLE_PLUGIN_AUTOLOAD is 'abc'" in result.output, result.output


def test_a_tune_interrupted_while_keeping_a_measurement_counts_only_those_kept(
    cli: CliRunner, profile_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C while the partial file was being written said one measurement more was kept than the file held: the
    cell whose save it cut short."""
    from pie.profiles import tuner

    write = tuner.write_atomically
    saves = []

    def write_then_interrupt(path: Path, data: str) -> None:
        saves.append(path)
        if len(saves) == 3:
            raise KeyboardInterrupt
        write(path, data)

    monkeypatch.setattr(tuner, "write_atomically", write_then_interrupt)
    result = cli.invoke(app, ["tune", "--engine", "cpu", "--name", "cut", "--budget", "60"])
    assert result.exit_code == 130, result.output
    cells = json.loads((profile_dir / "cut.partial.json").read_text())["cells"]
    assert len(cells) == 2 and "interrupted: 2 measurement(s) kept" in result.output, result.output


def test_a_tune_interrupted_before_its_first_measurement_names_no_file(
    cli: CliRunner, profile_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It said "0 measurement(s) kept in cut.partial.json; run the same command to resume": no such file was
    written, and there was nothing to resume."""
    from pie.profiles import tuner

    def interrupt(path: Path, data: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(tuner, "write_atomically", interrupt)
    result = cli.invoke(app, ["tune", "--engine", "cpu", "--name", "cut", "--budget", "60"])
    assert result.exit_code == 130, result.output
    assert "interrupted: before any measurement was kept" in result.output and "resume" not in result.output
    assert not (profile_dir / "cut.partial.json").exists()


@pytest.mark.parametrize("variant", ["rows", "native"])
def test_a_variant_that_fails_to_compile_is_a_note_and_a_default_that_fails_an_error(
    cli: CliRunner, profile_dir: Path, monkeypatch: pytest.MonkeyPatch, variant: str, one_row_cells: None
) -> None:
    """Either was an internal error of pie's (exit 70 from `pie`), naming neither the engine nor the kernel."""
    from pie_engine_cpu import plugin

    compile_kernel = plugin.pie_compile_kernel

    @plugin.hookimpl
    def pie_compile_kernel(device, request):
        if request.variant == variant:
            raise RuntimeError("no compiler here")
        return compile_kernel(device, request)

    monkeypatch.setattr(plugin, "pie_compile_kernel", pie_compile_kernel)
    # The default's failure ends the tune at once.
    result = cli.invoke(app, ["tune", "--engine", "cpu", "--budget", "600", "--name", "mine"])
    failure = f"engine 'cpu': compiling kernel embedding[{variant}] failed: RuntimeError: no compiler here"
    if variant == "native":  # the CPU engine's default variant
        assert result.exit_code == 1 and f"pie: {failure}" in result.output, result.output
    else:
        assert result.exit_code == 0, result.output
        assert "note: engine 'cpu': compiling kernel " in result.output, result.output
        assert "[rows] failed: RuntimeError: no compiler here; that variant is not measured" in result.output
        assert (profile_dir / "mine.toml").is_file()


def test_a_budget_past_any_clock_is_refused_before_tuning(cli: CliRunner) -> None:
    """--budget 1e308 passed the check (finite, above 0) and ended the tune as an internal error (OverflowError)."""
    result = cli.invoke(app, ["tune", "--engine", "cpu", "--name", "mine", "--budget", "1e308"])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output  # a usage error
    assert "--budget must be a number of seconds above 0 and at most 1e+07" in result.output
    assert "tuning" not in result.output


def _with_buckets_at_more_rows(text: str) -> str:
    """A tuned profile's text with each bucket copied to 2 and 4 times its rows where it has none there (as a longer
    tune would have measured)."""
    from dataclasses import replace

    from pie.profiles import dump_profile

    def widened(buckets: tuple[Any, ...]) -> tuple[Any, ...]:
        every = {b.anchors: b for b in buckets}
        for bucket in buckets:
            for copy in (replace(bucket, rows=bucket.rows * k) for k in (2, 4)):
                every.setdefault(copy.anchors, copy)
        return tuple(sorted(every.values(), key=lambda b: (b.size, b.min_kv_tokens, b.rows)))

    profile = parse_profile(text)
    kernels = tuple(replace(tuning, buckets=widened(tuning.buckets)) for tuning in profile.kernels)
    return dump_profile(replace(profile, kernels=kernels))


def _anchors(path: Path) -> set[tuple[str, tuple[int, int, int]]]:
    return {(t.kernel, b.anchors) for t in parse_profile(path.read_bytes()).kernels for b in t.buckets}


def test_a_tune_cut_short_keeps_what_the_profile_held(cli: CliRunner, profile_dir: Path, one_row_cells: None) -> None:
    """A second tune replaced the profile with its own measurements alone: one whose budget ran out after one cell
    dropped every bucket an earlier, longer tune had measured. --restart still measures from scratch."""
    result = cli.invoke(app, ["tune", "--engine", "cpu", "--budget", "600", "--name", "mine"])
    assert result.exit_code == 0, result.output
    tuned = profile_dir / "mine.toml"
    tuned.write_text(_with_buckets_at_more_rows(tuned.read_text()))
    earlier = _anchors(tuned)
    assert earlier, "the earlier tune measured no bucket"
    command = ["tune", "--engine", "cpu", "--name", "mine", "--budget", "0.001"]
    result = cli.invoke(app, command)
    assert result.exit_code == 0, result.output
    assert "bucket(s) of the earlier profile that this run did not measure" in result.output
    assert earlier <= _anchors(tuned)
    result = cli.invoke(app, [*command, "--restart"])
    assert result.exit_code == 0, result.output
    assert "earlier profile" not in result.output and not earlier <= _anchors(tuned)


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("this is my notes file\n", "not valid TOML"),
        (VALID_TEXT.replace("margin = 0.03", "margin = nan"), "tune.margin: nan is not a finite number"),
        (VALID_TEXT, "holds profile 'fake-acme', measured with engine 'fake' on Acme Fake Accelerator 9000"),
    ],
    ids=["not-a-profile", "damaged", "another-device"],
)
def test_a_tune_never_replaces_a_file_that_is_not_its_own_profile(
    cli: CliRunner, profile_dir: Path, text: str, needle: str
) -> None:
    """`-o notes.txt`, a hand edit gone wrong, or a profile from another machine under the name: the tune measured,
    then wrote over it, and what the file held was lost."""
    target = profile_dir / "mine.toml"
    target.write_text(text)
    result = cli.invoke(app, ["tune", "--engine", "cpu", "--name", "mine", "--budget", "2"])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"pie: {target}" in result.output and needle in result.output, result.output
    assert "give another --name or -o" in result.output and "tuning" not in result.output
    assert target.read_text() == text and os.listdir(profile_dir) == ["mine.toml"]


def test_a_profile_that_cannot_be_written_there_is_refused_before_tuning(cli: CliRunner, profile_file: Path) -> None:
    """A folder that cannot be made (under a regular file) was found out once the first cell was measured."""
    target = profile_file / "mine.toml"
    result = cli.invoke(app, ["tune", "--engine", "cpu", "--budget", "2", "-o", str(target)])
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"pie: cannot write {target}: Not a directory: {profile_file}" in result.output
    assert "tuning" not in result.output


@pytest.mark.parametrize(
    ("name", "needle"),
    [
        ("a" * 5000, "cannot read: File name too long"),
        ("..", "..: cannot read: not a regular file (a folder)"),
        ("no/such.toml", "no/such.toml: cannot read: No such file or directory"),
        ("", "no profile named ''"),
    ],
    ids=["too-long", "folder", "no-file", "empty"],
)
def test_a_name_that_is_no_profile_is_a_clear_error(cli: CliRunner, name: str, needle: str) -> None:
    """A name too long for a path ended `pie profile export` as an internal error (OSError from is_file), and a
    path to a folder said there was no profile of that name."""
    for command in (["profile", "export", name], ["profile", "diff", name, name]):
        result = cli.invoke(app, command)
        assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
        assert needle in result.output, result.output


def test_a_forced_profile_too_long_for_a_path_is_a_clear_error(cli: CliRunner) -> None:
    """PIE_PROFILE of a name too long for a path ended `pie profile show` and `list` as internal errors."""
    result = cli.invoke(app, ["profile", "show", "--engine", "cpu"], env={"PIE_PROFILE": "a" * 5000})
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert "PIE_PROFILE=aaa" in result.output and "cannot read: File name too long" in result.output
    result = cli.invoke(app, ["profile", "list"], env={"PIE_PROFILE": "a" * 5000})
    assert result.exit_code == 0, result.output


def test_a_tune_of_another_mode_leaves_an_interrupted_tunes_measurements_alone(
    cli: CliRunner, profile_dir: Path
) -> None:
    """A quick tune ignored the partial file of an interrupted full tune of the same profile and wrote over it."""
    from pie.plugins import EngineRegistry
    from pie.profiles.tuner import Tuner, TuneSettings

    partial = profile_dir / "mine.partial.json"
    key = Tuner(EngineRegistry().select("cpu")[0], TuneSettings.full(), partial)._run_key()
    partial.write_text(json.dumps({"format": 1, "key": key, "seconds": 3600.0, "cells": {}}))
    saved = partial.read_text()
    command = ["tune", "--engine", "cpu", "--name", "mine", "--budget", "2"]
    result = cli.invoke(app, command)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert f"pie: {partial} holds 0 measurement(s) of an interrupted full tune" in result.output
    assert "run that tune again to finish it, or give --restart to drop them" in result.output
    assert "tuning" not in result.output and partial.read_text() == saved
    result = cli.invoke(app, [*command, "--restart"])
    assert result.exit_code == 0, result.output
    assert not partial.exists()


def test_a_profile_of_yours_named_as_a_shipped_one_leaves_the_shipped_one_reachable(
    cli: CliRunner, profile_dir: Path
) -> None:
    """`pie tune` names its profile as the engine's shipped one for the device: `export`/`diff NAME` then gave yours,
    and the shipped one, which has no file to name, could not be compared with it."""
    from dataclasses import replace

    from pie.plugins import EngineRegistry
    from pie.profiles.lookup import engine_candidates
    from pie.profiles.writer import dump_profile

    shipped = next(c.profile for c in engine_candidates(EngineRegistry().engine("cpu")) if c.profile is not None)
    mine = replace(shipped, engine_version=f"{shipped.engine_version}+mine")
    (profile_dir / f"{shipped.name}.toml").write_text(dump_profile(mine))

    plain = cli.invoke(app, ["profile", "export", shipped.name])
    assert plain.exit_code == 0 and parse_profile(plain.stdout) == mine, plain.output
    assert f"engine:{shipped.name} chooses yours or the shipped one" in plain.stderr
    for prefix, expected in (("engine", shipped), ("user", mine)):
        chosen = cli.invoke(app, ["profile", "export", f"{prefix}:{shipped.name}"])
        assert chosen.exit_code == 0 and parse_profile(chosen.stdout) == expected, chosen.output
        assert "is also in" not in chosen.stderr
    compared = cli.invoke(app, ["profile", "diff", f"user:{shipped.name}", f"engine:{shipped.name}"])
    assert compared.exit_code == 0 and "+mine" in compared.stdout, compared.output
    missing = cli.invoke(app, ["profile", "export", "user:no-such-profile"])
    assert missing.exit_code == 1 and "no profile of yours named 'no-such-profile'" in missing.output
