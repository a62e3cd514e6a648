"""Damaged profiles, with the real `pie` in child processes: a profile folder full of files that are not
profiles, each a warning naming the file, and `pie run` goes on.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pie_process import assert_ok, run_pie
from pie.testing.models import make_gguf_model

pytest.importorskip("pie_engine_cpu")

WAIT_S = 90.0
"""The longest a `pie` command may take."""


@pytest.fixture
def env(pie_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """`pie_env` with a profile folder of its own."""
    return {**pie_env, "PIE_PROFILE_PATH": str(tmp_path / "profiles"), "PIE_PROFILE": "", "PYTHONUNBUFFERED": "1",
            "COLUMNS": "200"}


@pytest.fixture
def profiles(env: dict[str, str]) -> Path:
    return Path(env["PIE_PROFILE_PATH"])


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
