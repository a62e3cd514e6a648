"""The engine conformance kit: the same contract tests for every engine.

An engine's test suite runs it with one class::

    from pie.testing.conformance import ConformanceSuite

    class TestMyEngine(ConformanceSuite):
        engine = "foo"

The suite finds the engine as ``pie`` does, by its entry point, so the engine's
distribution is installed first (``pip install -e .``); a suite whose engine is
registered in the process instead (an emulated device) sets ``registry_factory``
to a function returning that :class:`pie.plugins.EngineRegistry`.

Every catalogue kernel the engine lists is checked, in each of its variants,
against the numpy reference of :mod:`pie.kernels` on random shapes; the page
hooks are checked for allocation, round trips, copies and in-place appends; errors are
checked to be clear; importing the plugin is checked to import no heavy library;
a tiny model's logits are checked to be the same with and without the pass plans
``pie_begin_pass`` hands the engine. Kernels an engine does not list are skipped
saying what runs instead (:func:`stand_in`: a primitive runs on the CPU engine,
a fused kernel as its primitives, ``top_k`` on the host), except ``append_kv``
and ``attention``, which work on the engine's own page pool: without them an
engine cannot run a model, and the kit fails. Every weight type an engine declares for a kernel (``pie_weight_types``)
is checked against the ``gguf`` library's dequantization, and a tiny model stored
in those types against its float32 copy on the CPU engine (``pie-engine-cpu``). Every KV page type an
engine lists (``pie_kv_dtypes``) is checked through ``append_kv`` and ``attention``
against float32 attention over the same keys and values rounded to it. Launches whose arguments do not
fit together (``misfit_cases``) must be refused with a ValueError naming the kernel, before any kernel
reads or writes past a buffer: ``pie.enginekit.catalogue`` has the checks every engine here makes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zlib
from collections.abc import Iterator
from importlib import metadata
from typing import Any, ClassVar

import numpy as np
import pytest

from pie import kernels
from pie.contract import CONTRACT_VERSION, KV_DTYPES, DeviceInfo, PageLayout, PassPlan, kv_host_dtype
from pie.kernels import POOL_KERNELS
from pie.plugins import ENTRY_POINT_GROUP, Device, EngineError, EngineRegistry, EngineSelectionError
from pie.testing.kquants import K_TYPES, quantize_k
from pie.weights import F32, WEIGHT_TYPES, StoredWeight, quantize

TOLERANCE = {"rtol": 2e-4, "atol": 2e-4}
NARROW_KV_TOLERANCE = {"float16": 1e-3, "bfloat16": 1e-2}
"""How far attention over keys and values rounded to a KV page type may be from attention over the unrounded
ones, relative to the largest output."""

Case = tuple[tuple[Any, ...], dict[str, Any]]


def _f32(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def random_batch(
    rng: np.random.Generator, page_size: int, num_pages: int, max_seqs: int = 3, decode: bool = False
) -> dict[str, np.ndarray]:
    """A ragged batch: per sequence a random KV length and a random number of new tokens (one when decoding)."""
    seqs = int(rng.integers(2 if decode else 1, max_seqs + 1))
    free = list(rng.permutation(num_pages))
    qo, indices, page_indptr, last = [0], [], [0], []
    for _ in range(seqs):
        kv_len = int(rng.integers(1, 3 * page_size + 2))
        q_len = 1 if decode else int(rng.integers(1, min(kv_len, 5) + 1))
        pages = -(-kv_len // page_size)
        indices.extend(free.pop() for _ in range(pages))
        page_indptr.append(len(indices))
        last.append(kv_len - (pages - 1) * page_size)
        qo.append(qo[-1] + q_len)
    as32 = lambda v: np.asarray(v, dtype=np.int32)  # noqa: E731
    return {
        "qo_indptr": as32(qo),
        "kv_page_indices": as32(indices),
        "kv_page_indptr": as32(page_indptr),
        "kv_last_page_lens": as32(last),
    }


def batch_of(rng: np.random.Generator, page_size: int, num_pages: int, lengths: list[tuple[int, int]]) -> dict[str, np.ndarray]:
    """A batch of sequences of ``(kv_len, q_len)`` each (q_len 1: a decode row), on scattered pages."""
    free = list(rng.permutation(num_pages))
    qo, indices, page_indptr, last = [0], [], [0], []
    for kv_len, q_len in lengths:
        if not 1 <= q_len <= kv_len:
            raise ValueError(f"a sequence of {kv_len} KV tokens cannot have {q_len} new ones")
        pages = -(-kv_len // page_size)
        indices.extend(free.pop() for _ in range(pages))
        page_indptr.append(len(indices))
        last.append(kv_len - (pages - 1) * page_size)
        qo.append(qo[-1] + q_len)
    return {key: np.asarray(value, dtype=np.int32) for key, value in
            (("qo_indptr", qo), ("kv_page_indices", indices), ("kv_page_indptr", page_indptr), ("kv_last_page_lens", last))}


ATTENTION_OPTION_BATCHES = {
    "mixed": [(13, 13), (9, 1), (19, 6), (3, 3), (22, 1)],
    "decode": [(9, 1), (22, 1), (5, 1), (16, 1)],
    "prefill": [(23, 23)],
    "one-row": [(22, 1)],
}
"""Sequences as ``(kv_len, q_len)`` over 4-token pages: whole prompts, decode rows and chunked prefills, and
one decode row alone (which an engine may cut into key ranges)."""

ATTENTION_OPTIONS = {
    "window3": {"window": 3},
    "window8": {"window": 8},
    "softcap": {"softcap": 0.7},
    "window5-softcap": {"window": 5, "softcap": 1.5},
    "window1": {"window": 1},
}


def kernel_cases(name: str, rng: np.random.Generator) -> Iterator[Case]:
    """Random inputs (host arrays) and compile options for one catalogue kernel."""
    for tokens, width in ((1, 64), (3, 96), (17, 128)):
        out = int(rng.choice([32, 80, 160]))
        x = _f32(rng, tokens, width)
        if name == "embedding":
            yield (rng.integers(0, 50, tokens).astype(np.int32), _f32(rng, 50, width)), {}
        elif name == "rms_norm":
            yield (x, _f32(rng, width)), {"eps": 1e-5}
        elif name == "rms_norm_heads":
            yield (x, _f32(rng, 32)), {"eps": 1e-6, "head_dim": 32}
            yield (x * 3, _f32(rng, 16)), {"eps": 1e-5, "head_dim": 16}
        elif name == "linear":
            yield (x, _f32(rng, out, width), None), {}
            yield (x, _f32(rng, out, width), _f32(rng, out)), {}
        elif name == "add":
            yield (x, _f32(rng, tokens, width)), {}
        elif name == "slice_columns":
            yield (x,), {"start": 3, "stop": width // 2 + 5}
        elif name == "silu_mul":
            yield (x,), {}
        elif name == "rope":
            head_dim = 32
            inv_freq = (1.0 / 10000 ** (np.arange(0, head_dim, 2) / head_dim)).astype(np.float32)
            positions = rng.integers(0, 4096, tokens).astype(np.int32)
            yield (x, positions, inv_freq), {"head_dim": head_dim}
        elif name == "gather_rows":
            yield (x, rng.integers(0, tokens, 2).astype(np.int32)), {}
        elif name == "argmax":
            yield (x,), {}
        elif name == "softmax":
            yield (x,), {"temperature": 0.7}
        elif name == "top_k":
            yield (x,), {"k": 1}
            yield (np.round(x * 4) / 4,), {"k": 12}  # ties, which go to the lower index
        elif name == "epilogue":
            yield from _epilogue_cases(rng, tokens, width)
        elif name == "rms_norm_linear":
            yield (x, _f32(rng, width), _f32(rng, out, width), _f32(rng, out)), {"eps": 1e-6}
        elif name == "linear_add":
            yield (x, _f32(rng, out, width), _f32(rng, tokens, out)), {}
        elif name == "rms_norm_gate_up_silu":
            yield (x, _f32(rng, width), _f32(rng, 2 * out, width)), {"eps": 1e-6}
        else:
            raise KeyError(name)


def misfit_cases(rng: np.random.Generator) -> Iterator[tuple[str, str, tuple[Any, ...], dict[str, Any]]]:
    """``(kernel, what is wrong, host inputs, options)``: launches whose arguments do not fit together or are of
    the wrong type, which a kernel would read or write past a buffer for. The page-pool kernels' inputs follow a
    pool of :data:`MISFIT_LAYOUT`, which the suite passes before them."""
    x, inv_freq = _f32(rng, 3, 64), np.ones(16, np.float32)
    weight, int32s = _f32(rng, 32, 64), np.zeros((3, 64), np.int32)
    yield "add", "shapes differ", (x, _f32(rng, 3, 60)), {}
    yield "add", "an int32 input", (x, int32s), {}
    yield "silu_mul", "an odd width", (_f32(rng, 3, 63),), {}
    yield "slice_columns", "columns past the width", (x,), {"start": 3, "stop": 70}
    yield "rms_norm", "a weight for fewer columns", (x, _f32(rng, 60)), {"eps": 1e-5}
    yield "rms_norm_heads", "a weight longer than a head", (x, _f32(rng, 64)), {"eps": 1e-5, "head_dim": 32}
    yield "rope", "positions for fewer tokens", (x, np.arange(2, dtype=np.int32), inv_freq), {"head_dim": 32}
    yield "rope", "an int32 x", (int32s, np.arange(3, dtype=np.int32), inv_freq), {"head_dim": 32}
    yield "embedding", "float token ids", (np.zeros(3, np.float32), _f32(rng, 50, 64)), {}
    yield "gather_rows", "float row indices", (x, np.zeros(2, np.float32)), {}
    yield "argmax", "a vector, not rows", (_f32(rng, 64),), {}
    yield "softmax", "an int32 input", (int32s,), {"temperature": 1.0}
    yield "top_k", "k longer than a row", (_f32(rng, 3, 8),), {"k": 12}
    yield "linear", "x wider than the weight", (_f32(rng, 3, 68), weight, None), {}
    yield "linear", "a bias for other rows", (x, weight, _f32(rng, 30)), {}
    yield "rms_norm_linear", "a norm weight for fewer columns", (x, _f32(rng, 60), weight, None), {"eps": 1e-6}
    yield "linear_add", "a residual of fewer tokens", (x, weight, _f32(rng, 2, 32)), {}
    yield "rms_norm_gate_up_silu", "odd gate/up rows", (x, _f32(rng, 64), _f32(rng, 33, 64)), {"eps": 1e-6}
    kv_width = MISFIT_LAYOUT.num_kv_heads * MISFIT_LAYOUT.head_dim
    slots = np.arange(3, dtype=np.int32)
    yield "append_kv", "v for fewer tokens", (_f32(rng, 3, kv_width), _f32(rng, 2, kv_width), slots), {"layer": 0}
    yield "append_kv", "k wider than the pool's heads", (_f32(rng, 3, 2 * kv_width),) * 2 + (slots,), {"layer": 0}
    k = _f32(rng, 3, kv_width)
    yield "append_kv", "a layer the pool does not have", (k, k, slots), {"layer": MISFIT_LAYOUT.num_layers}
    tables = batch_of(rng, MISFIT_LAYOUT.page_size, MISFIT_LAYOUT.num_pages, [(5, 2), (3, 1)])
    options = {"layer": 0, "num_heads": 4, "scale": 0.25}
    q = _f32(rng, 3, 4 * MISFIT_LAYOUT.head_dim)
    yield "attention", "q for other heads", (_f32(rng, 3, 3 * MISFIT_LAYOUT.head_dim), *tables.values()), options
    short = {**tables, "kv_last_page_lens": tables["kv_last_page_lens"][:1]}
    yield "attention", "page tables of different batches", (q, *short.values()), options
    past = {**options, "layer": MISFIT_LAYOUT.num_layers}
    yield "attention", "a layer the pool does not have", (q, *tables.values()), past


MISFIT_LAYOUT = PageLayout(num_layers=1, num_pages=8, page_size=4, num_kv_heads=2, head_dim=16)


WEIGHT_INPUT = {"embedding": 1, "linear": 1, "rms_norm_linear": 2, "linear_add": 1, "rms_norm_gate_up_silu": 2}
"""The position of the weight among each weight-reading kernel's inputs."""


def stored_weight_cases(name: str, weight_type: str, rng: np.random.Generator) -> Iterator[Case]:
    """Random inputs of a weight-reading kernel, its weight a :class:`StoredWeight` of ``weight_type``: one
    token to more than a token block, odd row counts, odd block counts (and for f16 a width that is not a
    multiple of 4)."""
    block = max(WEIGHT_TYPES[weight_type][1], 32)
    shapes = [(1, 2 * block, 7), (3, 5 * block, 37), (9, 3 * block, 130), (17, block, 5)]
    if WEIGHT_TYPES[weight_type][1] == 1:
        shapes.append((2, 38, 9))
    for tokens, width, out in shapes:
        x = _f32(rng, tokens, width)
        write = quantize_k if weight_type in K_TYPES else quantize  # the gguf library writes no K-quant
        stored = lambda rows, width=width, write=write: write(_f32(rng, rows, width), weight_type)  # noqa: E731
        if name == "embedding":
            yield (rng.integers(0, out, tokens + 2).astype(np.int32), stored(out)), {}
        elif name == "linear":
            yield (x, stored(out), None), {}
            yield (x, stored(out), _f32(rng, out)), {}
        elif name == "rms_norm_linear":
            yield (x, _f32(rng, width), stored(out), _f32(rng, out)), {"eps": 1e-6}
        elif name == "linear_add":
            yield (x, stored(out), _f32(rng, tokens, out)), {}
        elif name == "rms_norm_gate_up_silu":
            yield (x, _f32(rng, width), stored(2 * out)), {"eps": 1e-6}
        else:
            raise KeyError(name)


def _cpu_reference(registry: EngineRegistry) -> Device:
    """The CPU engine to compare with: the suite's registry's, or the installed one where the suite's registry
    holds only the engine under test (an emulated device's)."""
    try:
        return registry.engine("cpu").open(0)
    except EngineSelectionError:
        return EngineRegistry().engine("cpu").open(0)


def _epilogue_cases(rng: np.random.Generator, tokens: int, width: int) -> Iterator[Case]:
    from pie.eta.stdlib import SOURCES

    full = lambda: _f32(rng, tokens, width)  # noqa: E731
    yield (full(), full()), {"source": SOURCES["residual_add"], "params": ()}
    yield (full(), full()), {"source": SOURCES["silu_mul"], "params": ()}
    yield (full(), _f32(rng, width)), {"source": SOURCES["bias_add"], "params": ()}
    yield (full() * 40,), {"source": SOURCES["logit_softcap"], "params": (("cap", 30.0),)}
    yield (full(), _f32(rng, width)), {"source": SOURCES["rms_norm"], "params": (("eps", 1e-5),)}
    yield (full(),), {"source": SOURCES["softmax"], "params": ()}
    yield (full(),), {"source": "in x: f32\nparam k: i32\nout y = x * f32(k)\n", "params": (("k", 3),)}


def stand_in(name: str) -> str:
    """What runs in place of catalogue kernel ``name`` (not a page-pool kernel) on an engine that lacks it."""
    if name == "top_k":
        return "the runtime selects tokens on the host instead"
    if not kernels.CATALOG[name].primitive:
        return "Poem runs the primitives it fuses instead"
    return "the runtime runs it on the CPU engine (pie-engine-cpu), with transfers around it"


HEAVY_LIBRARIES = (
    "jax", "jaxlib", "torch", "tensorflow", "wgpu", "vulkan", "cuda", "cupy", "hip", "pyopencl", "Metal", "objc",
)  # fmt: skip
"""Backends an engine may import only inside the hooks that need a device (listing engines stays cheap)."""


def _check_linear_in_every_variant(device: Device, inputs: int, outputs: int, atol: float = TOLERANCE["atol"]) -> None:
    """One token's projection from ``inputs`` to ``outputs`` in each of the device's linear variants, against numpy."""
    rng = np.random.default_rng(inputs * 1_000_003 + outputs)
    x, weight = _f32(rng, 1, inputs), _f32(rng, outputs, inputs)
    expected = kernels.linear(x, weight, None)
    for variant in device.kernels()["linear"]:
        got = device.download(device.compile("linear", variant)(device.upload(x), device.upload(weight), None))
        np.testing.assert_allclose(got, expected, rtol=TOLERANCE["rtol"], atol=atol,
                                   err_msg=f"linear[{variant}] of {inputs:,} inputs to {outputs:,} outputs")


class ConformanceSuite:
    """Subclass with ``engine = "name"`` to run the contract tests on an engine."""

    engine: ClassVar[str] = ""
    registry_factory: ClassVar[Any] = EngineRegistry

    @pytest.fixture(scope="class")
    @classmethod
    def registry(cls) -> EngineRegistry:
        return cls.registry_factory()

    @pytest.fixture(scope="class")
    @classmethod
    def device(cls, registry: EngineRegistry) -> Device:
        cls._require_installed(registry)
        return registry.engine(cls.engine).open(0)

    @classmethod
    def _require_installed(cls, registry: EngineRegistry) -> None:
        if not cls.engine:
            pytest.fail("set `engine = 'name'` on the ConformanceSuite subclass")
        if cls.engine not in registry.names():
            pytest.fail(
                f"no engine {cls.engine!r} is installed (installed: {', '.join(registry.names()) or 'none'}): install "
                f"its distribution (pip install -e .) so that its {ENTRY_POINT_GROUP!r} entry point is found, or set "
                "registry_factory to a function returning a registry that holds it"
            )

    # -- discovery and probing ------------------------------------------------

    def test_engine_is_discovered_and_ok(self, registry: EngineRegistry) -> None:
        self._require_installed(registry)
        status = registry.status(self.engine)
        assert status.status == "ok", status.reason
        assert status.info is not None and status.info.contract_version == CONTRACT_VERSION, status.info
        assert status.info.name == self.engine, f"EngineInfo.name {status.info.name!r} is not the entry point's name"
        assert status.info.kernel_languages, "EngineInfo.kernel_languages is empty"

    def test_importing_the_plugin_imports_no_heavy_library(self) -> None:
        points = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == self.engine]
        if not points:
            pytest.skip(f"{self.engine} is not installed under the entry point group {ENTRY_POINT_GROUP!r}")
        script = (
            "import json, sys\n"
            "from importlib.metadata import EntryPoint\n"
            f"EntryPoint({self.engine!r}, {points[0].value!r}, {ENTRY_POINT_GROUP!r}).load()\n"
            "print(json.dumps(sorted({name.split('.')[0] for name in sys.modules})))\n"
        )
        run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, f"importing {points[0].value} failed:\n{run.stderr}"
        heavy = sorted(set(json.loads(run.stdout.splitlines()[-1])) & set(HEAVY_LIBRARIES))
        assert not heavy, (
            f"importing {points[0].value} imports {', '.join(heavy)}: import backends inside the hooks that need "
            "a device, so that listing engines stays cheap"
        )

    def test_device_description(self, device: Device) -> None:
        info = device.info
        assert isinstance(info, DeviceInfo), f"the device is a {type(info).__name__}, not a DeviceInfo"
        assert info.engine == self.engine, f"DeviceInfo.engine is {info.engine!r}"
        for name in ("name", "vendor", "architecture"):
            assert getattr(info, name), f"DeviceInfo.{name} is empty"
        assert info.memory_bytes >= 0, f"DeviceInfo.memory_bytes is {info.memory_bytes}"
        kinds = ("cpu", "gpu", "integrated-gpu", "virtual-gpu", "tpu", "npu", "other")
        assert info.kind in kinds, f"DeviceInfo.kind {info.kind!r} is not one of {kinds}"

    def test_kernel_listing_uses_catalogue_names(self, device: Device) -> None:
        listed = device.kernels()
        assert listed, "an engine must implement at least one kernel"
        unknown = set(listed) - set(kernels.CATALOG)
        assert not unknown, f"kernels outside the catalogue: {sorted(unknown)}"
        for name, variants in listed.items():
            assert variants and len(set(variants)) == len(variants), f"{name}: variants {variants}"

    # -- kernels ----------------------------------------------------------------

    @pytest.mark.parametrize("name", [n for n in kernels.CATALOG if n not in POOL_KERNELS])
    def test_kernel_matches_reference(self, device: Device, name: str) -> None:
        if not device.supports(name):
            pytest.skip(f"{self.engine} does not implement {name}; {stand_in(name)}")
        for variant in device.kernels()[name]:
            rng = np.random.default_rng(zlib.crc32(f"{name}/{variant}".encode()))
            for inputs, options in kernel_cases(name, rng):
                expected = kernels.REFERENCE[name](*inputs, **options)
                launcher = device.compile(name, variant, **options)
                device_inputs = [None if a is None else device.upload(a) for a in inputs]
                result = launcher(*device_inputs)
                if isinstance(expected, tuple):  # a kernel of several outputs (top_k) returns a tuple
                    pairs = list(zip((device.download(r) for r in result), expected, strict=True))
                else:
                    pairs = [(device.download(result), expected)]
                for got, want in pairs:
                    assert got.shape == want.shape, f"{name}[{variant}] shape {got.shape} != {want.shape}"
                    assert got.dtype == want.dtype, f"{name}[{variant}] dtype {got.dtype} != {want.dtype}"
                    np.testing.assert_allclose(got, want, **TOLERANCE, err_msg=f"{name}[{variant}]")

    def test_misfit_arguments_are_refused_naming_the_kernel(self, device: Device) -> None:
        """A launch whose arguments do not fit (shapes that disagree, int32 where float32 belongs) raises a
        ValueError naming its kernel, in every variant, before any kernel reads or writes past a buffer."""
        pool = device.allocate_pages(MISFIT_LAYOUT)
        try:
            for name, wrong, inputs, options in misfit_cases(np.random.default_rng(7)):
                if not device.supports(name):
                    continue
                arguments = [None if a is None else device.upload(a) for a in inputs]
                if name in POOL_KERNELS:
                    arguments.insert(1 if name == "attention" else 0, pool)
                for variant in device.kernels()[name]:
                    launcher = device.compile(name, variant, **options)
                    try:
                        launcher(*arguments)
                    except ValueError as error:
                        assert name in str(error), f"{name}[{variant}], {wrong}: {error!r} does not name the kernel"
                    else:
                        pytest.fail(f"{name}[{variant}] launched with {wrong}")
        finally:
            device.free_pages(pool)

    def test_kernels_read_weights_as_stored(self, device: Device) -> None:
        """Every weight type the engine declares, for each kernel that reads a weight, in every variant
        (a type it does not declare is converted to float32 before it reaches the engine)."""
        taken = device.weight_types()
        declared = [(n, t) for n in WEIGHT_INPUT for t in WEIGHT_TYPES if t != F32 and t in taken.get(n, ())]
        if not declared:
            pytest.skip(f"{self.engine} reads every weight as float32 (it declares no stored type)")
        for name, weight_type in declared:
            self._check_stored_weight(device, name, weight_type)

    def _check_stored_weight(self, device: Device, name: str, weight_type: str) -> None:
        position = WEIGHT_INPUT[name]
        for variant in device.kernels()[name]:
            rng = np.random.default_rng(zlib.crc32(f"{name}/{variant}/{weight_type}".encode()))
            for inputs, options in stored_weight_cases(name, weight_type, rng):
                weight = inputs[position]
                assert isinstance(weight, StoredWeight)
                dense = list(inputs)
                dense[position] = weight.dequantize()
                expected = kernels.REFERENCE[name](*dense, **options)
                device_inputs = [
                    device.upload_weights([a])[0] if i == position else None if a is None else device.upload(a)
                    for i, a in enumerate(inputs)
                ]
                got = device.download(device.compile(name, variant, **options)(*device_inputs))
                assert got.shape == expected.shape, f"{name}[{variant}] on {weight_type}: shape {got.shape}"
                # Relative to the outputs' scale too: an engine may round activations to integers per block
                # (the CPU engine's default for short passes), off by about 1e-5 of the largest output.
                within = TOLERANCE["atol"] * max(1.0, float(np.abs(expected).max()))
                message = f"{name}[{variant}] on {weight_type}"
                np.testing.assert_allclose(got, expected, rtol=TOLERANCE["rtol"], atol=within, err_msg=message)

    def test_tiny_stored_models_match_their_float32_copies(
        self, registry: EngineRegistry, device: Device, tmp_path: Any
    ) -> None:
        """A Q8_0 and a Q4_1 GGUF run as stored, with the greedy tokens of their float32 copies on the CPU
        engine (each type the engine declares for its projections)."""
        declared = [t for t in ("q8_0", "q4_1") if t in device.weight_types().get("linear", ())]
        if not declared:
            pytest.skip(f"{self.engine} declares neither q8_0 nor q4_1 weights")
        for weight_type in declared:
            self._check_tiny_stored_model(registry, device, weight_type, tmp_path / weight_type)

    def _check_tiny_stored_model(self, registry: EngineRegistry, device: Device, weight_type: str, folder: Any) -> None:
        from pie.model import load_model
        from pie.runtime.model_runner import ModelRunner, SequenceWork
        from pie.testing.models import make_gguf_model

        folder.mkdir()
        loaded = load_model(make_gguf_model(folder / "m.gguf", weight_type.upper(), tie_word_embeddings=True))
        runners = [
            ModelRunner(loaded.config, tensors, on, page_size=4, max_cached_tokens=256)
            for tensors, on in ((loaded.stored_tensors(), device), (loaded.tensors(), _cpu_reference(registry)))
        ]
        try:
            choices = runners[0].weight_choices.values()
            converted = [f"{c.name}: {c.stored} -> {c.uploaded}" for c in choices if c.converted]
            assert not converted, f"weights converted at load: {converted}"
            rng = np.random.default_rng(3)
            prompts = [[int(t) for t in rng.integers(0, loaded.config.vocab_size, n)] for n in (11, 6)]
            texts = []
            for runner in runners:
                sequences = [runner.new_sequence() for _ in prompts]
                logits = runner.step([SequenceWork(s, p) for s, p in zip(sequences, prompts, strict=True)])
                tokens = []
                for _ in range(6):
                    tokens.append([int(np.argmax(row)) for row in logits])
                    work = [SequenceWork(s, [t]) for s, t in zip(sequences, tokens[-1], strict=True)]
                    logits = runner.step(work)
                texts.append(tokens)
            assert texts[0] == texts[1], f"greedy tokens as stored {texts[0]}, of the float32 copy {texts[1]}"
        finally:
            for runner in runners:
                runner.close()

    @pytest.mark.parametrize("page_size", [4, 16])
    @pytest.mark.parametrize("decode", [False, True], ids=["mixed", "decode"])
    def test_append_kv_and_attention_through_page_tables(self, device: Device, page_size: int, decode: bool) -> None:
        lacking = [name for name in POOL_KERNELS if not device.supports(name)]
        if lacking:
            pytest.fail(
                f"{self.engine} does not implement {' and '.join(lacking)}: these work on the engine's own page "
                "pool, so they cannot run on the CPU engine, and without them the engine cannot run a model"
            )
        rng = np.random.default_rng(page_size)
        layout = PageLayout(num_layers=2, num_pages=24, page_size=page_size, num_kv_heads=2, head_dim=16)
        num_heads, layer = 4, 1
        host_pool = _f32(rng, *layout.shape)
        pool = device.allocate_pages(layout)
        try:
            device.write_pages(pool, np.arange(layout.num_pages, dtype=np.int32), host_pool)
            batch = random_batch(rng, page_size, layout.num_pages, max_seqs=4 if decode else 3, decode=decode)
            tokens = int(batch["qo_indptr"][-1])
            kv_width = layout.num_kv_heads * layout.head_dim
            k, v = _f32(rng, tokens, kv_width), _f32(rng, tokens, kv_width)
            slots = new_token_slots(batch, page_size)
            kernels.append_kv(host_pool, k, v, slots, layer=layer)
            q = _f32(rng, tokens, num_heads * layout.head_dim)
            expected = kernels.attention(q, host_pool, **batch, layer=layer, num_heads=num_heads, scale=0.25)
            for variant in device.kernels()["append_kv"]:
                append = device.compile("append_kv", variant, layer=layer)
                append(pool, device.upload(k), device.upload(v), device.upload(slots))
            read_back = device.read_pages(pool, np.arange(layout.num_pages, dtype=np.int32))
            np.testing.assert_array_equal(
                np.asarray(read_back), host_pool, err_msg="the pool after append_kv differs from the reference's"
            )
            uploaded = {key: device.upload(value) for key, value in batch.items()}
            for variant in device.kernels()["attention"]:
                attend = device.compile("attention", variant, layer=layer, num_heads=num_heads, scale=0.25)
                got = device.download(
                    attend(
                        device.upload(q),
                        pool,
                        uploaded["qo_indptr"],
                        uploaded["kv_page_indices"],
                        uploaded["kv_page_indptr"],
                        uploaded["kv_last_page_lens"],
                    )
                )
                np.testing.assert_allclose(got, expected, **TOLERANCE, err_msg=f"attention[{variant}]")
        finally:
            device.free_pages(pool)

    @pytest.mark.parametrize("batch_name", sorted(ATTENTION_OPTION_BATCHES))
    @pytest.mark.parametrize("option_name", sorted(ATTENTION_OPTIONS))
    def test_attention_window_and_softcap(self, device: Device, batch_name: str, option_name: str) -> None:
        """Sliding windows shorter than the prompts and logit soft-capping, alone and together, on 4-token
        pages, ragged batches of prefill and decode rows, 6 query heads on 2 KV heads, in every variant."""
        options = {"layer": 1, "num_heads": 6, "scale": 0.25, **ATTENTION_OPTIONS[option_name]}
        rng = np.random.default_rng(zlib.crc32(f"{batch_name}/{option_name}".encode()))
        for head_dim in (16, 64):
            q, host_pool, batch = self._attention_inputs(rng, ATTENTION_OPTION_BATCHES[batch_name], head_dim)
            expected = kernels.attention(q, host_pool, **batch, **options)
            unmasked = kernels.attention(q, host_pool, **batch, layer=1, num_heads=6, scale=0.25)
            assert not np.allclose(expected, unmasked, **TOLERANCE), "the case does not exercise the options"
            for variant, got in self._attend_each_variant(device, q, host_pool, batch, options):
                np.testing.assert_allclose(got, expected, **TOLERANCE, err_msg=f"attention[{variant}] {options}")

    def test_attention_window_covering_every_key_is_no_window(self, device: Device) -> None:
        rng = np.random.default_rng(11)
        q, host_pool, batch = self._attention_inputs(rng, ATTENTION_OPTION_BATCHES["mixed"], 16)
        plain = {"layer": 1, "num_heads": 6, "scale": 0.25}
        expected = kernels.attention(q, host_pool, **batch, **plain)
        for window in (22, 23, 1000):
            for variant, got in self._attend_each_variant(device, q, host_pool, batch, {**plain, "window": window}):
                np.testing.assert_allclose(got, expected, **TOLERANCE,
                                           err_msg=f"attention[{variant}] with window {window} >= every length")

    @staticmethod
    def _attention_inputs(
        rng: np.random.Generator, lengths: list[tuple[int, int]], head_dim: int
    ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        layout = PageLayout(num_layers=2, num_pages=32, page_size=4, num_kv_heads=2, head_dim=head_dim)
        batch = batch_of(rng, layout.page_size, layout.num_pages, lengths)
        q = _f32(rng, int(batch["qo_indptr"][-1]), 6 * head_dim)
        return q, _f32(rng, *layout.shape), batch

    @staticmethod
    def _attend_each_variant(
        device: Device, q: np.ndarray, host_pool: np.ndarray, batch: dict[str, np.ndarray], options: dict[str, Any]
    ) -> Iterator[tuple[str, np.ndarray]]:
        if not device.supports("attention"):
            pytest.fail(f"{device.info.engine} does not implement attention")
        _, num_pages, _, page_size, kv_heads, head_dim = host_pool.shape
        layout = PageLayout(num_layers=host_pool.shape[0], num_pages=num_pages, page_size=page_size,
                            num_kv_heads=kv_heads, head_dim=head_dim)
        pool = device.allocate_pages(layout)
        try:
            device.write_pages(pool, np.arange(num_pages, dtype=np.int32), host_pool)
            uploaded = [device.upload(batch[key]) for key in
                        ("qo_indptr", "kv_page_indices", "kv_page_indptr", "kv_last_page_lens")]
            for variant in device.kernels()["attention"]:
                attend = device.compile("attention", variant, **options)
                yield variant, device.download(attend(device.upload(q), pool, *uploaded))
        finally:
            device.free_pages(pool)

    def test_attention_over_a_long_sequence(self, device: Device) -> None:
        """One decode row over 2,500 keys beside a short sequence, in every variant, with and without the pass's plan
        handed over: a software device caps a shader invocation's loop iterations (llvmpipe: 65,535), and a variant
        that walks a sequence's keys in one invocation gave wrong output past about 1,870 keys at head_dim 64."""
        self._check_long_decode(device, 2500, 64, 6, 2, {}, (False, True))

    def test_attention_over_a_window_of_25_000_keys(self, device: Device) -> None:
        """One decode row of one head at head_dim 128 over the last 25,000 of its 26,000 keys (with a softcap) beside a
        short sequence, in every variant, in a planned pass: a variant sharing a sequence's keys among a workgroup's
        64 invocations, still capped by llvmpipe, gave wrong output past 20,032 keys at head_dim 128 (12,416 at 256,
        28,919 at 64). One head keeps it short (an emulator); head_dim 128 is the most every device takes (Metal's
        16-lane simdgroups decode at most 128)."""
        self._check_long_decode(device, 26_000, 128, 1, 1, {"window": 25_000, "softcap": 30.0}, (True,))

    def _check_long_decode(
        self,
        device: Device,
        kv_len: int,
        head_dim: int,
        num_heads: int,
        kv_heads: int,
        extra: dict[str, Any],
        plans: tuple[bool, ...],
    ) -> None:
        """One decode row over ``kv_len`` keys beside a 9-key one, in every variant, with the pass's plan handed over
        (True in ``plans``) and without (False)."""
        rng = np.random.default_rng(kv_len)
        page_size, lengths = 16, [(kv_len, 1), (9, 1)]  # (kv_len, q_len)
        pages = sum(-(-kv // page_size) for kv, _ in lengths)
        layout = PageLayout(num_layers=1, num_pages=pages, page_size=page_size, num_kv_heads=kv_heads,
                            head_dim=head_dim)
        batch = batch_of(rng, page_size, pages, lengths)
        q = _f32(rng, len(lengths), num_heads * head_dim)
        host_pool = _f32(rng, *layout.shape)
        options = {"layer": 0, "num_heads": num_heads, "scale": head_dim**-0.5, **extra}
        expected = kernels.attention(q, host_pool, **batch, **options)
        kv_lens = [kv for kv, _ in lengths]
        slots = np.array([batch["kv_page_indices"][batch["kv_page_indptr"][i] + (kv - 1) // page_size] * page_size
                          + (kv - 1) % page_size for i, kv in enumerate(kv_lens)], np.int32)
        plan = PassPlan.from_batch(ids=np.zeros(len(lengths), np.int32), positions=np.array(kv_lens, np.int32) - 1,
                                   slots=slots, sample_rows=np.arange(len(lengths), dtype=np.int32),
                                   page_size=page_size, num_pages=pages, **batch)
        for planned in plans:
            if planned:
                device.begin_pass(plan)
            try:
                for variant, got in self._attend_each_variant(device, q, host_pool, batch, options):
                    where = f"attention[{variant}] over {kv_len:,} keys {extra}, plan {planned}"
                    np.testing.assert_allclose(got, expected, **TOLERANCE, err_msg=where)
            finally:
                if planned:
                    device.end_pass()

    def test_top_k_over_a_wide_vocabulary(self, device: Device) -> None:
        """The most tokens device sampling asks for (256) of two rows as wide as Qwen's vocabulary: a software device
        caps a shader invocation's loop iterations (llvmpipe: 65,535), and a kernel taking the k picks in one
        invocation's rounds gave wrong indices from k = 110 here."""
        if not device.supports("top_k"):
            pytest.skip(f"{device.info.engine} has no top_k: {stand_in('top_k')}")
        x = _f32(np.random.default_rng(151936), 2, 151936)
        expected = kernels.top_k(x, k=256)
        values, indices = device.compile("top_k", k=256)(device.upload(x))
        np.testing.assert_array_equal(device.download(indices), expected[1], err_msg="top_k's indices")
        np.testing.assert_array_equal(device.download(values), expected[0], err_msg="top_k's values")

    def test_linear_over_262_144_inputs(self, device: Device) -> None:
        """One output of one token over 262,144 inputs, in every variant: a software device caps a shader invocation's
        loop iterations (llvmpipe: 65,535), and variants walking a weight row in one invocation gave wrong output,
        by float4s from 262,144 inputs, by tiles of 16 from 58,256 (wgpu's shaders)."""
        _check_linear_in_every_variant(device, inputs=262144, outputs=1, atol=TOLERANCE["atol"] * 512)

    def test_linear_to_262_144_outputs(self, device: Device) -> None:
        """One token projected to 262,144 outputs (Gemma 3's vocabulary), in every variant: a variant computing a few
        columns a workgroup needs more workgroups than a grid dimension holds (Vulkan and WebGPU: 65,535)."""
        _check_linear_in_every_variant(device, inputs=16, outputs=262144)

    def test_linear_of_15_inputs_to_262_144_outputs(self, device: Device) -> None:
        """As above over 15 inputs, which no float4 view holds: the Slang launchers' rows variants, which take over
        from gemv past 65,535 workgroups, cannot run them."""
        _check_linear_in_every_variant(device, inputs=15, outputs=262144)

    def test_logits_of_more_rows_than_a_storage_binding_holds(self, device: Device) -> None:
        """129 rows projected to Gemma 3's 262,144-word vocabulary, then argmax and top_k over them: 129 MiB of float32
        logits, past the 128 MiB one storage binding holds on lavapipe and by WebGPU's default, which a prefill asking
        for every token's logits or a batch of 129 decode rows needs; the Slang launchers refused them."""
        rng = np.random.default_rng(129)
        x, weight = _f32(rng, 129, 4), _f32(rng, 262144, 4)
        logits = device.compile("linear")(device.upload(x), device.upload(weight), None)
        got = device.download(logits)
        for first in range(0, 129, 43):  # a third of the rows at a time, each with its float64 reference
            np.testing.assert_allclose(got[first : first + 43], kernels.linear(x[first : first + 43], weight, None),
                                       **TOLERANCE, err_msg=f"linear's logits of rows {first} to {first + 42}")
        if device.supports("argmax"):
            np.testing.assert_array_equal(device.download(device.compile("argmax")(logits)), kernels.argmax(got))
        if device.supports("top_k"):
            values, indices = device.compile("top_k", k=4)(logits)
            values, indices = device.download(values), device.download(indices).astype(np.int64)
            # Four distinct columns, their values in order, and no more than three values above the fourth: a top 4
            # (kernels.top_k sorts whole rows, seconds here).
            np.testing.assert_array_equal(values, np.take_along_axis(got, indices, axis=-1), err_msg="top_k")
            assert (np.diff(values, axis=-1) <= 0).all() and (np.diff(np.sort(indices), axis=-1) > 0).all()
            assert ((got > values[:, 3:]).sum(axis=-1) <= 3).all(), "top_k missed a larger value"

    def test_a_vocabulary_past_a_storage_binding_is_embedded_and_projected(self, device: Device) -> None:
        """An embedding of Gemma 3's 262,144 words in rows of 132 float32 (132 MiB; Gemma 3 270M's takes 640 MiB, or
        170 MiB in Q8_0), past the 128 MiB one storage binding holds on lavapipe and by WebGPU's default: ids from
        both ends of it, and three rows projected by it (a tied head). The Slang engines refused the weight."""
        rng = np.random.default_rng(262144)
        table, x = _f32(rng, 262144, 132), _f32(rng, 3, 132)
        [uploaded] = device.upload_weights([table])
        if device.supports("embedding"):
            ids = np.array([0, 262143, 131072, 254200, 7], np.int32)
            got = device.download(device.compile("embedding")(device.upload(ids), uploaded))
            np.testing.assert_array_equal(got, table[ids], err_msg="embedding")
        logits = device.download(device.compile("linear")(device.upload(x), uploaded, None))
        np.testing.assert_allclose(logits, kernels.linear(x, table, None), **TOLERANCE, err_msg="linear")

    def test_attention_options_out_of_range_are_clear_errors(self, device: Device) -> None:
        for bad, match in (({"window": -1}, "window"), ({"window": 2.5}, "window"), ({"softcap": -3.0}, "softcap")):
            with pytest.raises((EngineError, ValueError), match=match):
                variant = device.kernels()["attention"][0]
                device.compile("attention", variant, layer=0, num_heads=2, scale=0.5, **bad)

    def test_kv_dtypes_are_listed_with_float32(self, device: Device) -> None:
        listed = device.kv_dtypes()
        assert "float32" in listed, f"{self.engine} lists KV page types {listed} without float32"
        unknown = [dtype for dtype in listed if dtype not in KV_DTYPES]
        assert not unknown, f"{self.engine} lists KV page types {unknown}, none of {KV_DTYPES}"

    @pytest.mark.parametrize("page_size", [4, 16])
    @pytest.mark.parametrize("decode", [False, True], ids=["mixed", "decode"])
    def test_narrow_kv_pages_attend_as_their_rounded_values(self, device: Device, page_size: int, decode: bool) -> None:
        """In each KV page type besides float32 the engine lists: append_kv rounds to nearest even, and
        attention (decode and prefill rows, several pages, 6 query heads on 2 KV heads) equals float32
        attention over the rounded keys and values, and is near attention over the unrounded ones."""
        narrow = [dtype for dtype in device.kv_dtypes() if dtype != "float32"]
        if not narrow:
            pytest.skip(f"{self.engine} keeps KV pages in float32 only")
        for dtype in narrow:
            self._check_narrow_kv_attention(device, dtype, page_size, decode)

    def _check_narrow_kv_attention(self, device: Device, dtype: str, page_size: int, decode: bool) -> None:
        host_dtype = kv_host_dtype(dtype)
        rng = np.random.default_rng(zlib.crc32(f"{dtype}/{page_size}/{decode}".encode()))
        layout = PageLayout(num_layers=2, num_pages=24, page_size=page_size, num_kv_heads=2, head_dim=32, dtype=dtype)
        num_heads, layer, kv_width = 6, 1, layout.num_kv_heads * layout.head_dim
        exact_pool = _f32(rng, *layout.shape)
        host_pool = exact_pool.astype(host_dtype)
        rounded_pool = host_pool.astype(np.float32)
        batch = random_batch(rng, page_size, layout.num_pages, max_seqs=4 if decode else 3, decode=decode)
        tokens = int(batch["qo_indptr"][-1])
        k, v = _f32(rng, tokens, kv_width), _f32(rng, tokens, kv_width)
        slots = new_token_slots(batch, page_size)
        kernels.append_kv(exact_pool, k, v, slots, layer=layer)
        kernels.append_kv(rounded_pool, k.astype(host_dtype).astype(np.float32), v.astype(host_dtype).astype(np.float32),
                          slots, layer=layer)
        q = _f32(rng, tokens, num_heads * layout.head_dim)
        options = {"layer": layer, "num_heads": num_heads, "scale": 0.25}
        rounded = kernels.attention(q, rounded_pool, **batch, **options)
        exact = kernels.attention(q, exact_pool, **batch, **options)
        uploaded = {key: device.upload(value) for key, value in batch.items()}
        every = np.arange(layout.num_pages, dtype=np.int32)
        for append_variant in device.kernels()["append_kv"]:
            pool = device.allocate_pages(layout)
            try:
                device.write_pages(pool, every, host_pool)
                device.compile("append_kv", append_variant, layer=layer)(
                    pool, device.upload(k), device.upload(v), device.upload(slots)
                )
                read_back = np.asarray(device.read_pages(pool, every))
                assert read_back.dtype == host_dtype, f"read_pages of a {dtype} pool returned {read_back.dtype}"
                np.testing.assert_array_equal(
                    read_back.astype(np.float32), rounded_pool,
                    err_msg=f"a {dtype} pool after append_kv[{append_variant}] holds other than the rounded keys and values",
                )
                for variant in device.kernels()["attention"]:
                    got = device.download(
                        device.compile("attention", variant, **options)(
                            device.upload(q), pool, uploaded["qo_indptr"], uploaded["kv_page_indices"],
                            uploaded["kv_page_indptr"], uploaded["kv_last_page_lens"],
                        )
                    )
                    message = f"attention[{variant}] over a {dtype} pool"
                    np.testing.assert_allclose(got, rounded, **TOLERANCE, err_msg=message)
                    loose = NARROW_KV_TOLERANCE[dtype]
                    np.testing.assert_allclose(got, exact, rtol=loose, atol=loose * float(np.abs(exact).max()),
                                               err_msg=f"{message}, against the unrounded keys and values")
            finally:
                device.free_pages(pool)

    def test_narrow_kv_pages_round_trip_and_copy_exactly(self, device: Device) -> None:
        narrow = [dtype for dtype in device.kv_dtypes() if dtype != "float32"]
        if not narrow:
            pytest.skip(f"{self.engine} keeps KV pages in float32 only")
        for dtype in narrow:
            layout = PageLayout(num_layers=3, num_pages=8, page_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
            pool = device.allocate_pages(layout)
            try:
                every = np.arange(layout.num_pages, dtype=np.int32)
                zeros = np.asarray(device.read_pages(pool, every))
                assert zeros.dtype == kv_host_dtype(dtype), f"read_pages of a {dtype} pool returned {zeros.dtype}"
                assert not zeros.astype(np.float32).any(), f"pie_allocate_pages of {dtype} must zero-fill"
                data = np.random.default_rng(4).standard_normal(layout.shape).astype(kv_host_dtype(dtype))
                device.write_pages(pool, every, data)
                np.testing.assert_array_equal(
                    np.asarray(device.read_pages(pool, every)).view(np.uint16), data.view(np.uint16),
                    err_msg=f"{dtype} pages read back differ from those written",
                )
                sources, destinations = np.array([5, 1], dtype=np.int32), np.array([2, 7], dtype=np.int32)
                device.copy_pages(pool, sources, destinations)
                expected = data.copy()
                expected[:, destinations] = data[:, sources]
                np.testing.assert_array_equal(
                    np.asarray(device.read_pages(pool, every)).view(np.uint16), expected.view(np.uint16),
                    err_msg=f"after copying {dtype} pages 5, 1 onto 2, 7 the pool is not the pages before with those copied",
                )
            finally:
                device.free_pages(pool)

    # -- pass plans (pie_begin_pass) ------------------------------------------

    def test_pass_plans_change_no_logit(self, registry: EngineRegistry, device: Device, monkeypatch: Any) -> None:
        """A tiny Llama's ragged prefill, decode-only passes and a mixed pass give, with each pass's plan
        handed to the engine (``ModelRunner`` does), the logits they give with no plan handed over."""
        from pie.runtime.model_runner import ModelRunner, SequenceWork
        from pie.testing.models import random_weights, tiny_config

        planless = registry.engine(self.engine).open(device.info.index)
        monkeypatch.setattr(planless, "begin_pass", lambda plan: None)
        monkeypatch.setattr(planless, "end_pass", lambda: None)
        config = tiny_config()
        weights = random_weights(config, seed=5)
        runners = [ModelRunner(config, weights.items(), on, page_size=4, max_cached_tokens=256) for on in (device, planless)]
        try:
            rng = np.random.default_rng(6)
            tokens = lambda n: [int(t) for t in rng.integers(0, config.vocab_size, n)]  # noqa: E731
            prompts = [tokens(n) for n in (7, 3, 12)]
            later = tokens(5)
            passes = [("ragged", {0: prompts[0], 1: prompts[1], 2: prompts[2]})]
            passes += [(f"decode {step}", {0: tokens(1), 1: tokens(1), 2: tokens(1)}) for step in range(3)]
            passes += [("mixed", {0: tokens(1), 1: later, 3: tokens(9)})]
            sequences: list[dict[int, Any]] = [{}, {}]
            for kind, work in passes:
                got = []
                for runner, held in zip(runners, sequences, strict=True):
                    items = [SequenceWork(held.setdefault(i, runner.new_sequence()), t) for i, t in work.items()]
                    batch = runner.prepare(items)
                    plan = batch.plan
                    assert plan is not None and plan.decode_only == kind.startswith("decode"), (
                        f"the {kind} pass's plan says decode_only={plan and plan.decode_only}"
                    )
                    got.append(runner.forward(batch))
                np.testing.assert_allclose(
                    got[0], got[1], **TOLERANCE, err_msg=f"the {kind} pass with its plan handed to {self.engine}"
                )
        finally:
            for runner in runners:
                runner.close()

    # -- pages and buffers ------------------------------------------------------

    def test_pages_start_zeroed_and_round_trip(self, device: Device) -> None:
        layout = PageLayout(num_layers=3, num_pages=8, page_size=4, num_kv_heads=1, head_dim=8)
        pool = device.allocate_pages(layout)
        try:
            ids = np.array([5, 1, 6], dtype=np.int32)
            zeros = np.asarray(device.read_pages(pool, ids))
            assert zeros.shape == (3, 3, 2, 4, 1, 8), f"read_pages of 3 pages returned shape {zeros.shape}"
            assert not zeros.any(), f"pie_allocate_pages must zero-fill: {np.count_nonzero(zeros)} values are not 0"
            data = np.random.default_rng(0).standard_normal(zeros.shape).astype(np.float32)
            device.write_pages(pool, ids, data)
            np.testing.assert_array_equal(
                np.asarray(device.read_pages(pool, ids)), data, err_msg="pages read back differ from those written"
            )
            untouched = np.asarray(device.read_pages(pool, np.array([0, 2, 3, 4, 7], dtype=np.int32)))
            assert not untouched.any(), "writing pages changed other pages"
        finally:
            device.free_pages(pool)

    def test_pages_copy_within_the_pool(self, device: Device) -> None:
        layout = PageLayout(num_layers=3, num_pages=8, page_size=4, num_kv_heads=2, head_dim=8)
        pool = device.allocate_pages(layout)
        try:
            every = np.arange(layout.num_pages, dtype=np.int32)
            data = np.random.default_rng(3).standard_normal(layout.shape).astype(np.float32)
            device.write_pages(pool, every, data)
            sources, destinations = np.array([5, 1], dtype=np.int32), np.array([2, 7], dtype=np.int32)
            device.copy_pages(pool, sources, destinations)
            expected = data.copy()
            expected[:, destinations] = data[:, sources]
            np.testing.assert_array_equal(
                np.asarray(device.read_pages(pool, every)), expected,
                err_msg="after copying pages 5, 1 onto 2, 7 the pool is not the pages before with those copied",
            )
        finally:
            device.free_pages(pool)

    @pytest.mark.parametrize("dtype", ["float32", "int32"])
    def test_upload_download_round_trip(self, device: Device, dtype: str) -> None:
        host = (np.arange(60).reshape(6, 10) * 3 - 7).astype(dtype)
        back = device.download(device.upload(host))
        assert back.dtype == host.dtype, f"uploaded {host.dtype}, downloaded {back.dtype}"
        np.testing.assert_array_equal(back, host, err_msg="a tensor changed on its way to the device and back")

    def test_kernel_results_download_row_major(self, device: Device) -> None:
        rng = np.random.default_rng(7)
        x = rng.standard_normal((5, 24), dtype=np.float32)
        weight = rng.standard_normal((40, 24), dtype=np.float32)
        back = device.download(device.compile("linear")(device.upload(x), device.upload(weight), None))
        assert back.flags.c_contiguous, f"pie_download must return a row-major array, not strides {back.strides}"
        np.testing.assert_allclose(back, x @ weight.T, **TOLERANCE, err_msg="linear after download")

    # -- errors -------------------------------------------------------------------

    def test_unknown_kernel_is_a_clear_error(self, device: Device) -> None:
        with pytest.raises(EngineError, match="no_such_kernel"):
            device.compile("no_such_kernel")

    def test_unknown_variant_is_a_clear_error(self, device: Device) -> None:
        name = next(iter(device.kernels()))
        with pytest.raises(EngineError, match="no-such-variant"):
            device.compile(name, "no-such-variant")

    def test_compiled_launchers_are_cached(self, device: Device) -> None:
        name = next(n for n in device.kernels() if n in ("gather_rows", "argmax", "add", "linear", "embedding"))
        assert device.compile(name) is device.compile(name), f"compiling {name} twice gave two launchers"


def new_token_slots(batch: dict[str, np.ndarray], page_size: int) -> np.ndarray:
    slots = []
    for b in range(len(batch["qo_indptr"]) - 1):
        pages = batch["kv_page_indices"][batch["kv_page_indptr"][b] : batch["kv_page_indptr"][b + 1]]
        kv_len = (len(pages) - 1) * page_size + int(batch["kv_last_page_lens"][b])
        q_len = int(batch["qo_indptr"][b + 1] - batch["qo_indptr"][b])
        for pos in range(kv_len - q_len, kv_len):
            slots.append(int(pages[pos // page_size]) * page_size + pos % page_size)
    return np.asarray(slots, dtype=np.int32)


def plan_of_batch(batch: dict[str, np.ndarray], page_size: int) -> PassPlan:
    """The pass plan of an attention batch (as :func:`random_batch` makes): token ids 0, each new token at
    its position after the cached ones, every sequence's last token sampled."""
    qo_indptr = batch["qo_indptr"]
    q_lens = np.diff(qo_indptr)
    page_counts = np.diff(batch["kv_page_indptr"])
    kv_lens = np.where(page_counts > 0, (page_counts - 1) * page_size + batch["kv_last_page_lens"], 0)
    first = np.repeat(kv_lens - q_lens - qo_indptr[:-1], q_lens)
    tokens = int(qo_indptr[-1])
    return PassPlan.from_batch(
        ids=np.zeros(tokens, np.int32), positions=(first + np.arange(tokens)).astype(np.int32),
        slots=new_token_slots(batch, page_size), sample_rows=(qo_indptr[1:][q_lens > 0] - 1).astype(np.int32),
        page_size=page_size, **batch,
    )
