"""Hostile model stores: damaged entries, dead and concurrent pulls, a store path that is no folder.

The `pie` started here knows one extra model, `tiny`, which it pulls with the real pip from a local
wheel (no network): `fake_known_model/sitecustomize.py` registers it in the child from
PIE_TEST_KNOWN_MODEL, and PIP_NO_INDEX / PIP_FIND_LINKS point pip at the wheel.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import threading
import time
import zipfile
from pathlib import Path

import pytest

from pie.testing.models import make_gguf_model
from pie_process import PIE, PieResult, assert_ok, assert_user_error, run_pie

MAX_SECONDS = 120
MEMBER = "pie_fake_model/Tiny.F32.gguf"


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    """A folder holding the wheel of `tiny`, and the model file inside it."""
    folder = tmp_path_factory.mktemp("wheelhouse")
    content = make_gguf_model(folder / "tiny.gguf", "F32").read_bytes()
    (folder / "tiny.gguf").unlink()
    with zipfile.ZipFile(folder / "pie_fake_model-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr(MEMBER, content)
        wheel.writestr("pie_fake_model-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: pie-fake-model\nVersion: 1.0\n")
        wheel.writestr("pie_fake_model-1.0.dist-info/WHEEL",
                       "Wheel-Version: 1.0\nGenerator: pie-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        wheel.writestr("pie_fake_model-1.0.dist-info/RECORD", "")
    return folder, content


@pytest.fixture
def store_env(pie_env: dict[str, str], wheelhouse: tuple[Path, bytes]) -> dict[str, str]:
    folder, content = wheelhouse
    known = {"name": "tiny", "package": "pie-fake-model", "version": "1.0", "member": MEMBER,
             "sha256": hashlib.sha256(content).hexdigest(), "size": len(content)}
    site = str(Path(__file__).with_name("fake_known_model"))
    return {**pie_env, "PIE_TEST_KNOWN_MODEL": json.dumps(known), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(folder),
            "PYTHONPATH": os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))}


def _model_file(env: dict[str, str]) -> Path:
    return Path(env["PIE_MODEL_DIR"]) / "tiny" / "Tiny.F32.gguf"


def _pull(env: dict[str, str], *needles: str) -> PieResult:
    result = run_pie("model", "pull", "tiny", env=env, timeout=MAX_SECONDS * 2)
    assert_ok(result, "tiny", *needles, max_seconds=MAX_SECONDS)
    return result


def test_a_truncated_model_is_reported_and_repaired(store_env: dict[str, str], wheelhouse: tuple[Path, bytes]) -> None:
    _pull(store_env)
    path = _model_file(store_env)
    path.write_bytes(wheelhouse[1][: len(wheelhouse[1]) // 2])
    assert_ok(run_pie("model", "list", env=store_env), "tiny", "DAMAGED", f"{path} is", "expected",
              "pie model pull tiny")
    assert_user_error(run_pie("model", "verify", env=store_env), "tiny: DAMAGED", str(path))
    _pull(store_env, "is damaged", "pulling it again")
    assert path.read_bytes() == wheelhouse[1]
    assert_ok(run_pie("model", "verify", "tiny", env=store_env), "tiny: ok")


def test_a_corrupted_model_of_the_right_size_is_found_by_its_checksum(store_env: dict[str, str],
                                                                      wheelhouse: tuple[Path, bytes]) -> None:
    _pull(store_env)
    path = _model_file(store_env)
    with open(path, "r+b") as file:
        file.seek(len(wheelhouse[1]) // 2)
        file.write(b"\xff" * 64)
    assert_user_error(run_pie("model", "verify", env=store_env), "tiny: DAMAGED", "has sha256")
    _pull(store_env, "has sha256", "pulling it again")
    assert path.read_bytes() == wheelhouse[1]


def test_run_fetches_a_truncated_known_model_again(store_env: dict[str, str], wheelhouse: tuple[Path, bytes]) -> None:
    _pull(store_env)
    _model_file(store_env).write_bytes(b"GGUF")
    result = run_pie("run", "--model", "tiny", "--max-tokens", "2", "hi", env=store_env, timeout=MAX_SECONDS * 2)
    assert_ok(result, "is damaged", "pulling it again", max_seconds=MAX_SECONDS)
    assert _model_file(store_env).read_bytes() == wheelhouse[1]


def test_an_imported_copy_is_checked_too(store_env: dict[str, str], tmp_path: Path) -> None:
    source = make_gguf_model(tmp_path / "mine.gguf", "F32")
    assert_ok(run_pie("model", "import", str(source), env=store_env), "mine")
    stored = Path(store_env["PIE_MODEL_DIR"]) / "mine" / "mine.gguf"
    stored.write_bytes(stored.read_bytes()[:-100])
    assert_user_error(run_pie("run", "--model", "mine", "hi", env=store_env), "'mine' in the store is damaged",
                      "bytes, expected", "import it again")
    assert_user_error(run_pie("model", "verify", "mine", env=store_env), "mine: DAMAGED",
                      "`pie model import PATH --name mine --force` imports it again, `pie model remove mine` removes "
                      "it")


def test_a_killed_pull_leaves_nothing_behind(store_env: dict[str, str]) -> None:
    store = Path(store_env["PIE_MODEL_DIR"])
    environment = {**os.environ, **store_env}
    pull = subprocess.Popen([PIE, "model", "pull", "tiny"], env=environment, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + MAX_SECONDS
    while not (store.is_dir() and any(p.name.startswith(".pull-") for p in store.iterdir())):
        assert pull.poll() is None and time.monotonic() < deadline, "the pull ended before it could be killed"
        time.sleep(0.01)
    os.killpg(pull.pid, signal.SIGKILL)
    pull.wait(timeout=30)
    assert [p.name for p in store.iterdir() if p.name.startswith(".pull-")], "the kill left nothing to clean"
    _pull(store_env)
    assert sorted(p.name for p in store.iterdir()) == [".lock", "tiny"]
    assert_ok(run_pie("model", "verify", env=store_env), "tiny: ok")


def test_concurrent_pulls_do_not_corrupt_each_other(store_env: dict[str, str], wheelhouse: tuple[Path, bytes]) -> None:
    """Forced pulls each replace the entry: without a lock they removed and renamed over each other."""
    results: list[PieResult] = []

    def pull(*force: str) -> None:
        results.append(run_pie("model", "pull", "tiny", *force, env=store_env, timeout=MAX_SECONDS * 2))

    threads = [threading.Thread(target=pull, args=("--force",) if i % 2 else ()) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        assert_ok(result, "tiny", max_seconds=MAX_SECONDS)
    assert _model_file(store_env).read_bytes() == wheelhouse[1]
    assert sorted(p.name for p in Path(store_env["PIE_MODEL_DIR"]).iterdir()) == [".lock", "tiny"]


@pytest.mark.parametrize("args", [("model", "list"), ("model", "pull", "tiny"), ("model", "verify"), ("run", "hi")],
                         ids=" ".join)
def test_a_store_path_that_is_a_file(store_env: dict[str, str], tmp_path: Path, args: tuple[str, ...]) -> None:
    (tmp_path / "not-a-folder").write_text("x")
    env = {**store_env, "PIE_MODEL_DIR": str(tmp_path / "not-a-folder")}
    assert_user_error(run_pie(*args, env=env), f"the model store {tmp_path / 'not-a-folder'} (PIE_MODEL_DIR) is not a folder",
                      max_seconds=MAX_SECONDS)


@pytest.mark.parametrize("args", [("model", "pull", "tiny"), ("model", "import", "{model}")], ids=" ".join)
def test_a_store_that_cannot_be_created(store_env: dict[str, str], tmp_path: Path, args: tuple[str, ...]) -> None:
    model = make_gguf_model(tmp_path / "mine.gguf", "F32")
    (tmp_path / "a-file").write_text("x")
    for store in (tmp_path / "a-file" / "models", Path("/sys/pie-models")):  # /sys refuses even root
        env = {**store_env, "PIE_MODEL_DIR": str(store)}
        result = run_pie(*(arg.format(model=model) for arg in args), env=env)
        assert_user_error(result, f"the model store {store} (PIE_MODEL_DIR) cannot be created", max_seconds=MAX_SECONDS)


def test_a_store_that_is_not_writable(store_env: dict[str, str], tmp_path: Path) -> None:
    store = tmp_path / "read-only"
    store.mkdir(mode=0o555)
    if os.geteuid() == 0:  # root writes into any mode; a folder of /proc it cannot
        store = Path("/proc/self/fdinfo")
    env = {**store_env, "PIE_MODEL_DIR": str(store)}
    assert_user_error(run_pie("model", "pull", "tiny", env=env), f"the model store {store} (PIE_MODEL_DIR) is not writable")


def test_verify_an_unknown_model(store_env: dict[str, str]) -> None:
    assert_user_error(run_pie("model", "verify", "nope", env=store_env), "no model named 'nope'")


def test_remove_takes_a_damaged_model_out_whole(store_env: dict[str, str]) -> None:
    """There was no `pie model remove`: a model was deleted by hand, from a folder the user had to find."""
    _pull(store_env)
    _model_file(store_env).write_bytes(b"GGUF")
    result = run_pie("model", "remove", "tinny", "tiny", env=store_env)
    assert_user_error(result, "pie: no model named 'tinny'", "; nearest: tiny", "tiny: removed (0.0 MB freed)")
    assert result.returncode == 1  # one of the two failed
    assert sorted(p.name for p in Path(store_env["PIE_MODEL_DIR"]).iterdir()) == [".lock"]
    assert_ok(run_pie("model", "list", env=store_env), "no models in")


def test_import_force_keeps_the_old_model_when_the_new_one_fails(store_env: dict[str, str], tmp_path: Path) -> None:
    mine = make_gguf_model(tmp_path / "mine.gguf", "F32")
    assert_ok(run_pie("model", "import", str(mine), env=store_env), "mine")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(60))
    result = run_pie("model", "import", str(broken), "--name", "mine", "--force", env=store_env)
    assert_user_error(result, "broken.gguf")
    assert_ok(run_pie("model", "verify", "mine", env=store_env), "mine: ok")
    other = make_gguf_model(tmp_path / "other.gguf", "F32", seed=1)
    assert_user_error(run_pie("model", "import", str(other), "--name", "mine", env=store_env), "pass --force")
    assert_ok(run_pie("model", "import", str(other), "--name", "mine", "--force", env=store_env), "other.gguf")
    assert (Path(store_env["PIE_MODEL_DIR"]) / "mine" / "other.gguf").read_bytes() == other.read_bytes()
    assert_ok(run_pie("model", "verify", "mine", env=store_env), "mine: ok")
