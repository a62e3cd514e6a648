"""The test plugin that gives each pytest-xdist worker user state of its own (pie.testing.user_folders)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("xdist")

OWN = ("PIE_DEVICE_CLAIMS_DIR", "XDG_CONFIG_HOME", "XDG_STATE_HOME")

RECORD = textwrap.dedent(
    """
    import json, os
    from pathlib import Path

    from pie.device_use import claims_dir
    from pie.model.store import store_dir


    def test_record():
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        record = {{
            "own": {{name: os.environ[name] for name in {own!r}}},
            "cache": os.environ.get("XDG_CACHE_HOME"),
            "claims": str(claims_dir()),
            "store": str(store_dir()),
        }}
        Path({out!r}, f"{{worker}}-{name}.json").write_text(json.dumps(record))
    """
)


def _run(tmp_path: Path, env: dict[str, str], *xdist: str) -> list[dict]:
    """Run two test files under the plugin (and ``xdist``'s options); what each test saw."""
    tests, out = tmp_path / "tests", tmp_path / "out"
    tests.mkdir()
    out.mkdir()
    for name in ("first", "second"):
        (tests / f"test_{name}.py").write_text(RECORD.format(out=str(out), name=name, own=OWN))
    child = subprocess.run(
        [sys.executable, "-m", "pytest", str(tests), "-q", "-p", "no:cacheprovider", "-p", "pie.testing.user_folders",
         *xdist],
        env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert child.returncode == 0, child.stdout + child.stderr
    records = [json.loads(path.read_text()) for path in sorted(out.iterdir())]
    assert len(records) == 2
    return records


def _user_environment(user: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIE_", "XDG_", "PYTEST_"))}
    return {**env, **{f"XDG_{name.upper()}_HOME": str(user / name) for name in ("cache", "config", "state")}}


def test_each_worker_has_claims_config_and_state_of_its_own_and_shares_the_cache(tmp_path: Path) -> None:
    user = tmp_path / "user"
    records = _run(tmp_path, _user_environment(user), "-n", "2", "--dist", "loadscope")

    first, second = (set(record["own"].values()) for record in records)
    assert first.isdisjoint(second), "two workers share a folder"
    assert not any(folder.startswith(str(user)) for folder in first | second), "a worker uses the user's own"
    for record in records:
        assert record["claims"] == record["own"]["PIE_DEVICE_CLAIMS_DIR"]
        assert record["cache"] == str(user / "cache"), "the cache folder (models, kernels, Mesa's shaders) is shared"
        assert record["store"] == str(user / "cache" / "pie" / "models")
        for folder in record["own"].values():
            assert not Path(folder).exists(), f"{folder} left behind"
    assert not user.exists(), "the user's own folders were written"


def test_without_xdist_the_process_has_folders_of_its_own(tmp_path: Path) -> None:
    user = tmp_path / "user"
    records = _run(tmp_path, _user_environment(user))
    assert records[0] == records[1]  # one process, both files
    assert not any(folder.startswith(str(user)) for folder in records[0]["own"].values())
    assert records[0]["cache"] == str(user / "cache")
    assert not Path(records[0]["claims"]).exists()
