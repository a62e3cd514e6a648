"""Hostile and unlucky runs of `pie tune` and damaged profiles, with the real `pie` in child processes.

Two tunes of one profile at once, a tune killed or interrupted midway, and a profile folder full of files that
are not profiles: each ends in one clear line or a warning naming the file, and nothing already measured is lost.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pie_process import PIE, assert_ok, assert_user_error, run_pie
from pie.profiles import parse_profile
from pie.testing.models import make_gguf_model

pytest.importorskip("pie_engine_cpu")

WAIT_S = 90.0
"""The longest a step waits for a tune (its start, its first cell, its end)."""


@pytest.fixture
def env(pie_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """`pie_env` with a profile folder of its own, and output written as it comes (a tune's progress is a sign)."""
    return {**pie_env, "PIE_PROFILE_PATH": str(tmp_path / "profiles"), "PIE_PROFILE": "", "PYTHONUNBUFFERED": "1",
            "COLUMNS": "200"}


@pytest.fixture
def profiles(env: dict[str, str]) -> Path:
    return Path(env["PIE_PROFILE_PATH"])


class Tune:
    """`pie tune --engine cpu ARGS` running in the background, in a session of its own, with its output in a file.

    Started as `run_pie` starts `pie`: without forking this process, and with a Ctrl-C acting even where this
    process was started with it ignored."""

    def __init__(self, env: dict[str, str], folder: Path, *args: str) -> None:
        self.out = folder / f"tune-{time.monotonic_ns()}.out"
        environment = {key: value for key, value in {**os.environ, **env}.items() if value != ""}
        descriptor = os.open(self.out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            self.pid = os.posix_spawn(
                PIE, [PIE, "tune", "--engine", "cpu", *args], environment,
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, descriptor, 1),
                    (os.POSIX_SPAWN_DUP2, descriptor, 2),
                ],
                setsid=True, setsigdef=(signal.SIGINT,),
            )
        finally:
            os.close(descriptor)
        self.returncode: int | None = None

    @property
    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait_for(self, sign: str | Path) -> None:
        """Until ``sign`` (text) is in its output, or (a path) exists; fails where it ends or takes too long."""
        deadline = time.monotonic() + WAIT_S
        while not (sign.exists() if isinstance(sign, Path) else sign in self.output):
            assert self.poll() is None, f"the tune ended before {sign}: {self.output}"
            assert time.monotonic() < deadline, f"no {sign} after {WAIT_S} s: {self.output}"
            time.sleep(0.05)

    def end(self) -> int:
        """Its exit status (negative: the signal that ended it), killed where it runs past WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.kill()

    def kill(self) -> int:
        if self.poll() is None:
            os.killpg(self.pid, signal.SIGKILL)
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        assert self.returncode is not None
        return self.returncode


@pytest.fixture
def background(env: dict[str, str], tmp_path: Path) -> Iterator[list[Tune]]:
    """Start tunes with ``Tune(env, tmp_path, ...)`` and append them here: any still running at the end is killed."""
    started: list[Tune] = []
    yield started
    for tune in started:
        tune.kill()


def test_a_second_tune_of_the_same_profile_is_refused_while_the_first_measures(
    env: dict[str, str], profiles: Path, tmp_path: Path, background: list[Tune]
) -> None:
    """Both ran: each overwrote the other's partial file after every cell, then the profile, so the later one's
    write dropped what the other had measured (and each timed its kernels beside the other's)."""
    first = Tune(env, tmp_path, "--name", "mine", "--budget", "600")  # stopped below, whatever the machine's load
    background.append(first)
    first.wait_for("tuning cpu:0")
    second = run_pie("tune", "--engine", "cpu", "--name", "mine", "--budget", "1", env=env, timeout=WAIT_S)
    assert_user_error(second, f"another `pie tune` (process {first.pid}) is measuring into "
                      f"{profiles / 'mine.toml'}", "tune another profile (--name, -o)")
    assert "tuning" not in second.output
    assert first.poll() is None, "the first tune ended before the second was refused"
    os.kill(first.pid, signal.SIGINT)
    assert first.end() == 130, first.output
    # The first's lock went with it: the next tune is not refused, and finishes the first's profile.
    assert_ok(run_pie("tune", "--engine", "cpu", "--name", "mine", "--budget", "1", env=env, timeout=WAIT_S))
    assert parse_profile((profiles / "mine.toml").read_bytes()).name == "mine"
    assert os.listdir(profiles) == ["mine.toml"], "a partial or lock file was left"


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM", "SIGKILL"])
def test_a_tune_stopped_midway_leaves_the_profile_whole_and_the_next_one_resumes(
    env: dict[str, str], profiles: Path, tmp_path: Path, background: list[Tune], how: str
) -> None:
    """A Ctrl-C ends it with 130 and says where its measurements are, a SIGTERM (`timeout`, a service manager) with
    143 and the same words (it died where it stood, its lock file left behind, silent); a SIGKILL can say nothing. Either way the profile is the
    one written before, the partial file is whole, and the next tune is not refused (the kernel dropped the lock) but
    resumes."""
    assert_ok(run_pie("tune", "--engine", "cpu", "--name", "mine", "--budget", "1", env=env, timeout=WAIT_S))
    profile = profiles / "mine.toml"
    before = profile.read_bytes()
    tune = Tune(env, tmp_path, "--name", "mine", "--budget", "30")
    background.append(tune)
    tune.wait_for(profiles / "mine.partial.json")  # a cell is measured
    if how != "SIGKILL":
        os.kill(tune.pid, getattr(signal, how))
        assert tune.end() == (130 if how == "SIGINT" else 143), tune.output
        stopped = "interrupted" if how == "SIGINT" else "terminated"
        assert f"{stopped}: " in tune.output and "measurement(s) kept in" in tune.output, tune.output
        assert f"{profile} is as it was" in tune.output and "Traceback" not in tune.output
        assert sorted(os.listdir(profiles)) == ["mine.partial.json", "mine.toml"], "the lock file was left"
    else:
        tune.kill()
    assert profile.read_bytes() == before
    again = run_pie("tune", "--engine", "cpu", "--name", "mine", "--budget", "1", env=env, timeout=WAIT_S)
    assert_ok(again, "resuming: ", "measurement(s) kept from an interrupted run", f"wrote {profile}")
    assert parse_profile(profile.read_bytes()).name == "mine"
    assert os.listdir(profiles) == ["mine.toml"], "a partial or lock file was left"


DAMAGED = {
    "syntax.toml": 'schema = 1\nname = "unterminated\n',
    "types.toml": 'schema = 1\nname = 7\n',
    "version.toml": "schema = 99\n",
    "binary.toml": "\x00\xff\xfe garbage",
    "empty.toml": "",
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_gguf_model(tmp_path_factory.mktemp("model") / "tiny.gguf", "F32"))


def test_damaged_profiles_never_stop_pie_run(env: dict[str, str], profiles: Path, model: str) -> None:
    """Every file of the folder that is not a profile is a warning naming it, and `pie run`, `pie profile list` and
    `pie profile show` go on with the others."""
    profiles.mkdir()
    for name, text in DAMAGED.items():
        (profiles / name).write_bytes(text.encode("latin-1"))
    (profiles / "huge.toml").write_bytes(b"#" * (5 << 20))
    (profiles / "folder.toml").mkdir()
    (profiles / "loop.toml").symlink_to("loop.toml")
    (profiles / "device.toml").symlink_to(os.devnull)
    os.mkfifo(profiles / "fifo.toml")
    result = run_pie("run", "--model", model, "--max-tokens", "2", "hi", env=env, timeout=WAIT_S)
    named = [str(profiles / name) for name in (*DAMAGED, "huge.toml", "folder.toml", "loop.toml", "device.toml",
                                                "fifo.toml")]
    assert_ok(result, *named)
    for command in (["profile", "list"], ["profile", "show", "--engine", "cpu"]):
        assert_ok(run_pie(*command, env=env, timeout=WAIT_S), *named)


def test_a_profile_path_no_file_system_takes_is_a_warning(env: dict[str, str], model: str) -> None:
    """A PIE_PROFILE_PATH entry too long for a path stopped `pie run` ("pie: [Errno 36] File name too long") and
    ended `pie profile list` as an internal error."""
    env = {**env, "PIE_PROFILE_PATH": "/" + "a" * 5000}
    result = run_pie("run", "--model", model, "--max-tokens", "2", "hi", env=env, timeout=WAIT_S)
    assert_ok(result, "cannot read: File name too long")
    assert_ok(run_pie("profile", "list", env=env, timeout=WAIT_S), "cannot read: File name too long")
