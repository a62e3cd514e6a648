"""The scripts in benchmarks/ are not measured by CI, so they are started here, each in a fresh process: every
one answers ``--help`` with its usage (its imports and its parser still work on this tree), and the one that
needs neither a GPU nor a peer, ``gpu_host_cost.py``, runs to its figure on a tiny model."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from pie.plugins import EngineRegistry
from pie.testing.models import make_gguf_model

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py"))


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300, cwd=BENCHMARKS.parent)


def test_every_benchmark_is_listed_in_the_readme() -> None:
    readme = (BENCHMARKS / "README.md").read_text()
    scripts = [*SCRIPTS, *(p.name for p in BENCHMARKS.glob("*.sh"))]
    assert [s for s in scripts if f"`{s}`" not in readme] == []


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_benchmark_answers_help_with_its_usage(script: str) -> None:
    """plugin_overhead.py and profile_parse.py once took no arguments and ran the benchmark on `--help`."""
    result = _run(f"benchmarks/{script}", "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: "), result.stdout[:500]


def test_gpu_host_cost_runs_to_its_figure_with_few_steps(tmp_path: Path) -> None:
    """With `--steps` under 21 it divided by zero: 20 warm-up steps came out of the timed ones."""
    model = make_gguf_model(tmp_path / "tiny.gguf", "F32")
    result = _run("benchmarks/gpu_host_cost.py", "--model", str(model), "--steps", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    figure = re.search(r"host per batch-1 decode step.*\(min \d+ us, 2 steps\), (\d+) launches a step", result.stdout)
    assert figure is not None and int(figure.group(1)) > 0, result.stdout


def test_ray_replicas_refuses_a_load_of_one_client() -> None:
    """Two replicas straight got half of the clients each: none at 1 client (0 tok/s, then a division by zero
    after the whole run), and an odd count lost one."""
    result = _run("benchmarks/ray_replicas.py", "--concurrency", "1,8")
    assert result.returncode == 2 and "--concurrency: each load needs at least 2 clients" in result.stderr


@pytest.mark.parametrize(("engine", "command"), [("cuda", ["gpu_split_k.py"]),
                                                  ("metal", ["gpu_profile.py", "--engine", "metal"])])
def test_a_gpu_benchmark_without_its_engine_says_so_without_a_traceback(engine: str, command: list[str]) -> None:
    """Opening an engine that cannot start raised EngineSelectionError out of main(), a traceback."""
    if EngineRegistry().status(engine).status == "ok":
        pytest.skip(f"the {engine} engine runs here")
    result = _run(f"benchmarks/{command[0]}", *command[1:])
    assert result.returncode == 2 and f"engine '{engine}' cannot start" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr
