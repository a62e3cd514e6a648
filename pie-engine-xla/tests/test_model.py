"""The XLA engine against the CPU engine on small random models (one device, in process)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from pie.contract import KernelRequest
from pie.plugins import Device, EngineRegistry, EngineSettingError
from pie.reports import emit_sources
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.testing.model_parity import ModelParitySuite
from pie.testing.models import random_weights
from xla_helpers import compare_engines, pool_contents, sharding_config

from pie_engine_xla.tensors import bucket

TOLERANCE = 1e-4


class TestXlaModels(ModelParitySuite):
    """Every architecture (pie.models) against the CPU engine."""

    engine = "xla"


@pytest.fixture(scope="module")
def xla() -> Device:
    return EngineRegistry().engine("xla").open(0)


def test_logits_match_cpu_through_ragged_prefill_fork_and_decode() -> None:
    result = compare_engines(sharding_config(), prompt_lengths=(7, 3), decode_steps=6, fork=True)
    try:
        assert len(result.steps) == 7
        assert result.steps[-1][1].shape == (3, 400)
        assert result.max_error < TOLERANCE
        # Padded rows (10 prefill tokens run as 16, 3 decode tokens as 4) wrote nothing: the pools agree.
        xla_pool, cpu_pool = pool_contents(result.runners["xla"]), pool_contents(result.runners["cpu"])
        np.testing.assert_allclose(xla_pool, cpu_pool, atol=1e-5)
    finally:
        result.close()


def test_decode_compiles_only_when_a_bucket_is_crossed(xla: Device) -> None:
    # Shapes no other test uses, so every executable this test needs is compiled here; o and down
    # are both [48, 128], so attn_out and mlp_out share one executable.
    config = sharding_config(hidden_size=48, num_layers=3)
    runner = ModelRunner(config, random_weights(config).items(), xla, page_size=4, max_cached_tokens=512)
    try:
        sequence = runner.new_sequence()
        logits = runner.step([SequenceWork(sequence, [5, 9, 11, 2, 7])])
        programs = {inspect.unwrap(step.launcher).program for step in runner.plan.steps}
        assert len(programs) <= 6 < len(runner.plan.steps), "layers should share compiled programs"
        attention = next(inspect.unwrap(s.launcher).program for s in runner.plan.steps if s.region == "L0.attention")
        before = {p: p.compiles for p in programs}
        crossed: set[int] = set()
        compiling_steps = 0
        for _ in range(64):
            total = sum(p.compiles for p in programs)
            logits = runner.step([SequenceWork(sequence, [int(np.argmax(logits[0]))])])
            crossed.add(bucket(len(sequence.pages)))
            compiling_steps += sum(p.compiles for p in programs) > total
        new = {p: p.compiles - before[p] for p in programs}
        assert crossed == {2, 4, 8, 16, 32}  # 6..69 tokens in pages of 4
        assert compiling_steps == len(crossed)
        assert new[attention] == len(crossed)
        assert all(count <= 1 for p, count in new.items() if p is not attention), new
        assert sum(new.values()) <= len(crossed) + len(programs) - 1
    finally:
        runner.close()


def test_stablehlo_of_every_region_is_emitted(xla: Device, tmp_path: Path) -> None:
    config = sharding_config()
    runner = ModelRunner(config, random_weights(config).items(), xla, page_size=4, max_cached_tokens=64)
    try:
        assert all(step.whole_region for step in runner.plan.steps)
        assert "whole region" in runner.plan.describe()
        sequence = runner.new_sequence()
        runner.step([SequenceWork(sequence, [1, 2, 3])])
        written = emit_sources(runner.plan, str(tmp_path))
        assert written == len(runner.plan.steps)
        texts = {path.name: path.read_text() for path in tmp_path.iterdir()}
        assert all("func.func public @main" in text and "stablehlo." in text for text in texts.values())
        attention = next(text for name, text in texts.items() if "L1.attention" in name)
        assert "stablehlo.scatter" in attention  # the KV write
        assert "tf.aliasing_output" in attention  # the donated pool is updated in place
        head = next(text for name, text in texts.items() if "head" in name)
        # 3 tokens run as a bucket of 4; one sampled row of 400 logits comes out.
        assert "stablehlo.dot_general" in head and "tensor<4x64xf32>" in head and "-> (tensor<1x400xf32>" in head
        # Donation really is in place: decoding never moves the pool.
        address = runner.pages.handle.array.unsafe_buffer_pointer()
        runner.step([SequenceWork(sequence, [4])])
        runner.step([SequenceWork(sequence, [5])])
        assert runner.pages.handle.array.unsafe_buffer_pointer() == address
    finally:
        runner.close()


def test_probe_reports_the_pjrt_platform(xla: Device) -> None:
    extra = dict(xla.info.extra)
    assert extra["platform"] == "cpu" and xla.info.kind == "cpu"
    assert extra["device_kind"] == xla.info.architecture
    assert int(extra["mesh_devices"]) >= 1
    assert "PJRT cpu" in xla.info.driver and xla.info.memory_bytes > 0


def test_diagnosis_is_healthy() -> None:
    found = EngineRegistry().diagnoses(["xla"])["xla"]
    assert found and all(d.ok for d in found), found
    assert any("PJRT" in d.what for d in found)


def test_engine_info_imports_no_jax_and_ranks_by_platform() -> None:
    code = (
        "import sys; from pie_engine_xla import plugin; info = plugin.pie_engine_info(); "
        "print(info.priority, 'jax' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    cpu, tpu = (
        subprocess.run([sys.executable, "-c", code], env={**env, "JAX_PLATFORMS": p}, capture_output=True, text=True)
        for p in ("cpu", "tpu")
    )
    assert cpu.stdout.split() == ["-10", "False"], cpu.stderr  # below the CPU engine (0): it stays the default
    assert tpu.stdout.split() == ["100", "False"], tpu.stderr


def test_device_count_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from pie_engine_xla.mesh import mesh_devices

    monkeypatch.setenv("PIE_XLA_DEVICES", "64")
    with pytest.raises(EngineSettingError, match="xla_force_host_platform_device_count"):  # the user's to correct
        mesh_devices()
    monkeypatch.setenv("PIE_XLA_DEVICES", "two")
    with pytest.raises(EngineSettingError, match="not a number"):
        mesh_devices()
    from pie_engine_xla import plugin

    (finding,) = [d for d in plugin.pie_diagnose() if not d.ok]  # `pie doctor`: the setting, not a reinstall of jax
    assert finding.what == "PIE_XLA_DEVICES" and "pip install" not in finding.fix, finding
    monkeypatch.setenv("PIE_XLA_DEVICES", "1")
    assert len(mesh_devices()) == 1


def test_uploads_round_trip_after_placement(xla: Device) -> None:
    launcher = xla.compile("add")
    a = np.arange(15, dtype=np.float32).reshape(5, 3)
    ta, tb = xla.upload(a), xla.upload(a)
    a[:] = -1  # upload took a snapshot
    out = launcher(ta, tb)
    assert xla.download(out).shape == (5, 3)
    source = xla.source(KernelRequest("add"))
    assert source is not None and "stablehlo.add" in source and "tensor<8x3xf32>" in source  # 5 rows -> bucket 8
    np.testing.assert_array_equal(xla.download(ta), np.arange(15, dtype=np.float32).reshape(5, 3))
    np.testing.assert_array_equal(xla.download(out), 2 * np.arange(15, dtype=np.float32).reshape(5, 3))


def test_eta_epilogue_runs_through_its_jax_rendering(xla: Device) -> None:
    from pie import eta

    from pie_engine_xla.epilogues import run_epilogue

    epilogue = eta.compile(
        "in x: f32\nin weight: f32[cols]\nin residual: f32\nparam eps: f32\n"
        "out y = x * rsqrt(row_mean(x * x) + eps) * weight + residual\n"
    )
    rng = np.random.default_rng(3)
    x, w, residual = rng.standard_normal((3, 16)), rng.standard_normal((5, 16)), rng.standard_normal((3, 5))
    weight = rng.standard_normal(5)
    as32 = [a.astype(np.float32) for a in (x, w, residual, weight)]
    projected = xla.compile("linear")(xla.upload(as32[0]), xla.upload(as32[1]), None)  # padded to 4 rows
    got = run_epilogue(epilogue, x=projected, weight=xla.upload(as32[3]), residual=xla.upload(as32[2]), eps=1e-5)
    expected = epilogue.numpy_fn()(x=as32[0] @ as32[1].T, weight=as32[3], residual=as32[2], eps=1e-5)
    np.testing.assert_allclose(xla.download(got["y"]), expected["y"], rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="eps"):
        run_epilogue(epilogue, x=projected, weight=xla.upload(as32[3]), residual=xla.upload(as32[2]))
