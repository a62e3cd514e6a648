"""The conformance kit itself: it must fail an engine for what a runtime cannot live without, and say why."""

from __future__ import annotations

import os
import sys

import fake_engines
import pytest

pytest_plugins = ["pytester"]

KIT_TEST = """
from pie.testing.conformance import ConformanceSuite

class TestKit(ConformanceSuite):
    engine = "{name}"
"""


@pytest.fixture(autouse=True)
def _engines_seen_by_the_kit(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kit runs in a pytest child, which finds install_engine's distributions through PYTHONPATH."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "site"), *sys.path]))


def _run_kit(pytester: pytest.Pytester, name: str, selection: str) -> pytest.RunResult:
    pytester.makepyfile(test_kit=KIT_TEST.format(name=name))
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-k", selection)


def test_an_engine_without_the_page_pool_kernels_fails_the_kit(install_engine, pytester) -> None:
    install_engine("nopool", fake_engines.NO_POOL_KERNELS)
    result = _run_kit(pytester, "nopool", "append_kv_and_attention")
    result.assert_outcomes(failed=4)
    result.stdout.fnmatch_lines(["*nopool does not implement append_kv and attention*cannot run a model*"])


def test_a_plugin_that_imports_a_heavy_library_fails_the_kit(install_engine, pytester) -> None:
    install_engine("heavy", fake_engines.HEAVY_IMPORT)
    install_engine("light", fake_engines.WORKING)
    _run_kit(pytester, "heavy", "heavy_library").stdout.fnmatch_lines(["*imports torch: import backends inside*"])
    _run_kit(pytester, "light", "heavy_library").assert_outcomes(passed=1)


def test_missing_page_hooks_fail_the_kit_by_name(install_engine, pytester) -> None:
    install_engine("nopages", fake_engines.WORKING)
    result = _run_kit(pytester, "nopages", "pages_start_zeroed")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*engine 'nopages' does not implement pie_read_pages*"])


def test_a_pool_that_is_not_zero_filled_is_named(install_engine, pytester) -> None:
    install_engine("dirty", fake_engines.DIRTY_PAGES)
    result = _run_kit(pytester, "dirty", "pages_start_zeroed")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*pie_allocate_pages must zero-fill: * values are not 0*"])


def test_a_download_that_is_not_row_major_is_named(install_engine, pytester) -> None:
    install_engine("strided", fake_engines.COLUMN_MAJOR_DOWNLOAD)
    result = _run_kit(pytester, "strided", "download_row_major")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*pie_download must return a row-major array, not strides*"])
