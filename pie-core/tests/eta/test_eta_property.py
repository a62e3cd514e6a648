"""Property test: 2,000 generated sources (random typed programs, garbage, mutations).

Each source either fails with EtaSyntaxError/EtaTypeError (pointing inside the text) or
compiles, renders for every target with no user text in any source, and evaluates with
numpy. The distinct accepted programs are then compiled in batches, hundreds of kernels per
module: all of them by NVRTC (PTX, -G: front end and code generation), naga (WGSL) and PoCL
(OpenCL C); samples optimized to sm_90 CUBIN and by hiprtc; samples run on PoCL, lavapipe,
the Metal-as-C++ driver and JAX, where they must agree with numpy. Sample sizes are the
constants below; the test prints the counts (run with -s to see them). The examples are
derandomized, so every run checks the same 2,000 (about 800 distinct accepted programs, twice
the largest sample); ETA_EXAMPLES=10000 makes a wider sweep, ETA_EXAMPLES=500 a quick local run.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pie.eta as eta
import pytest
from eta_harness import (
    Case,
    disagreement,
    hiprtc_compile,
    ill_conditioned,
    non_finite_paths,
    nvrtc_compile,
    random_case,
    signed_zero_paths,
)
from eta_programs import COMMENT_MARKER, Program, sources
from hypothesis import HealthCheck, given, settings
from pie.eta import TARGETS, Epilogue, EtaError, EtaSyntaxError, EtaTypeError

EXAMPLES = int(os.environ.get("ETA_EXAMPLES", 2_000))
MODULE_SIZE = 500  # kernels per NVRTC module
SAMPLES = {"cubin": 400, "hip": 400, "opencl": 150, "wgsl": 300, "metal": 300, "jax": 60}
# PoCL reports clang warnings about users' own expressions (e.g. `x >= x`).
pytestmark = pytest.mark.filterwarnings("ignore::pyopencl.CompilerWarning")
RTOL, ATOL = 1e-4, 1e-5


@dataclass
class Corpus:
    epilogues: list[Epilogue] = field(default_factory=list)  # distinct accepted programs
    counts: Counter = field(default_factory=Counter)

    def sample(self, size: int) -> list[Epilogue]:
        """`size` epilogues spread evenly over the corpus (deterministic)."""
        step = max(1, len(self.epilogues) // size)
        return self.epilogues[::step][:size]


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    corpus = Corpus()
    rendered: dict[str, list[str]] = {}  # key -> source per target; equal keys render equal sources

    @settings(
        max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )
    @given(sources)
    def explore(program: Program) -> None:
        corpus.counts["examples"] += 1
        try:
            ep = eta.compile(program.text)
        except (EtaSyntaxError, EtaTypeError) as error:
            check_error(error, program.text)
            corpus.counts[type(error).__name__] += 1
            return
        corpus.counts["compiled"] += 1
        if ep.key not in rendered:
            rendered[ep.key] = [ep.render(target).source for target in TARGETS]
            case = random_case(ep, 2, 3, np.random.default_rng(len(corpus.epilogues)))
            outputs = ep.numpy_fn()(**case.inputs, **case.params)
            assert all(v.dtype in (np.float32, np.int32) and v.shape == (2, 3) for v in outputs.values())
            corpus.epilogues.append(ep)
        for source in rendered[ep.key]:
            check_hygiene(source, program)

    explore()
    corpus.counts["distinct"] = len(corpus.epilogues)
    corpus.counts["per_row"] = sum(ep.render("cuda").bindings.per_row for ep in corpus.epilogues)
    return corpus


def check_error(error: EtaError, text: str) -> None:
    lines = text.splitlines() or [""]
    assert 1 <= error.line <= max(len(lines), text.count("\n") + 1), error
    line = lines[error.line - 1] if error.line <= len(lines) else ""
    assert 1 <= error.column <= len(line) + 1, error
    shown = str(error).splitlines()
    assert len(shown) == 3 and shown[2].strip() == "^" and error.message in shown[0]


def check_hygiene(source: str, program: Program) -> None:
    """User identifiers appear only mangled; comments and zero-padded literal spellings never appear.

    The identifiers checked are the distinctive ones the generator makes (a capital, a
    final digit: nothing a renderer writes looks like that), read from the text itself
    because mutations may have changed them."""
    code = re.sub(r"#[^\n]*", "", program.text)
    for name in set(re.findall(r"\b[A-Z][A-Za-z0-9_]*[0-9]\b", code)):
        assert not re.search(rf"\b{name}\b", re.sub(rf"(?:in|out|p)_{name}\b", "", source)), name
    assert COMMENT_MARKER not in source
    for spelled in program.spellings:  # as a whole token: "000" may sit inside "0.00085"
        assert not re.search(rf"(?<![\w.]){re.escape(spelled)}(?![\w.])", source), spelled


def test_generated_sources_compile_or_fail_cleanly(corpus: Corpus) -> None:
    counts = corpus.counts
    print(f"\neta property corpus: {dict(counts)}")
    assert counts["examples"] == EXAMPLES
    assert (
        counts["compiled"] > EXAMPLES // 2
        and counts["EtaSyntaxError"] > EXAMPLES // 20
        and counts["EtaTypeError"] > EXAMPLES // 30
    )
    assert counts["distinct"] > EXAMPLES // 5 and counts["per_row"] > EXAMPLES // 50


def modules(epilogues: list[Epilogue], size: int) -> list[list[Epilogue]]:
    return [epilogues[i : i + size] for i in range(0, len(epilogues), size)]


def test_nvrtc_compiles_every_program(corpus: Corpus) -> None:
    for batch in modules(corpus.epilogues, MODULE_SIZE):
        source = eta.render_many(batch, "cuda")[0].source
        ptx = nvrtc_compile(source, "sm_80", cubin=False, options=("-G",))
        assert ptx.count(b".entry ") == len(batch)
    count = len(modules(corpus.epilogues, MODULE_SIZE))
    print(f"\nNVRTC compute_80 PTX: {len(corpus.epilogues)} kernels in {count} modules")


def test_wgsl_validates_every_program(corpus: Corpus, webgpu) -> None:
    """naga checks each module: types, uniformity, and WGSL's shader-creation-time
    evaluation of constant expressions (an overflow there rejects the whole module)."""
    for batch in modules(corpus.epilogues, MODULE_SIZE):
        webgpu.build(list(eta.render_many(batch, "wgsl")))


def test_opencl_builds_every_program(corpus: Corpus, opencl) -> None:
    for batch in modules(corpus.epilogues, MODULE_SIZE):
        program = opencl.build(list(eta.render_many(batch, "opencl")))
        assert set(program.kernel_names.split(";")) == {ep.entry_point for ep in batch}


def test_nvrtc_optimizes_a_sample_to_sm90_cubin(corpus: Corpus) -> None:
    sample = corpus.sample(SAMPLES["cubin"])
    cubin = nvrtc_compile(eta.render_many(sample, "cuda")[0].source, "sm_90", cubin=True)
    assert all(ep.entry_point.encode() in cubin for ep in sample)


def test_hiprtc_compiles_a_sample(corpus: Corpus) -> None:
    sample = corpus.sample(SAMPLES["hip"])
    code = hiprtc_compile(eta.render_many(sample, "hip")[0].source, "gfx90a")
    assert all(ep.entry_point.encode() in code for ep in sample)


def test_a_zero_that_a_max_chose_leaves_its_sign_and_what_follows_to_the_target() -> None:
    """rsqrt(row_max(x * 0)) is +inf or -inf by which zero the max kept of x's -0 and +0: Metal as C++ kept +0 where
    numpy kept -0 (CI at 203717a). Rows whose max is not a zero stay compared."""
    ep = eta.compile("in X: f32[rows, cols]\nout Y = rsqrt(row_max(X * 0))\nout Z = row_max(X) + X")
    x = np.array([[1.0, -2.0, 3.0], [-1.0, -2.0, -3.0], [2.0, 0.5, 1.0]], np.float32)
    case = Case(ep, {"X": x}, {}, x.shape)
    paths = signed_zero_paths(case)
    assert paths["Y"].all(), "every row's max is a zero"
    assert not paths["Z"].any(), "no row's max is a zero"


Run = Callable[[Epilogue, Case], dict[str, np.ndarray]]


def agree_on_sample(sample: list[Epilogue], name: str, run: Run, ieee: bool = True) -> None:
    """Run each program once; outputs must match numpy except where numpy itself is
    ill-conditioned, where a zero's sign was the target's to choose, or (for targets without IEEE
    guarantees) a non-finite value was involved."""
    rng = np.random.default_rng(1)
    stats = Counter()
    for ep in sample:
        case = random_case(ep, 3, int(rng.choice([1, 7, 300])), rng)
        reference = case.reference()
        got = run(ep, case)
        skip = ill_conditioned(case, reference, RTOL, ATOL)
        for output, mask in signed_zero_paths(case).items():
            skip[output] |= mask
        if not ieee:
            for output, mask in non_finite_paths(case).items():
                skip[output] |= mask
        for output, want in reference.items():
            bad = disagreement(got[output], want, RTOL, ATOL) & ~skip[output]
            assert not bad.any(), (
                f"{name} {ep.entry_point} {output}:\n{ep.source}\ngot {got[output][bad][:4]} want {want[bad][:4]}"
            )
            stats["elements"] += want.size
            stats["skipped"] += int(skip[output].sum())
    compared = stats["elements"] - stats["skipped"]
    print(f"\n{name}: ran {len(sample)} programs, compared {compared} of {stats['elements']} elements")


def on_device(runner, target: str, sample: list[Epilogue]) -> Run:
    """Build the sample as one module for `target`; run kernels from it."""
    kernels = {k.entry_point: k for k in eta.render_many(sample, target)}
    program = runner.build(list(kernels.values()))
    return lambda ep, case: runner.run(program, kernels[ep.entry_point], case)


def test_opencl_runs_a_sample(corpus: Corpus, opencl) -> None:
    sample = corpus.sample(SAMPLES["opencl"])
    agree_on_sample(sample, "opencl", on_device(opencl, "opencl", sample))


def test_wgsl_runs_a_sample(corpus: Corpus, webgpu) -> None:
    sample = corpus.sample(SAMPLES["wgsl"])
    agree_on_sample(sample, "wgsl", on_device(webgpu, "wgsl", sample), ieee=False)


def test_metal_as_cpp_runs_a_sample(corpus: Corpus, metal) -> None:
    sample = corpus.sample(SAMPLES["metal"])
    agree_on_sample(sample, "metal", on_device(metal, "metal", sample))


def test_jax_runs_a_sample(corpus: Corpus) -> None:
    def run(ep: Epilogue, case: Case) -> dict[str, np.ndarray]:
        return {k: np.asarray(v) for k, v in ep.jax_fn()(**case.inputs, **case.params).items()}

    # XLA on CPU flushes subnormals to zero: compare like a non-IEEE target.
    agree_on_sample(corpus.sample(SAMPLES["jax"]), "jax", run, ieee=False)
