"""Tasks for the Pie monorepo: tests, lint, types, wheels, install matrix, the demo.

`nox -s ci` is what CI runs (README: "run every test"): system packages, one
shared environment with every heavy dependency installed once, every package's
tests with a skip count per engine, lint, types, the seven wheels and the
install matrix from a local wheelhouse.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = (
    "pie-core",
    "pie-engine-cpu",
    "pie-engine-xla",
    "pie-engine-vulkan",
    "pie-engine-wgpu",
    "pie-engine-cuda",
    "pie-engine-metal",
)
ENGINES = tuple(p.removeprefix("pie-engine-") for p in PACKAGES if p != "pie-core")

SYSTEM_PACKAGES = (
    "mesa-vulkan-drivers",  # lavapipe: a real Vulkan device on the CPU (vulkan, wgpu engines)
    "libvulkan1",
    "libamdhip64-dev",  # hiprtc for the HIP compile checks
    "pocl-opencl-icd",  # OpenCL on the CPU for eta's OpenCL target
    "ocl-icd-libopencl1",
    "g++",  # compiles the Metal kernels against the emulator header, and runs them on the CPU
    "gcc",  # builds the CPU engine's native kernels
    "gcc-aarch64-linux-gnu",  # cross-builds them for ARM: their NEON paths (test_native_neon.py)
    "libc6-dev-arm64-cross",
    "qemu-user",  # runs that ARM build here
    "libseccomp2",  # the inferlet workers' seccomp layer
    "chromium",  # headless, driven by playwright: pie serve's web page, the wgpu engine's browser device
    "iproute2",  # `ip`: a test cuts a replica off the network inside a network namespace of its own
)

CONSTRAINTS = ROOT / ".ci" / "constraints.txt"
"""The version of every package CI installs, transitive ones included (the environment of a green run)."""
RUFF, MYPY, BUILD = "ruff==0.17.6", "mypy==2.4.1", "build==1.6.1"

# One shared test environment, every version pinned so that a new release cannot turn CI red.
# torch is the CPU build that lies on this machine's disk; a plain `torch` would pull a multi-GB CUDA build.
TEST_REQUIREMENTS = (
    "torch==2.13.0",
    "transformers==5.24.0",
    "accelerate==1.16.0",  # transformers reads GGUF only with it
    "jax[cpu]==0.10.2",
    "flatbuffers==25.12.19",
    "cuda-python==13.4.4",
    "nvidia-cuda-nvrtc==13.0.88",
    "hip-python==10.0.0.0.1.2",
    "pyopencl==2026.1.4",
    "wgpu==0.32.0",
    "vulkan==1.3.275.1",
    "slangpy==0.43.1",  # build-time Slang compiler; generated/ records its version
    "pytest==9.2.0",
    "pytest-xdist==3.8.0",  # tests on a worker per core (TEST_WORKERS)
    "hypothesis==6.170.17",
    RUFF,
    MYPY,
    BUILD,
    "matplotlib==3.11.2",
    "pyinstrument==5.1.3",
    # pie serve (the pie-core[serve] extra) and its test client
    "fastapi==0.163.2",
    "uvicorn==0.54.0",
    "uvloop==0.23.0",  # uvicorn's loop="auto" picks it, and http="auto" httptools
    "httptools==0.9.0",
    "prometheus-client==0.26.0",
    "openai==3.57.0",
    "httpx==0.28.1",
    "pyseccomp==0.1.2",  # the inferlet workers' seccomp layer (binds the system libseccomp)
    "playwright==1.65.2",  # drives Debian's chromium (its own browser download is never used)
    # constrained generation (the pie-core[grammar] extra, in [serve] too) and the validator its tests check with
    "llguidance==1.9.1",
    "jsonschema==4.26.0",
    "ray==2.60.0",  # pie serve --ray (the pie-core[ray] extra): its tests start a two-node local cluster
    "aiohttp==3.14.5",  # the ray extra's ingress forwards to the replicas with its client
    # the packages' own dependencies, which their pyproject files give as ranges
    "numpy==2.4.6",
    "gguf==0.19.0",
    "tokenizers==0.23.3",
    "safetensors==0.8.0",
    "ml_dtypes==0.7.0",
    "pluggy==1.7.0",
    "typer==0.29.2",
    "platformdirs==4.14.9",
    "jinja2==3.1.6",
    "threadpoolctl==3.8.0",
    "rich==15.0.0",
)

# Lint rules live here: the top level holds no tool configuration files.
RUFF_RULES = ("--line-length", "120", "--select", "E,F,W,B,UP", "--ignore", "B008,B905,E501,UP045")

nox.options.sessions = ["ci"]
nox.options.reuse_existing_virtualenvs = True


def _install(session: nox.Session, *args: str) -> None:
    session.install("-c", str(CONSTRAINTS), *args)


def _install_system_packages(session: nox.Session) -> None:
    missing = [p for p in SYSTEM_PACKAGES if subprocess.run(["dpkg", "-s", p], capture_output=True).returncode != 0]
    if not missing:
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        session.warn(f"system packages missing and cannot be installed here: {' '.join(missing)}")
        return
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    session.run("apt-get", "update", "-q", external=True, env=env)
    session.run("apt-get", "install", "-y", "-q", "--no-install-recommends", *missing, external=True, env=env)


EXTRAS = {"pie-engine-wgpu": "[browser]"}
"""Extras the tests need: the wgpu engine's browser device (playwright, websockets, pinned there)."""


def _install_everything(session: nox.Session) -> None:
    _install(session, *TEST_REQUIREMENTS)
    _install(session, *[arg for p in PACKAGES for arg in ("-e", str(ROOT / p) + EXTRAS.get(p, ""))])


TEST_WORKERS = min(4, len(os.sched_getaffinity(0)))
"""pytest-xdist workers per package: one a core, at most four (each engine's compile caches and the model loads grow
with them). A module's tests run on one worker, and each test class on one (``--dist loadscope``): module and class
fixtures (a loaded model, a server) are made once. ``nox -s ci -- -n 0`` runs them serially."""


BLAS_THREAD_SETTINGS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")
"""OpenMP's threads (torch's follow them) and OpenBLAS's: with workers, the cores are shared out among them, unless
the caller set these. Each worker's torch and BLAS otherwise start a thread a core beside the other workers' busy
ones, and OpenMP's threads spin waiting for a core (the transformers anchors slow down most)."""


def _test_environment() -> dict[str, str]:
    if TEST_WORKERS < 2:
        return {}
    per_worker = str(max(1, len(os.sched_getaffinity(0)) // TEST_WORKERS))
    return {name: os.environ.get(name, per_worker) for name in BLAS_THREAD_SETTINGS}


def _pytest(session: nox.Session, package: str, *args: str) -> Path | None:
    """Run one package's tests; the path of their JUnit report, or None where nothing ran (``--install-only``)."""
    report = ROOT / ".nox" / "reports" / f"{package}.xml"
    report.parent.mkdir(parents=True, exist_ok=True)
    workers = ("-n", str(TEST_WORKERS), "--dist", "loadscope") if TEST_WORKERS > 1 else ()
    ran = session.run(
        "python",
        "-m",
        "pytest",
        str(ROOT / package / "tests"),
        "-q",
        "-rs",
        "-p",
        "no:cacheprovider",
        "-p",
        "pie.testing.user_folders",  # the process's (each xdist worker's) own device claims, profiles and logs
        f"--junitxml={report}",
        *workers,
        *args,  # after ours: a later -n wins
        env=_test_environment(),
    )
    return None if ran is None else report


def _count(report: Path) -> dict[str, int]:
    root = ElementTree.parse(report).getroot()
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for suite in root.iter("testsuite"):
        for key in totals:
            totals[key] += int(suite.get(key, 0))
    return totals


@nox.session
def ci(session: nox.Session) -> None:
    """Every test of every package in one shared environment, then lint, types, wheels, install matrix."""
    _install_system_packages(session)
    _install_everything(session)
    counts = {}
    for package in PACKAGES:
        report = _pytest(session, package, *session.posargs)
        if report is None:  # --install-only: the environment is ready, nothing ran to count
            return
        counts[package] = _count(report)
    lint(session)
    typecheck(session)
    wheelhouse = _build_wheels(session)
    _install_matrix(session, wheelhouse)
    session.log("skips per package (engine):")
    for package, c in counts.items():
        session.log(f"  {package:<18} {c['skipped']:>4} skipped of {c['tests']}")
    passed = sum(c["tests"] - c["failures"] - c["errors"] - c["skipped"] for c in counts.values())
    failed = sum(c["failures"] + c["errors"] for c in counts.values())
    skipped = sum(c["skipped"] for c in counts.values())
    print(f"{passed} passed, {failed} failed, {skipped} skipped", flush=True)


@nox.session
@nox.parametrize("package", PACKAGES)
def tests(session: nox.Session, package: str) -> None:
    """One package's tests (in its own environment with everything installed)."""
    _install_system_packages(session)
    _install_everything(session)
    _pytest(session, package, *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    _install(session, RUFF)
    session.run(
        "ruff",
        "check",
        *RUFF_RULES,
        *[str(ROOT / p) for p in PACKAGES],
        str(ROOT / "noxfile.py"),
        str(ROOT / "benchmarks"),
    )


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy on the contract, its facade, the pass plan and the engine kit."""
    _install(session, MYPY, "-e", str(ROOT / "pie-core"))
    core = ROOT / "pie-core" / "src" / "pie"
    # Hook specs are bodies of documentation only, hence empty-body.
    names = ("hookspecs.py", "contract.py", "plugins.py", "probe_cache.py", "kernels.py", "runtime/pass_plan.py", "enginekit")
    files = [str(core / name) for name in names]
    session.run("mypy", "--ignore-missing-imports", "--disable-error-code", "empty-body", *files)


def _build_wheels(session: nox.Session) -> Path:
    _install(session, BUILD)
    wheelhouse = ROOT / ".nox" / "wheelhouse"
    shutil.rmtree(wheelhouse, ignore_errors=True)
    for package in PACKAGES:
        session.run("python", "-m", "build", "--wheel", "--outdir", str(wheelhouse), str(ROOT / package), silent=True)
    for wheel in sorted(wheelhouse.glob("*.whl")):
        session.log(f"{wheel.name}: {wheel.stat().st_size / 1024:.0f} KiB")
    return wheelhouse


@nox.session
def wheels(session: nox.Session) -> None:
    """Build all seven wheels and print their sizes."""
    _build_wheels(session)


INSTALL_CHECK = """
import json, os, subprocess, sys
engine = sys.argv[1]
pie = os.path.join(os.path.dirname(sys.executable), "pie")  # this environment's console script
listing = subprocess.run([pie, "engines", "--json", "--refresh"], check=True, capture_output=True, text=True)
report = json.loads(listing.stdout)
names = {e["name"]: e for e in report["engines"]}
expected = {"cpu"} | ({engine} if engine else set())
assert set(names) == expected - {""}, (sorted(names), sorted(expected))
for name, entry in names.items():
    assert entry["status"] in ("ok", "broken", "no-device"), entry
    assert entry["status"] == "ok" or entry["reason"], entry
assert names["cpu"]["status"] == "ok", names["cpu"]
served = subprocess.run([pie, "serve", "--port", "0"], capture_output=True, text=True, timeout=60)
assert served.returncode == 1 and "pip install 'pie-core[serve]'" in served.stderr, served  # the extra is not here
print("install ok:", {n: (e["status"], e["reason"][:60]) for n, e in names.items()})
"""


def _install_matrix(session: nox.Session, wheelhouse: Path) -> None:
    """pie-core + pie-engine-cpu in a fresh environment, then that plus each single engine in turn.

    pie-core's light dependencies come from the package index (cached), once; the project's own
    wheels install with --no-deps from the local wheelhouse, so no heavy backend is paid for again:
    an engine whose backend library is absent must say so in `pie engines`, not crash it. Each engine
    is uninstalled before the next (a --no-deps wheel leaves nothing else behind), and the check asserts
    the exact set of engines listed, so a leftover would fail it.
    """
    env_dir = ROOT / ".nox" / "matrix"
    shutil.rmtree(env_dir, ignore_errors=True)
    session.run("python", "-m", "venv", str(env_dir), external=True)
    python = str(env_dir / "bin" / "python")
    wheels = [next(wheelhouse.glob("pie_core-*.whl")), next(wheelhouse.glob("pie_engine_cpu-*.whl"))]
    session.run(python, "-m", "pip", "install", "-q", "-c", str(CONSTRAINTS), str(wheels[0]), str(wheels[1]),
                external=True)
    for engine in ("", *[e for e in ENGINES if e != "cpu"]):
        if engine:
            wheel = next(wheelhouse.glob(f"pie_engine_{engine}-*.whl"))
            session.run(python, "-m", "pip", "install", "-q", "--no-deps", str(wheel), external=True)
        env = {"PIE_PROBE_CACHE": str(env_dir / f"probes-{engine or 'core'}.json")}
        session.run(python, "-c", INSTALL_CHECK, engine, external=True, env=env)
        if engine:
            session.run(python, "-m", "pip", "uninstall", "-q", "-y", f"pie-engine-{engine}", external=True)


@nox.session
def install_matrix(session: nox.Session) -> None:
    """Prove each wheel installs and `pie engines` reports it correctly in a fresh environment."""
    _install_matrix(session, _build_wheels(session))


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: pie-core and the CPU engine, the embedded default model, one question."""
    _install(session, "-e", str(ROOT / "pie-core"), "-e", str(ROOT / "pie-engine-cpu"))
    session.run("pie", "engines")
    session.run("pie", "model", "pull", "smollm2-135m-instruct")
    session.run("pie", "run", *(session.posargs or ["What is the capital of France?"]))
