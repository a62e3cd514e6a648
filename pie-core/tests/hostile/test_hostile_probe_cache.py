"""A hostile probe cache: damaged files, and remembered failures that no longer hold (the user installed
the driver, or asks for a fresh look)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import fake_engines
import pytest
from pie_process import assert_ok, run_pie

NEEDS_DRIVER = fake_engines.WORKING.replace(
    "def pie_probe_devices():\n", "def pie_probe_devices():\n    import acme_driver  # noqa: F401\n"
)
"""An engine whose device probe needs the acme_driver module: broken until it is installed."""
NEEDS_SYSTEM_DRIVER = fake_engines.WORKING.replace(
    "def pie_probe_devices():\n",
    "def pie_probe_devices():\n    import os\n"
    "    if not os.path.exists({marker!r}):\n        raise RuntimeError('libacme.so.1 is not installed')\n",
)
"""An engine whose probe needs a system library (a file outside every Python folder)."""


@pytest.fixture
def site_env(install_engine: Callable[..., None], tmp_path: Path, pie_env: dict[str, str]) -> dict[str, str]:
    install_engine("placeholder", fake_engines.WORKING)  # creates tmp_path / "site"
    path = os.pathsep.join(p for p in (str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")) if p)
    return {**pie_env, "PYTHONPATH": path, "PIE_ENGINES": "acme,cpu"}


@pytest.mark.parametrize(
    "content",
    [b"", b"{", b'{"format": 2, "probes": {"x": {"at": "yesterday"', b'{"format": 1, "probes": []}'],
    ids=["empty", "brace", "truncated", "old-format"],
)
def test_a_damaged_probe_cache_is_ignored_and_rewritten(pie_env: dict[str, str], content: bytes) -> None:
    path = Path(pie_env["PIE_PROBE_CACHE"])
    path.write_bytes(content)
    assert_ok(run_pie("engines", env=pie_env), "chosen: cpu on cpu:0")
    assert "cpu" in path.read_text() and json.loads(path.read_text()), "the cache was not rewritten"


@pytest.mark.parametrize(
    "content", [b"\xff\xfe\x00", b"[]", b"null", b"7", b"export PATH=$HOME/bin:$PATH\n"],
    ids=["binary", "list", "null", "number", "shell"],
)
def test_a_file_that_is_no_probe_cache_is_left_alone(pie_env: dict[str, str], content: bytes) -> None:
    """PIE_PROBE_CACHE naming another file by mistake (~/.bashrc; /bin/ls as root, in a review) had it replaced
    with probes: a file that does not begin as the cache's own is never written over, and pie says so."""
    path = Path(pie_env["PIE_PROBE_CACHE"])
    path.write_bytes(content)
    result = run_pie("engines", env=pie_env)
    assert_ok(result, "chosen: cpu on cpu:0")
    assert path.read_bytes() == content, "the file was written over"
    assert "it is left alone" in result.stderr, result


def _damage(value: object) -> object:
    """Every probe record (an object with devices) with strings for its numbers and a nonsense device."""
    if isinstance(value, dict):
        if "devices" in value:
            return {k: "yesterday" if isinstance(v, (int, float)) else v for k, v in value.items()} | {
                "devices": [{"engine": 1}]
            }
        return {k: _damage(v) for k, v in value.items()}
    return value


def test_a_record_with_the_wrong_types_is_probed_again(pie_env: dict[str, str]) -> None:
    path = Path(pie_env["PIE_PROBE_CACHE"])
    assert_ok(run_pie("engines", env=pie_env))
    damaged = _damage(json.loads(path.read_text()))
    assert "yesterday" in json.dumps(damaged)
    path.write_text(json.dumps(damaged))
    assert_ok(run_pie("engines", env=pie_env), "chosen: cpu on cpu:0")


def test_installing_the_missing_driver_package_is_seen_at_once(site_env: dict[str, str], tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "fake_pie_engine_acme.py").write_text(NEEDS_DRIVER.format(name="acme", priority=10))
    info = site / "pie_engine_acme-9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pie-engine-acme\nVersion: 9.9\n")
    (info / "entry_points.txt").write_text("[pie.engines]\nacme = fake_pie_engine_acme\n")
    assert_ok(run_pie("engines", env=site_env), "No module named 'acme_driver'")
    (site / "acme_driver.py").write_text("")  # what `pip install acme-driver` does
    (site / "acme_driver-1.0.dist-info").mkdir()
    result = run_pie("engines", env=site_env)
    assert_ok(result, "acme:0 Fake Device", "chosen: acme on acme:0")
    assert "acme_driver" not in result.output


def test_a_remembered_failure_says_so_and_refresh_forgets_it_for_every_pie_engines(
    site_env: dict[str, str], tmp_path: Path
) -> None:
    marker = tmp_path / "libacme.so.1"
    site = tmp_path / "site"
    (site / "fake_pie_engine_acme.py").write_text(NEEDS_SYSTEM_DRIVER.format(name="acme", priority=10, marker=str(marker)))
    info = site / "pie_engine_acme-9.9.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pie-engine-acme\nVersion: 9.9\n")
    (info / "entry_points.txt").write_text("[pie.engines]\nacme = fake_pie_engine_acme\n")
    assert_ok(run_pie("engines", env=site_env), "libacme.so.1 is not installed")
    marker.write_text("")  # the driver is installed outside every Python folder
    remembered = run_pie("engines", env=site_env)
    assert_ok(remembered, "libacme.so.1 is not installed", "remembered from a probe", "pie engines --refresh")
    # --refresh under another PIE_ENGINES value forgets this one's probes too
    assert_ok(run_pie("engines", "--refresh", env={**site_env, "PIE_ENGINES": ""}), "acme:0 Fake Device")
    result = run_pie("engines", env=site_env)
    assert_ok(result, "acme:0 Fake Device", "chosen: acme on acme:0 (first of PIE_ENGINES=acme,cpu)")
    assert "not installed" not in result.output
