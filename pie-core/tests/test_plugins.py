from __future__ import annotations

import json
import os
import subprocess
import sys

import fake_engines
import numpy as np
import pytest
from pie.contract import CONTRACT_VERSION
from pie.plugins import EngineError, EngineRegistry, EngineSelectionError

BROKEN = {
    "importerr": (fake_engines.IMPORT_ERROR, "import failed: ImportError: libacme.so.3"),
    "probeerr": (fake_engines.PROBE_ERROR, "device probe failed: RuntimeError: no Acme driver loaded"),
    "nohooks": (fake_engines.MISSING_HOOKS, "missing required hooks: pie_probe_devices, pie_list_kernels"),
    "oldcontract": (fake_engines.OLD_CONTRACT, f"contract version {CONTRACT_VERSION - 1} is not supported"),
    "badsig": (fake_engines.BAD_SIGNATURE, "invalid plugin"),
    "unknownhook": (fake_engines.UNKNOWN_HOOK, "pie_launch_rockets"),
    "inforaises": (fake_engines.INFO_RAISES, "pie_engine_info failed: ValueError: bad config"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_plugin_is_isolated(install_engine, name: str) -> None:
    source, reason = BROKEN[name]
    install_engine(name, source)
    install_engine("good", fake_engines.WORKING, priority=20)
    registry = EngineRegistry(env={})
    statuses = {s.name: s for s in registry.statuses()}
    assert statuses[name].status == "broken"
    assert reason in statuses[name].reason
    assert statuses[name].distribution == f"pie-engine-{name}"
    assert statuses["good"].status == "ok"
    assert statuses["cpu"].status == "ok"
    device, why = registry.select()
    assert device.name == "good" and "highest priority" in why
    with pytest.raises(EngineSelectionError, match=f"engine '{name}' cannot start"):
        registry.select(name)


def test_every_broken_kind_at_once_leaves_cpu_working(install_engine) -> None:
    for name, (source, _) in BROKEN.items():
        install_engine(name, source)
    registry = EngineRegistry(env={"PIE_ENGINES": "cpu"})
    device, _ = registry.select()
    add = device.compile("add")
    np.testing.assert_array_equal(add(np.ones(3, np.float32), np.ones(3, np.float32)), [2, 2, 2])


def test_pie_engines_selects_and_orders(install_engine) -> None:
    install_engine("alpha", fake_engines.WORKING, priority=5)
    device, why = EngineRegistry(env={"PIE_ENGINES": "alpha,cpu"}).select()
    assert device.name == "alpha" and "PIE_ENGINES=alpha,cpu" in why
    device, _ = EngineRegistry(env={"PIE_ENGINES": "cpu,alpha"}).select()
    assert device.name == "cpu"
    statuses = {s.name: s.status for s in EngineRegistry(env={"PIE_ENGINES": "alpha"}).statuses()}
    assert statuses.pop("alpha") == "ok"
    assert statuses and set(statuses.values()) == {"not-selected"}


def test_an_engine_asked_for_that_cannot_start_is_an_error_not_a_fallback(install_engine) -> None:
    install_engine("probeerr", fake_engines.PROBE_ERROR)
    with pytest.raises(EngineSelectionError, match="engine 'probeerr' cannot start: device probe failed"):
        EngineRegistry(env={"PIE_ENGINES": "probeerr,cpu"}).select()
    with pytest.raises(EngineSelectionError, match="engine 'probeerr' cannot start"):
        EngineRegistry(env={"PIE_ENGINES": "cpu,probeerr"}).select()
    with pytest.raises(EngineSelectionError, match="'nosuch' is not installed"):
        EngineRegistry(env={}).select("nosuch")


def test_without_pie_engines_the_highest_priority_working_engine_wins(install_engine) -> None:
    install_engine("low", fake_engines.WORKING, priority=-5)
    install_engine("high", fake_engines.WORKING, priority=50)
    install_engine("probeerr", fake_engines.PROBE_ERROR, priority=99)
    device, why = EngineRegistry(env={}).select()
    assert device.name == "high"
    assert "cpu" in why and "high" in why and "probeerr" not in why


def test_autoload_can_be_disabled_and_engines_registered_in_process() -> None:
    import pie_engine_cpu.plugin

    registry = EngineRegistry(env={"PIE_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert registry.names() == []
    registry.register("cpu", pie_engine_cpu.plugin)
    assert registry.select()[0].name == "cpu"
    assert EngineRegistry(autoload=False).names() == []


def test_unsupported_kernel_is_a_clear_error() -> None:
    device = EngineRegistry(env={}).select("cpu")[0]
    with pytest.raises(EngineError, match="does not implement kernel linear\\[tensor-cores\\]"):
        device.compile("linear", "tensor-cores")


HEAVY = ("jax", "jaxlib", "wgpu", "vulkan", "cuda", "torch", "pyopencl", "hip", "Metal")


def test_listing_engines_imports_no_heavy_backend(tmp_path) -> None:
    script = f"""
import json, sys
from pie.plugins import EngineRegistry
registry = EngineRegistry()
statuses = registry.statuses(probe=False)
print(json.dumps({{"names": [s.name for s in statuses], "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout)
    assert "cpu" in result["names"]
    assert result["heavy"] == [], f"listing imported {result['heavy']}"


def test_cached_probes_make_pie_engines_import_no_heavy_backend(tmp_path) -> None:
    cache = tmp_path / "probes.json"
    warm = "from pie.reports import engines_report; engines_report()"
    env = {**__import__("os").environ, "PIE_PROBE_CACHE": str(cache)}
    subprocess.run([sys.executable, "-c", warm], env=env, check=True, capture_output=True)
    check = f"""
import json, sys
from pie.reports import engines_report
report = engines_report()
print(json.dumps({{"chosen": report["chosen"]["engine"], "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""
    out = subprocess.run([sys.executable, "-c", check], env=env, check=True, capture_output=True, text=True)
    result = json.loads(out.stdout)
    assert result["chosen"] is not None
    assert result["heavy"] == [], f"pie engines with warm probes imported {result['heavy']}"


def test_select_reads_remembered_probes_and_recovers_when_one_is_stale(install_engine, tmp_path) -> None:
    from pie.probe_cache import ProbeCache, cache_key
    from pie.contract import DeviceInfo

    install_engine("probeerr", fake_engines.PROBE_ERROR, priority=99)
    cache = ProbeCache(tmp_path / "probes.json")
    remembered = DeviceInfo("probeerr", 0, "Fake Device", "Acme", "fake1", "gpu", 1 << 30)
    cache.put(cache_key("probeerr", "9.9"), [remembered], "")  # it worked when it was last probed
    registry = EngineRegistry(env={"PIE_ENGINES": ""}, probe_cache=cache)
    device, why = registry.select()
    assert device.name != "probeerr", "a stale probe must not choose an engine that no longer starts"
    assert "probeerr" not in why
    with pytest.raises(EngineSelectionError, match="engine 'probeerr' cannot start"):
        EngineRegistry(env={}, probe_cache=cache).select("probeerr")


def test_weight_groups_without_the_engines_hook_are_single_uploads(install_engine) -> None:
    install_engine("plain", fake_engines.WORKING)
    device = EngineRegistry(env={"PIE_ENGINES": "plain"}).select("plain")[0]
    arrays = [np.arange(6, dtype=np.float32).reshape(2, 3), np.ones(4, np.float32)]
    uploaded = device.upload_weights(arrays)
    assert [u.shape for u in uploaded] == [(2, 3), (4,)]
    assert all(np.array_equal(u, a) and u is not a for u, a in zip(uploaded, arrays))


def test_a_weight_group_hook_must_answer_one_tensor_per_weight(install_engine) -> None:
    install_engine("short", fake_engines.SHORT_WEIGHT_GROUPS)
    device = EngineRegistry(env={"PIE_ENGINES": "short"}).select("short")[0]
    with pytest.raises(EngineError, match="returned 1 tensors for 2 uploaded weights"):
        device.upload_weights([np.ones(2, np.float32), np.ones(3, np.float32)])


def test_pie_sets_openblas_idle_polling_short_unless_the_user_chose(tmp_path) -> None:
    script = "import pie, os; print(os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert run.stdout.strip() == "18"
    env["OPENBLAS_THREAD_TIMEOUT"] = "26"
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    assert run.stdout.strip() == "26"


def test_the_decode_roofline_takes_the_engines_bandwidth_for_its_own_memory(install_engine) -> None:
    from pie.bench import measure_bandwidth, read_pass

    install_engine("fastmem", fake_engines.MEMORY_BANDWIDTH)
    device = EngineRegistry(env={"PIE_ENGINES": "fastmem"}).select("fastmem")[0]
    assert device.memory_bandwidth() == 3.35e12
    assert measure_bandwidth(device, megabytes=8, repeats=1) == 3.35e12  # a GPU's memory, not the host's
    install_engine("plain", fake_engines.WORKING)
    plain = EngineRegistry(env={"PIE_ENGINES": "plain"}).select("plain")[0]
    assert plain.memory_bandwidth() is None
    assert 1e8 < measure_bandwidth(plain, megabytes=8, repeats=1) < 1e13  # the host BLAS probe
    # The passes paired with decode steps: the engine's own where it has one, else a host GEMV each.
    assert read_pass(device)() == 3.35e12
    assert 1e8 < read_pass(plain)() < 1e13


def test_transfers_call_the_engines_one_function_without_the_plugin_layer() -> None:
    from pie.hookspecs import hookimpl

    engine = EngineRegistry(env={"PIE_ENGINES": "cpu"}).engine("cpu")
    hook_calls: list[str] = []
    engine._manager.add_hookcall_monitoring(lambda name, impls, kwargs: hook_calls.append(name), lambda *a: None)
    device = engine.open(0)
    host = np.arange(6, dtype=np.float32)
    tensor = device.upload(host)
    host[0] = 7.0
    np.testing.assert_array_equal(device.download(tensor), np.arange(6, dtype=np.float32))
    assert "pie_upload" not in hook_calls and "pie_download" not in hook_calls

    class Tracing:  # a second implementation around the engine's: every upload must reach it
        @hookimpl(wrapper=True)
        def pie_upload(self, device, array):
            hook_calls.append("traced")
            return (yield)

    engine._manager.register(Tracing())
    engine.open(0).upload(host)
    assert hook_calls.count("traced") == 1
