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


def test_a_kernel_an_engine_lacks_is_skipped_saying_what_runs_instead(install_engine, pytester) -> None:
    """Every skip said "it runs on the CPU engine", also for fused kernels (Poem runs their primitives) and top_k
    (the host selects): an author took it that the CPU engine must be installed for those."""
    install_engine("sparse", fake_engines.WORKING)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-rs", "-k", "kernel_matches_reference and (embedding or linear_add or top_k)",
        pytester.makepyfile(test_kit=KIT_TEST.format(name="sparse")),
    )
    result.assert_outcomes(skipped=3)
    result.stdout.fnmatch_lines_random([
        "*sparse does not implement embedding; the runtime runs it on the CPU engine (pie-engine-cpu), with transfers*",
        "*sparse does not implement linear_add; Poem runs the primitives it fuses instead*",
        "*sparse does not implement top_k; the runtime selects tokens on the host instead*",
    ])


def test_an_engine_that_is_not_installed_fails_the_kit_saying_how_to_install_it(pytester) -> None:
    """Each test errored with "engine 'foo' is not installed (installed: ...)" from deep in the registry."""
    result = _run_kit(pytester, "notinstalled", "discovered_and_ok or device_description")
    result.assert_outcomes(failed=1, errors=1)
    result.stdout.fnmatch_lines(["*no engine 'notinstalled' is installed (installed: *): install its distribution "
                                 "(pip install -e .) so that its 'pie.engines' entry point is found*"])
