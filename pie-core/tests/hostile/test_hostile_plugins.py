"""Hostile plugins, installed as real distributions: one that segfaults or hangs on import or in its device
probe, one that takes the name of the CPU engine, one that cannot run a model. `pie engines`, `pie doctor`
and `pie run` must finish, keep the healthy engines working, and say what each broken one did."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import fake_engines  # beside the unit tests (tests/ is on sys.path through its conftest)
import pytest
from pie_process import assert_ok, assert_user_error, run_pie

from pie.testing.models import make_gguf_model

PROBE_TIMEOUT_S = 3
HOSTILE = {
    "segvimport": (fake_engines.SEGFAULT_ON_IMPORT, "crashed (signal 11) while loading the plugin"),
    "segvprobe": (fake_engines.SEGFAULT_IN_PROBE, "crashed (signal 11) while probing devices"),
    "hangimport": (fake_engines.HANG_ON_IMPORT, f"timed out after {PROBE_TIMEOUT_S} s while loading the plugin"),
    "hangprobe": (fake_engines.HANG_IN_PROBE, f"timed out after {PROBE_TIMEOUT_S} s while probing devices"),
}
CONFLICT = "engine name 'cpu' is registered by both pie-engine-cpu"
COUNTED = """
with open({marker!r}, "a") as marker:
    marker.write("imported\\n")
"""


@pytest.fixture
def site_env(install_engine: Callable[..., None], tmp_path: Path, pie_env: dict[str, str]) -> dict[str, str]:
    """What `pie` needs to see the engines ``install_engine`` installs."""
    path = os.pathsep.join(p for p in (str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")) if p)
    return {**pie_env, "PYTHONPATH": path}


@pytest.fixture
def hostile_env(install_engine: Callable[..., None], tmp_path: Path, site_env: dict[str, str]) -> dict[str, str]:
    """Every hostile plugin at once (high priorities, so automatic selection meets them first), a
    counting plugin that notes each import, and what `pie` needs to see them."""
    for name, (source, _) in HOSTILE.items():
        install_engine(name, source, priority=99)
    install_engine("nopool", fake_engines.NO_POOL_KERNELS, priority=90)
    install_engine("counted", COUNTED.format(marker=str(tmp_path / "imports.txt")) + fake_engines.WORKING, priority=-50)
    site = tmp_path / "site"
    (site / "acme_cpu.py").write_text(fake_engines.WORKING.format(name="cpu", priority=0))
    info = site / "acme_fast_cpu-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-fast-cpu\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pie.engines]\ncpu = acme_cpu\n")
    return {**site_env, "PIE_ENGINES": "", "PIE_PROBE_TIMEOUT": str(PROBE_TIMEOUT_S)}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gguf_model(tmp_path_factory.mktemp("model") / "tiny.gguf", "F32")


def test_pie_engines_lists_each_broken_plugin_with_what_it_did(hostile_env: dict[str, str], tmp_path: Path) -> None:
    result = run_pie("engines", env=hostile_env, timeout=120)
    assert_ok(result, *(reason for _, reason in HOSTILE.values()), CONFLICT, "acme-fast-cpu", "chosen: cpu on cpu:0")
    assert "nopool cannot run a model: it lacks append_kv and attention" in result.output
    assert (tmp_path / "imports.txt").read_text() == "imported\n", "one probe child imports it; this process never"
    warm = run_pie("engines", env=hostile_env, timeout=120)
    assert_ok(warm, *(reason for _, reason in HOSTILE.values()), "remembered from a probe", "--refresh")
    assert (tmp_path / "imports.txt").read_text() == "imported\n", "with a warm probe cache no child is started"


def test_pie_doctor_finishes_and_says_what_each_broken_plugin_did(hostile_env: dict[str, str]) -> None:
    result = run_pie("doctor", env=hostile_env, timeout=120)
    assert_ok(result, *(reason for _, reason in HOSTILE.values()), CONFLICT, "fix: pip uninstall acme-fast-cpu")
    assert "cpu (pie-engine-cpu 0.1.0): ok" in result.output and "[ok] numpy" in result.output


def test_pie_run_without_an_engine_runs_on_a_healthy_one(hostile_env: dict[str, str], tiny_model: Path) -> None:
    result = run_pie("run", "Hello", "--model", str(tiny_model), "--max-tokens", "3", env=hostile_env, timeout=120)
    assert_ok(result, "[cpu:0", "nopool cannot run a model", "acme-fast-cpu also registers 'cpu'")


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_pie_run_on_a_broken_plugin_is_a_clear_error(hostile_env: dict[str, str], tiny_model: Path, name: str) -> None:
    result = run_pie("run", "Hello", "--model", str(tiny_model), "--engine", name, env=hostile_env, timeout=120)
    assert_user_error(result, f"engine '{name}' cannot start", HOSTILE[name][1])


def test_the_cpu_engine_asked_for_is_the_cpu_engine(hostile_env: dict[str, str], tiny_model: Path) -> None:
    args = ("run", "Hello", "--model", str(tiny_model), "--engine", "cpu", "--max-tokens", "3")
    result = run_pie(*args, env=hostile_env, timeout=120)
    assert_ok(result, "[cpu:0", "engine 'cpu' was asked for", "acme-fast-cpu also registers 'cpu' and is not loaded")
    assert "Fake Device" not in result.output


@pytest.mark.parametrize("args", [("engines",), ("doctor",), ("run", "Hello")], ids=" ".join)
@pytest.mark.parametrize("timeout", ["abc", "-1", "nan", "0"])
def test_a_probe_timeout_that_is_no_number_of_seconds_is_a_clear_error(
    pie_env: dict[str, str], tiny_model: Path, args: tuple[str, ...], timeout: str
) -> None:
    env = {**pie_env, "PIE_ENGINES": "", "PIE_PROBE_TIMEOUT": timeout}
    result = run_pie(*args, *(("--model", str(tiny_model)) if args[0] == "run" else ()), env=env, timeout=120)
    assert_user_error(result, f"PIE_PROBE_TIMEOUT='{timeout}' is not a number of seconds")


@pytest.mark.parametrize("args", [("run", "Hello", "--max-tokens", "2"), ("profile", "show")], ids=" ".join)
def test_a_thread_an_engine_leaves_running_does_not_keep_pie_from_exiting(
    install_engine: Callable[..., None], site_env: dict[str, str], tiny_model: Path, args: tuple[str, ...]
) -> None:
    """pie printed its output, then waited at exit, for an hour here, for the thread the engine started."""
    install_engine("leaky", fake_engines.LEAVES_A_THREAD)
    model = ("--model", str(tiny_model)) if args[0] == "run" else ()
    result = run_pie(*args, *model, "--engine", "leaky", env=site_env, timeout=120)
    assert_ok(result, "leaky:0")


def test_an_engine_that_does_not_know_its_memory_gets_a_kv_cache_of_a_whole_sequence(
    install_engine: Callable[..., None], site_env: dict[str, str], tiny_model: Path
) -> None:
    """Sized from 0 bytes, the KV cache held 16 tokens, and any longer prompt was refused (wgpu on a GPU adapter)."""
    install_engine("nomem", fake_engines.UNKNOWN_MEMORY)
    prompt = "A paged KV cache keeps the keys and values of every token in fixed-size pages of memory. " * 2
    result = run_pie("run", prompt, "--max-tokens", "4", "--model", str(tiny_model), "--engine", "nomem",
                     env=site_env, timeout=120)
    assert_ok(result, "nomem:0")


@pytest.mark.parametrize("command", ["run", "plan"])
def test_an_engine_that_fails_to_compile_is_named_with_the_kernel(
    install_engine: Callable[..., None], site_env: dict[str, str], tiny_model: Path, command: str
) -> None:
    """It was an internal error of pie's (exit 70, a report file), naming neither the engine nor the kernel."""
    install_engine("nocc", fake_engines.COMPILE_FAILS)
    model = ("Hello", "--max-tokens", "2", "--model", str(tiny_model)) if command == "run" else (str(tiny_model),)
    result = run_pie(command, *model, "--engine", "nocc", env=site_env, timeout=120)
    assert_user_error(result, "engine 'nocc': compiling kernel ", " failed: RuntimeError: no kernel compiler")
    assert result.returncode == 1


def test_an_engine_that_passed_its_probe_but_cannot_start_leaves_the_other_profiles_listed(
    install_engine: Callable[..., None], site_env: dict[str, str]
) -> None:
    """`pie profile list` and `pie profile export` (of another engine's profile) failed on it."""
    from pie.profiles import parse_profile
    from pie.profiles.shipped import shipped_profiles

    install_engine("busy", fake_engines.BUSY_IN_PIE)
    env = {**site_env, "PIE_ENGINES": "busy,cpu"}
    note = "note: engine 'busy' cannot start: device probe failed: RuntimeError: device busy"
    listed = run_pie("profile", "list", env=env, timeout=120)
    assert_ok(listed, note, "applies to cpu:0")
    name = parse_profile(shipped_profiles("pie_engine_cpu")[0]).name
    exported = run_pie("profile", "export", name, env=env, timeout=120)
    assert_ok(exported, note)
    assert parse_profile(exported.stdout).name == name


def test_what_an_engine_prints_when_imported_stays_out_of_machine_readable_output(
    install_engine: Callable[..., None], site_env: dict[str, str], tiny_model: Path
) -> None:
    """`pie bench --json` printed no JSON, and `pie profile export NAME > NAME.toml` wrote no TOML, for this
    engine or any other (every working engine is imported to list the profiles)."""
    import json

    from pie.profiles import parse_profile
    from pie.profiles.shipped import shipped_profiles

    install_engine("loud", fake_engines.PRINTS_ON_IMPORT)
    args = ("--engine", "loud", "--json", "--prompt-tokens", "4", "--decode-tokens", "2", "--runs", "1")
    bench = run_pie("bench", "--model", str(tiny_model), *args, env=site_env, timeout=120)
    assert_ok(bench, "loud: hello", "loud: from C")
    assert json.loads(bench.stdout)["engine"] == "loud"
    name = parse_profile(shipped_profiles("pie_engine_cpu")[0]).name
    exported = run_pie("profile", "export", name, env={**site_env, "PIE_ENGINES": "loud,cpu"}, timeout=120)
    assert_ok(exported, "loud: hello", "loud: from C")
    assert parse_profile(exported.stdout).name == name


@pytest.mark.parametrize(
    ("source", "says"),
    [(fake_engines.EXITS_IN_COMPILE, ("engine 'quitter': compiling kernel ", " failed: it called sys.exit(9)")),
     (fake_engines.EXITS_IN_LAUNCH, ("kernel ", " failed: it called sys.exit(11)"))],
    ids=["compile", "launch"],
)
def test_an_engine_that_calls_sys_exit_is_an_engine_failure_not_pies_exit(
    install_engine: Callable[..., None], site_env: dict[str, str], tiny_model: Path, source: str,
    says: tuple[str, ...]
) -> None:
    """pie ended with the engine's exit status (9, 11) and said nothing."""
    install_engine("quitter", source)
    args = ("run", "Hello", "--max-tokens", "2", "--model", str(tiny_model), "--engine", "quitter")
    result = run_pie(*args, env=site_env, timeout=120)
    assert_user_error(result, *says)
    assert result.returncode == 1
