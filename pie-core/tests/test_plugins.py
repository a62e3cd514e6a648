from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import fake_engines
import numpy as np
import pytest
from pie.contract import CONTRACT_VERSION
from pie.plugins import EngineError, EngineRegistry, EngineSelectionError
from pie.probe_cache import ProbeCache, cache_key

BROKEN = {
    "importerr": (fake_engines.IMPORT_ERROR, "import failed: ImportError: libacme.so.3"),
    "probeerr": (fake_engines.PROBE_ERROR, "device probe failed: RuntimeError: no Acme driver loaded"),
    "nohooks": (fake_engines.MISSING_HOOKS, "missing required hooks: pie_probe_devices, pie_list_kernels"),
    "oldcontract": (fake_engines.OLD_CONTRACT, f"contract version {CONTRACT_VERSION - 1} is not supported"),
    "badsig": (fake_engines.BAD_SIGNATURE, "pie_compile_kernel takes stream, which the hook does not pass"),
    "unknownhook": (fake_engines.UNKNOWN_HOOK, "pie_launch_rockets"),
    "inforaises": (fake_engines.INFO_RAISES, "pie_engine_info failed: ValueError: bad config"),
    "halfpass": (fake_engines.BEGINS_PASSES_ONLY, "unpaired hooks: pie_begin_pass without pie_end_pass"),
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


HOOK_MISTAKES = {
    "typo": (fake_engines.WORKING + "\n@hookimpl\ndef pie_copy_page(device, pool, source_ids, destination_ids):\n"
             "    pass\n", "pie_copy_page is not a hook of pie.hookspecs (did you mean pie_copy_pages?)"),
    "argname": (fake_engines.WORKING.replace("def pie_upload(device, array):", "def pie_upload(dev, array):"),
                "pie_upload takes dev, which the hook does not pass: its arguments are (device, array), "
                "passed by name"),
    "unmarked": (fake_engines.WORKING.replace("@hookimpl\ndef pie_download", "def pie_download"),
                 "missing required hooks: pie_download (pie_download defined without @pie.hookspecs.hookimpl)"),
}


@pytest.mark.parametrize("name", sorted(HOOK_MISTAKES))
def test_a_hook_written_wrong_is_named_with_what_to_change(install_engine, name: str) -> None:
    """An engine author's misspelt hook, misnamed argument or forgotten @hookimpl was listed as "invalid plugin:"
    with pluggy's three lines, or "missing required hooks" alone, with the fix "pip install --force-reinstall"."""
    source, reason = HOOK_MISTAKES[name]
    install_engine(name, source)
    status = EngineRegistry(env={"PIE_ENGINES": name}).status(name)
    assert status.status == "broken" and status.reason == f"breaks the engine contract: {reason}", status.reason
    upgrade = f"pip install --upgrade pie-engine-{name}  # reinstalling 9.9 would not help"
    assert status.fix.startswith(upgrade), status.fix


@pytest.mark.parametrize("name", ["badsig", "halfpass", "nohooks", "oldcontract", "unknownhook"])
def test_an_engine_that_breaks_the_contract_is_not_told_to_reinstall(install_engine, tmp_path, name: str) -> None:
    """A reinstall of the same version brings the same code back; and the fix holds for a remembered probe."""
    install_engine(name, BROKEN[name][0])
    cache = ProbeCache(tmp_path / "probes.json")
    for _ in range(2):  # probed in a child, then remembered
        status = EngineRegistry(env={"PIE_ENGINES": name}, probe_cache=cache).status(name, True)
        assert status.reason.startswith("breaks the engine contract: "), status.reason
        assert "--force-reinstall" not in status.fix and "pip install --upgrade" in status.fix, status.fix
    assert cache.get(cache_key(name, f"pie-engine-{name}", "9.9")) is not None


DEVICE = 'DeviceInfo(NAME, 0, "Fake Device", "Acme", "fake1", "gpu", 1 << 30)'
IMPOSSIBLE = {
    "negmemory": (DEVICE.replace("1 << 30", "-5"), "device 'Fake Device' with -5 bytes of memory"),
    "hugememory": (DEVICE.replace("1 << 30", "10**30"), f"with {10**30} bytes of memory (0 where unknown"),
    "othername": (DEVICE.replace("NAME", '"cpu"'), "device 'Fake Device' of engine 'cpu'"),
    "negindex": (DEVICE.replace("NAME, 0", "NAME, -1"), "device 'Fake Device' with index -1 (indices count from 0)"),
    "twice": (f"{DEVICE}, {DEVICE}", "device 'Fake Device' with index 0, which another of its devices has"),
    "nokind": (DEVICE.replace('"gpu"', '"quantum"'), "device 'Fake Device' of kind 'quantum', not one of cpu, gpu"),
    "toppriority": (DEVICE, "pie_engine_info gave priority 1000000000000000000000000000000, not an integer within"),
}


@pytest.mark.parametrize("name", sorted(IMPOSSIBLE))
def test_impossible_device_facts_or_priority_mark_the_engine_broken(install_engine, name: str) -> None:
    """Each was listed as ok and used: a device with -5 or 10**30 bytes, another engine's, index -1, ..., and a
    priority of 10**30 won every automatic choice."""
    device, reason = IMPOSSIBLE[name]
    install_engine(name, fake_engines.WORKING.replace(DEVICE, device), priority=10**30 if name == "toppriority" else 10)
    status = EngineRegistry(env={"PIE_ENGINES": name}).status(name)
    assert status.status == "broken" and reason in status.reason, status.reason
    if name != "toppriority":
        assert status.reason.startswith(f"device probe failed: EngineError: engine '{name}': pie_probe_devices returned")


def test_every_broken_kind_at_once_leaves_cpu_working(install_engine) -> None:
    for name, (source, _) in BROKEN.items():
        install_engine(name, source)
    registry = EngineRegistry(env={"PIE_ENGINES": "cpu"})
    device, _ = registry.select()
    add = device.compile("add")
    np.testing.assert_array_equal(add(np.ones((1, 3), np.float32), np.ones((1, 3), np.float32)), [[2, 2, 2]])


def test_a_broken_cpu_engine_is_named_where_the_choice_is_explained(install_engine, tmp_path, monkeypatch) -> None:
    """Other engines lack their hardware on most machines and go unmentioned; the CPU engine runs wherever
    Python does, so its failure is said where the engine chosen instead is explained."""
    install_engine("good", fake_engines.EVERY_PRIMITIVE, priority=50)
    shadow = tmp_path / "shadow" / "pie_engine_cpu"  # a broken installation: its module cannot be imported
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    (shadow / "plugin.py").write_text('raise ImportError("libacme-blas.so.2: cannot open shared object file")\n')
    with monkeypatch.context() as patch:
        patch.syspath_prepend(str(tmp_path / "shadow"))
        device, why = EngineRegistry(env={}).select()
    assert device.name == "good"
    assert "; cpu is broken: import failed: ImportError: libacme-blas.so.2" in why, why
    assert "broken" not in EngineRegistry(env={}).select()[1]


def test_a_setting_an_engine_cannot_read_stops_the_choice_it_would_have_won(install_engine) -> None:
    """`PIE_CPU_ACTIVATIONS=xyz pie run hi` ran on the XLA engine, the setting's error only in the dim status
    line: a setting the user gave an engine is the user's to correct, never a reason to run another."""
    install_engine("acme", fake_engines.SETTING_ERROR, priority=50)
    install_engine("good", fake_engines.EVERY_PRIMITIVE, priority=20)
    registry = EngineRegistry(env={})
    with pytest.raises(EngineSelectionError) as raised:
        registry.select()
    message = str(raised.value)
    assert "engine 'acme' cannot start: device probe failed: EngineSettingError: PIE_ACME_MODE is 'fast'" in message
    assert "good would run instead" in message and "--engine" in message and "PIE_ENGINES" in message, message
    status = {s.name: s for s in registry.statuses()}["acme"]
    assert status.status == "broken" and "PIE_ACME_MODE is 'fast'" in status.reason
    assert "pip install" not in status.fix and "--engine" in status.fix, status.fix
    from pie.reports import doctor_report, engines_report, format_engines

    listing = format_engines(engines_report(EngineRegistry(env={}), cached=False))
    assert f"PIE_ACME_MODE is 'fast'; expected one of slow, steady\n    fix: {status.fix}" in listing, listing
    assert "chosen: none (engine 'acme' cannot start" in listing, listing
    doctor, _ = doctor_report(EngineRegistry(env={}))
    assert "acme (pie-engine-acme 9.9): broken - device probe failed: EngineSettingError: PIE_ACME_MODE" in doctor
    assert f"  fix: {status.fix}" in doctor, doctor
    # Naming an engine is the way on; naming the one whose setting is wrong is the error it always was.
    assert EngineRegistry(env={}).select("good")[0].name == "good"
    assert EngineRegistry(env={"PIE_ENGINES": "good"}).select()[0].name == "good"
    with pytest.raises(EngineSelectionError, match="engine 'acme' cannot start: .*PIE_ACME_MODE is 'fast'"):
        EngineRegistry(env={}).select("acme")


def test_a_setting_error_of_an_engine_that_would_not_have_run_is_said_not_raised(install_engine) -> None:
    install_engine("acme", fake_engines.SETTING_ERROR, priority=-50)
    install_engine("good", fake_engines.EVERY_PRIMITIVE, priority=50)
    name, why = EngineRegistry(env={}).choose()
    assert name == "good"
    assert "acme cannot read a setting: device probe failed: EngineSettingError: PIE_ACME_MODE" in why, why


def test_a_cpu_setting_it_cannot_read_stops_the_choice_even_of_an_engine_above_it(install_engine, monkeypatch) -> None:
    """The CPU engine holds the host page pool whichever engine runs: its setting is never passed over."""
    monkeypatch.setenv("PIE_CPU_ACTIVATIONS", "xyz")  # probe children inherit it
    install_engine("good", fake_engines.EVERY_PRIMITIVE, priority=50)
    with pytest.raises(EngineSelectionError, match=r"^engine 'cpu' cannot start: device probe failed: EngineSettingError: "
                       r"PIE_CPU_ACTIVATIONS is 'xyz'; expected one of float, int8, int16\. That is a setting of yours, "
                       r"and the CPU engine holds the host page pool"):
        EngineRegistry(env={}).select()
    monkeypatch.delenv("PIE_CPU_ACTIVATIONS")
    assert EngineRegistry(env={}).select()[0].name == "good"


def test_pie_engines_selects_and_orders(install_engine) -> None:
    install_engine("alpha", fake_engines.WORKING, priority=5)
    device, why = EngineRegistry(env={"PIE_ENGINES": "alpha,cpu"}).select()
    assert device.name == "alpha" and "PIE_ENGINES=alpha,cpu" in why
    device, _ = EngineRegistry(env={"PIE_ENGINES": "cpu,alpha"}).select()
    assert device.name == "cpu"
    statuses = {s.name: s.status for s in EngineRegistry(env={"PIE_ENGINES": "alpha"}).statuses()}
    assert statuses.pop("alpha") == "ok"
    assert statuses and set(statuses.values()) == {"not-selected"}
    with pytest.raises(EngineSelectionError, match="PIE_ENGINES is ', ,', which names no engine"):
        EngineRegistry(env={"PIE_ENGINES": ", ,"}).select()  # was taken for unset: every engine could be chosen


def test_doctor_says_when_pie_engines_names_no_installed_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from pie.reports import doctor_report

    monkeypatch.setenv("PIE_ENGINES", "nonsense")
    text, ok = doctor_report(EngineRegistry())
    assert not ok and "PIE_ENGINES names nonsense, which is not installed (installed: " in text
    assert "install pie-engine-cpu" not in text, "it is installed: PIE_ENGINES left it out"


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


def test_the_autoload_switch_takes_the_usual_spellings_and_names_itself_for_others() -> None:
    """`PIE_DISABLE_PLUGIN_AUTOLOAD=abc` turned autoload off: "no engine can run here (no engine is installed)"."""
    for off in ("1", "true", "Yes", " ON "):
        assert EngineRegistry(env={"PIE_DISABLE_PLUGIN_AUTOLOAD": off}).names() == []
    for on in ("", "0", "false", "No", "off"):
        assert "cpu" in EngineRegistry(env={"PIE_DISABLE_PLUGIN_AUTOLOAD": on}).names()
    registry = EngineRegistry(env={"PIE_DISABLE_PLUGIN_AUTOLOAD": "abc"})
    for query in (registry.names, registry.statuses, registry.choose, lambda: registry.engine("cpu")):
        with pytest.raises(EngineSelectionError, match=r"PIE_DISABLE_PLUGIN_AUTOLOAD is 'abc': set it to 1 .* or to 0"):
            query()


def test_autoload_switched_off_is_named_where_no_engine_is_found() -> None:
    """With the switch on, every command said no engine was installed and to `pip install pie-engine-cpu`, which is
    installed: the switch, not a missing engine, is what keeps it out."""
    from pie.reports import doctor_report, engines_report, format_engines

    registry = EngineRegistry(env={"PIE_DISABLE_PLUGIN_AUTOLOAD": "1"})
    unset = "PIE_DISABLE_PLUGIN_AUTOLOAD=1 loads no installed engine: unset it to load them"
    with pytest.raises(EngineSelectionError, match=f"^engine 'cpu' is not loaded: {unset}$"):
        registry.engine("cpu")
    with pytest.raises(EngineSelectionError, match=f"^no engine is loaded: {unset}$"):
        registry.select()
    listing = format_engines(engines_report(registry))
    assert f"({unset})" in listing and "pip install" not in listing
    assert doctor_report(registry) == (f"no engine is loaded: {unset}", False)


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
statuses = registry.statuses()
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
    from pie.contract import DeviceInfo, EngineInfo
    from pie.probe_cache import Probe, ProbeCache, cache_key

    install_engine("probeerr", fake_engines.PROBE_ERROR, priority=99)
    cache = ProbeCache(tmp_path / "probes.json")
    remembered = DeviceInfo("probeerr", 0, "Fake Device", "Acme", "fake1", "gpu", 1 << 30)
    info = EngineInfo("probeerr", CONTRACT_VERSION, 99, ("numpy",))
    worked = Probe(info, (remembered,), ("add", "append_kv", "attention"))  # it worked when it was last probed
    cache.put(cache_key("probeerr", "pie-engine-probeerr", "9.9"), worked)
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


# -- plugins that crash or hang, isolated in their probe child ------------------

CRASHING = {
    "segvimport": (fake_engines.SEGFAULT_ON_IMPORT, "crashed (signal 11) while loading the plugin"),
    "segvprobe": (fake_engines.SEGFAULT_IN_PROBE, "crashed (signal 11) while probing devices"),
    "hangimport": (fake_engines.HANG_ON_IMPORT, "timed out after 6 s while loading the plugin"),
    "hangprobe": (fake_engines.HANG_IN_PROBE, "timed out after 6 s while probing devices"),
    "exits": (fake_engines.EXITS_ON_IMPORT, "exited with code 3 while loading the plugin; its last words: libacme"),
}


@pytest.mark.parametrize("name", sorted(CRASHING))
def test_a_plugin_that_crashes_or_hangs_is_listed_with_what_happened(install_engine, name: str) -> None:
    source, reason = CRASHING[name]
    install_engine(name, source, priority=99)
    install_engine("good", fake_engines.WORKING, priority=20)
    # The timeout holds the working engines' probes too, which run beside it: 2 s timed the CPU engine's out once
    # at a load average of 7. A hang is waited for that long; a crash ends its probe at once.
    registry = EngineRegistry(env={"PIE_PROBE_TIMEOUT": "6" if name.startswith("hang") else "60"})
    statuses = {s.name: s for s in registry.statuses()}
    assert statuses[name].status == "broken" and reason in statuses[name].reason, statuses[name]
    assert statuses["good"].status == "ok" and statuses["cpu"].status == "ok"
    assert f"fake_pie_engine_{name}" not in sys.modules, "a plugin that failed its probe was imported here"
    device, why = registry.select()
    assert device.name == "good" and name not in why
    with pytest.raises(EngineSelectionError, match=f"engine '{name}' cannot start: {re.escape(reason)}"):
        registry.select(name)


def test_a_probe_that_timed_out_says_how_to_give_it_longer_also_when_remembered(install_engine, tmp_path) -> None:
    """A first probe may build the engine's kernels (the CPU engine's C compile): on a busy machine that can pass
    the timeout, which then stood as the only word, with no fix, and was remembered."""
    install_engine("hangprobe", fake_engines.HANG_IN_PROBE)
    cache_path = tmp_path / "probes.json"
    env = {"PIE_PROBE_TIMEOUT": "6", "PIE_ENGINES": "hangprobe"}
    fresh = EngineRegistry(env=env, probe_cache=ProbeCache(cache_path)).status("hangprobe")
    remembered = EngineRegistry(env=env, probe_cache=ProbeCache(cache_path)).status("hangprobe", cached=True)
    for status in (fresh, remembered):
        assert status.status == "broken" and "timed out after 6 s" in status.reason, status
        assert "PIE_PROBE_TIMEOUT=300 pie engines --refresh" in status.fix, status
    assert "remembered" in remembered.reason


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal", [True, False])
def test_a_slow_probe_is_said_at_a_terminal(install_engine, monkeypatch: pytest.MonkeyPatch, terminal: bool) -> None:
    """The CPU engine's first probe builds its C kernels: `pie run` was silent for 20 s on a busy machine."""
    install_engine("slow", fake_engines.WORKING.replace("def pie_probe_devices():\n",
                                                        "def pie_probe_devices():\n    import time; time.sleep(5)\n"))
    stderr = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    assert EngineRegistry(env={"PIE_ENGINES": "slow", "PIE_PROBE_TIMEOUT": "60"}).status("slow").status == "ok"
    said = "pie: examining the engine(s) slow: the first time on a machine an engine may build its kernels"
    assert (said in stderr.getvalue()) is terminal, stderr.getvalue()


def test_only_an_engine_that_passed_its_probe_is_imported_and_only_when_used(install_engine) -> None:
    install_engine("unused", fake_engines.WORKING)
    registry = EngineRegistry(env={})
    assert registry.status("unused").status == "ok"
    assert "fake_pie_engine_unused" not in sys.modules
    registry.engine("unused")
    assert "fake_pie_engine_unused" in sys.modules


def test_the_probe_timeout_must_be_a_number_of_seconds(install_engine) -> None:
    install_engine("good", fake_engines.WORKING)
    for bad in ("abc", "0", "-1", "nan", "inf"):
        with pytest.raises(EngineError, match=f"PIE_PROBE_TIMEOUT='{bad}' is not a number of seconds"):
            EngineRegistry(env={"PIE_PROBE_TIMEOUT": bad}).statuses()


def test_a_warm_probe_cache_starts_no_child(install_engine, tmp_path, monkeypatch) -> None:
    from pie.probe_cache import ProbeCache

    install_engine("good", fake_engines.WORKING, priority=20)
    cache_path = tmp_path / "probes.json"
    EngineRegistry(env={}, probe_cache=ProbeCache(cache_path)).statuses()

    def no_children(*args, **kwargs):
        raise AssertionError("a probe child was started")

    monkeypatch.setattr(subprocess, "Popen", no_children)
    registry = EngineRegistry(env={}, probe_cache=ProbeCache(cache_path))
    statuses = {s.name: s.status for s in registry.statuses(cached=True)}
    assert statuses["good"] == "ok" and statuses["cpu"] == "ok"
    assert registry.choose(cached=True)[0] == "good"


# -- names, selection, the host device -------------------------------------------


def _install_distribution(site: Path, distribution: str, name: str, source: str) -> None:
    """A distribution whose name is not pie-engine-NAME (install_engine's convention)."""
    module = distribution.replace("-", "_")
    (site / f"{module}.py").write_text(source.format(name=name, priority=0))
    info = site / f"{module}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[pie.engines]\n{name} = {module}\n")


def test_a_second_distribution_with_a_taken_name_is_a_reported_conflict(install_engine, tmp_path) -> None:
    install_engine("good", fake_engines.WORKING)  # puts tmp_path / "site" first on sys.path
    _install_distribution(tmp_path / "site", "acme-fast-cpu", "cpu", fake_engines.WORKING)
    registry = EngineRegistry(env={})
    cpus = [s for s in registry.statuses() if s.name == "cpu"]
    assert [(s.distribution, s.status) for s in cpus] == [("pie-engine-cpu", "ok"), ("acme-fast-cpu", "broken")]
    assert "pie-engine-cpu" in cpus[1].reason and "acme-fast-cpu" in cpus[1].reason
    assert cpus[1].fix == "pip uninstall acme-fast-cpu"
    device, why = registry.select("cpu")
    assert device.engine.distribution == "pie-engine-cpu" and device.info.name != "Fake Device"
    assert "acme-fast-cpu also registers 'cpu'" in why
    assert "acme_fast_cpu" not in sys.modules


def test_automatic_selection_passes_over_an_engine_that_cannot_run_a_model(install_engine) -> None:
    install_engine("nopool", fake_engines.NO_POOL_KERNELS, priority=90)
    install_engine("good", fake_engines.WORKING, priority=20)
    device, why = EngineRegistry(env={}).select()
    assert device.name == "good"
    assert "nopool cannot run a model: it lacks append_kv and attention" in why
    assert EngineRegistry(env={}).select("nopool")[0].name == "nopool"  # asked for: the user's call


def _module(name: str, source: str, priority: int = 10) -> types.ModuleType:
    module = types.ModuleType(f"inline_engine_{name}")
    exec(textwrap.dedent(source.format(name=name, priority=priority)), module.__dict__)
    return module


def test_without_a_cpu_engine_an_engine_lacking_primitives_cannot_run_a_model() -> None:
    import pie_engine_cpu.plugin

    registry = EngineRegistry(autoload=False)
    registry.register("alpha", _module("alpha", fake_engines.WORKING))
    with pytest.raises(EngineSelectionError, match=r"alpha cannot run a model: it lacks embedding, .*, and the CPU "
                       r"engine, which would run them, is not installed \(pip install pie-engine-cpu\)"):
        registry.choose()
    registry.register("cpu", pie_engine_cpu.plugin)
    registry.register("alpha", _module("alpha", fake_engines.WORKING, priority=10))
    assert registry.choose()[0] == "alpha"


def test_without_a_cpu_engine_an_engine_lacking_only_kernels_some_models_need_runs_the_others(
    tmp_path: Path,
) -> None:
    """Every primitive counted (`epilogue` and `softmax` too): such an engine "cannot run a model" when chosen
    automatically, while `--engine` ran one with it. Now both run the model it can, and both refuse, naming the
    kernel, one it cannot (a logit epilogue)."""
    from pie.eta.stdlib import SOURCES
    from pie.poem.graph import LogitEpilogue
    from pie.runtime.llm import LLM
    from pie.testing.models import make_gguf_model

    registry = EngineRegistry(autoload=False)
    registry.register("lean", _module("lean", fake_engines.CPU_WITHOUT_EPILOGUE))
    assert registry.choose()[0] == "lean"
    model = str(make_gguf_model(tmp_path / "m.gguf", "F32", seed=1))
    for engine in (None, "lean"):
        llm = LLM.load(model, engine, registry=registry, max_cached_tokens=64)
        assert llm.device.name == "lean"
        assert len(list(llm.generate_tokens([1, 2, 3], max_tokens=3, stop_token_ids=()))) == 3
        softcap = LogitEpilogue(SOURCES["logit_softcap"], (("cap", 30.0),))
        with pytest.raises(EngineError, match="engine 'lean' does not implement 'epilogue'"):
            LLM.load(model, engine, registry=registry, max_cached_tokens=64, logit_epilogue=softcap)


def test_without_a_cpu_engine_a_complete_engine_is_chosen_over_one_of_higher_priority_lacking_some_kernels() -> None:
    """The choice is made before the model is known: the engine that runs every model wins, and the other is
    chosen only where none does, saying what it lacks."""
    registry = EngineRegistry(autoload=False)
    registry.register("lean", _module("lean", fake_engines.CPU_WITHOUT_EPILOGUE, priority=20))
    registry.register("full", _module("full", fake_engines.EVERY_PRIMITIVE, priority=10))
    name, why = registry.choose()
    assert name == "full", why
    assert "lean runs only models that need none of epilogue, softmax (no CPU engine to run them)" in why
    alone = EngineRegistry(autoload=False)
    alone.register("lean", _module("lean", fake_engines.CPU_WITHOUT_EPILOGUE, priority=20))
    name, why = alone.choose()
    assert name == "lean" and "it lacks epilogue, softmax (no CPU engine to run them)" in why, why


@pytest.mark.parametrize("kernel", ["rope", "gather_rows"])
def test_without_a_cpu_engine_an_engine_lacking_a_kernel_every_model_runs_cannot_run_a_model(kernel: str) -> None:
    every_but_one = f"for name in PRIMITIVES if name != {kernel!r}}}}}"
    lacking = fake_engines.EVERY_PRIMITIVE.replace("for name in PRIMITIVES}}", every_but_one)
    registry = EngineRegistry(autoload=False)
    registry.register("alpha", _module("alpha", lacking))
    with pytest.raises(EngineSelectionError, match=f"alpha cannot run a model: it lacks {kernel}, and the CPU engine"):
        registry.choose()


def test_the_kernels_every_model_runs_are_those_of_every_architectures_forward_pass() -> None:
    from pie.kernels import MODEL_KERNELS, PRIMITIVES
    from pie.models import ARCHITECTURES
    from pie.poem.graph import build_decoder_graph
    from pie.testing.models import tiny_config

    launched = [{op.kind for op in build_decoder_graph(tiny_config(name)).ops} for name in ARCHITECTURES]
    assert set(MODEL_KERNELS) == set.intersection(*launched) and set(MODEL_KERNELS) <= set(PRIMITIVES)


def test_the_engine_flag_wins_over_pie_engines(install_engine) -> None:
    install_engine("alpha", fake_engines.WORKING)
    install_engine("probeerr", fake_engines.PROBE_ERROR)
    device, why = EngineRegistry(env={"PIE_ENGINES": "alpha"}).select("cpu")
    assert device.name == "cpu" and "engine 'cpu' was asked for, which wins over PIE_ENGINES=alpha" in why
    assert EngineRegistry(env={"PIE_ENGINES": "probeerr"}).select("alpha")[0].name == "alpha"
    with pytest.raises(EngineSelectionError, match="engine 'probeerr' cannot start"):
        EngineRegistry(env={"PIE_ENGINES": "alpha"}).select("probeerr")


def test_the_host_device_is_there_whatever_pie_engines_selects(install_engine) -> None:
    install_engine("alpha", fake_engines.WORKING)
    install_engine("complete", fake_engines.EVERY_PRIMITIVE)
    registry = EngineRegistry(env={"PIE_ENGINES": "alpha,complete"})
    alpha = registry.select()[0]
    assert alpha.name == "alpha" and alpha.host_device().name == "cpu"
    assert alpha.host_device() is registry.host_device()
    assert registry.fallback_for(alpha) is registry.host_device()
    assert registry.fallback_for(registry.engine("complete").open(0)) is None  # nothing can need it
    assert registry.fallback_for(registry.host_device()) is None


def test_a_missing_host_engine_is_named_when_a_fallback_is_needed() -> None:
    registry = EngineRegistry(autoload=False)
    registry.register("alpha", _module("alpha", fake_engines.WORKING))
    alpha = registry.engine("alpha").open(0)
    with pytest.raises(EngineSelectionError, match="'cpu' is not installed.*host page pool.*pip install pie-engine-cpu"):
        registry.fallback_for(alpha)
    complete = EngineRegistry(autoload=False)
    complete.register("complete", _module("complete", fake_engines.EVERY_PRIMITIVE))
    assert complete.fallback_for(complete.engine("complete").open(0)) is None


def test_passes_reach_the_engines_that_plan_them_and_no_other() -> None:
    registry = EngineRegistry(autoload=False)
    planning = _module("planning", fake_engines.PLANS_PASSES)
    registry.register("planning", planning)
    registry.register("plain", _module("plain", fake_engines.WORKING))
    plan = object()
    device = registry.engine("planning").open(0)
    device.begin_pass(plan)  # type: ignore[arg-type]
    device.end_pass()
    assert planning.PASSES == [("planning:0", plan), ("planning:0", "end")]
    plain = registry.engine("plain").open(0)
    plain.begin_pass(plan)  # type: ignore[arg-type]
    plain.end_pass()


def test_missing_page_hooks_are_named(install_engine) -> None:
    install_engine("plain", fake_engines.WORKING)
    device = EngineRegistry(env={}).engine("plain").open(0)
    with pytest.raises(EngineError, match="engine 'plain' does not implement pie_read_pages"):
        device.read_pages(None, np.arange(2, dtype=np.int32))
    with pytest.raises(EngineError, match="engine 'plain' does not implement pie_write_pages"):
        device.write_pages(None, np.arange(2, dtype=np.int32), np.zeros(2, np.float32))
    with pytest.raises(EngineError, match="engine 'plain' does not implement pie_read_pages"):
        device.copy_pages(None, np.arange(1, dtype=np.int32), np.arange(1, 2, dtype=np.int32))


@pytest.mark.parametrize("hook", ["pie_max_page_pool_layer_bytes", "pie_max_page_pool_bytes"])
def test_a_bound_on_a_page_pool_or_its_layer_is_bytes_above_zero_or_none(install_engine, hook: str) -> None:
    bound = hook.removeprefix("pie_")
    tag = bound.split("_")[-2]  # engines of another name for each hook: an engine's module is imported once
    answers = {f"fits{tag}": "1 << 27", f"zero{tag}": "0", f"yes{tag}": "True", f"words{tag}": "'128 MiB'"}
    install_engine("plain", fake_engines.WORKING)
    for name, answer in answers.items():
        install_engine(name, fake_engines.WORKING + f"\n@hookimpl\ndef {hook}(device):\n    return {answer}\n")
    registry = EngineRegistry(env={})
    assert getattr(registry.engine("plain").open(0), bound)() is None, "no hook, no bound"
    assert getattr(registry.engine(f"fits{tag}").open(0), bound)() == 1 << 27
    for name in (f"zero{tag}", f"yes{tag}", f"words{tag}"):
        with pytest.raises(EngineError, match=f"engine '{name}': {hook} returned "
                                              f"{answers[name]}, not a number of bytes above 0"):
            getattr(registry.engine(name).open(0), bound)()


def test_pages_are_copied_through_the_host_where_the_engine_cannot_copy_them(install_engine) -> None:
    install_engine("paged", fake_engines.PAGED)
    device = EngineRegistry(env={}).engine("paged").open(0)
    pool = np.arange(2 * 5 * 3, dtype=np.float32).reshape(2, 5, 3)
    before = pool.copy()
    device.copy_pages(pool, np.array([4, 0], np.int32), np.array([1, 2], np.int32))
    expected = before.copy()
    expected[:, [1, 2]] = before[:, [4, 0]]
    np.testing.assert_array_equal(pool, expected)


def test_an_unreadable_entry_points_file_stops_no_other_engine(install_engine, tmp_path) -> None:
    install_engine("good", fake_engines.WORKING)
    info = tmp_path / "site" / "mangled-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mangled\nVersion: 1.0\n")
    (info / "entry_points.txt").write_bytes(b"[pie.engines]\nfoo = \xff\xfe\n")
    statuses = {s.name: s for s in EngineRegistry(env={}).statuses()}
    assert statuses["good"].status == "ok" and statuses["cpu"].status == "ok"
    assert statuses["mangled"].status == "broken" and "metadata cannot be read" in statuses["mangled"].reason


def test_a_diagnosis_that_hangs_is_a_failing_finding_and_none_is_no_finding(install_engine) -> None:
    install_engine("hangdiag", fake_engines.HANG_IN_DIAGNOSE)
    install_engine("plain", fake_engines.WORKING)  # no pie_diagnose: nothing to report, and no failure
    registry = EngineRegistry(env={"PIE_PROBE_TIMEOUT": "6", "PIE_ENGINES": "hangdiag,plain"})
    found = registry.diagnoses(["hangdiag", "plain"])
    assert found["plain"] == []
    (finding,) = found["hangdiag"]
    assert not finding.ok and finding.detail == "timed out after 6 s while diagnosing"
    assert registry.status("hangdiag").status == "ok", "its probe had passed before the diagnosis hung"


def test_a_probe_report_of_the_wrong_shape_and_a_malformed_entry_point_are_named(install_engine, tmp_path) -> None:
    install_engine("badfields", fake_engines.BAD_DEVICE_FIELDS)
    info = tmp_path / "site" / "pie_engine_badvalue-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pie-engine-badvalue\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pie.engines]\nbadvalue = not a module::\n")
    registry = EngineRegistry(env={"PIE_ENGINES": "badfields,badvalue"})
    assert registry.status("badfields").reason.endswith("device 'Fake Device' with None bytes of memory (0 where "
                                                         "unknown, at most 2**60)")
    assert registry.status("badvalue").reason == "its entry point 'not a module::' is not `module` or `module:attribute`"
