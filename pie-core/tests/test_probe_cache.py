"""The probe cache: what it trusts, for how long, keyed on what, and that a damaged file costs only a probe."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time
from dataclasses import replace

import fake_engines
import pytest
from pie.contract import CONTRACT_VERSION, DeviceInfo, EngineInfo
from pie.plugins import SETTING_FIX, SHORT_OF_RESOURCES_FIX, EngineRegistry
from pie.probe_cache import (
    FAILURE_MAX_AGE_SECONDS,
    MAX_AGE_SECONDS,
    Probe,
    ProbeCache,
    cache_key,
    probe_from_record,
    probe_record,
)

INFO = EngineInfo("acme", CONTRACT_VERSION, 50, ("acme-ir",))
DEVICE = DeviceInfo("acme", 0, "Acme 9000", "Acme", "a9", "gpu", 1 << 30, "acme 1.2", (("cores", "64"),))


def worked() -> Probe:
    """A probe that found a device, made now (a module-level one would age while a long run goes on)."""
    return Probe(INFO, (DEVICE,), ("add", "append_kv", "attention"))


def failed() -> Probe:
    return Probe(INFO, error="device probe failed: RuntimeError: no Acme driver loaded")


def test_a_probe_comes_back_as_it_was_put(tmp_path) -> None:
    ProbeCache(tmp_path / "probes.json").put("k", worked())
    back = ProbeCache(tmp_path / "probes.json").get("k")
    assert back is not None and back.remembered
    assert (back.info, back.devices, back.kernels, back.error) == (INFO, (DEVICE,), worked().kernels, "")


def test_a_failure_is_trusted_for_minutes_and_a_success_for_a_day(tmp_path, monkeypatch) -> None:
    cache = ProbeCache(tmp_path / "probes.json")
    now = time.time()
    cache.put("worked", replace(worked(), at=now))
    cache.put("failed", replace(failed(), at=now))
    cache.put("no-device", Probe(INFO, at=now))
    monkeypatch.setattr(time, "time", lambda: now + FAILURE_MAX_AGE_SECONDS + 1)
    assert cache.get("worked") is not None
    assert cache.get("failed") is None and cache.get("no-device") is None
    monkeypatch.setattr(time, "time", lambda: now + MAX_AGE_SECONDS + 1)
    assert cache.get("worked") is None
    monkeypatch.setattr(time, "time", lambda: now - 60)  # a probe from the future: the clock moved
    assert cache.get("worked") is None


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b'{"format": 2, "probes": {"k": {"info": null, "dev',  # truncated
        b'{"fo',
        b'{"format": 1, "probes": {}}',
        b'{"format": 2, "probes": []}',
    ],
)
def test_a_damaged_file_is_ignored_and_rewritten(tmp_path, content: bytes) -> None:
    path = tmp_path / "probes.json"
    path.write_bytes(content)
    cache = ProbeCache(path)
    assert cache.get("k") is None
    cache.put("k", worked())
    assert json.loads(path.read_text())["format"] == 2
    assert ProbeCache(path).get("k") is not None


@pytest.mark.parametrize("content", [b"not json at all", b"\xff\xfe\x00garbage", b"[1, 2, 3]", b"\x7fELF\x02"])
def test_a_file_that_is_no_probe_cache_is_never_written_over(tmp_path, caplog, content: bytes) -> None:
    """PIE_PROBE_CACHE naming another file by mistake (~/.bashrc, /bin/ls as root) replaced it with probes."""
    path = tmp_path / "notes.txt"
    path.write_bytes(content)
    cache = ProbeCache(path)
    cache.put("k", worked())
    cache.clear()
    assert path.read_bytes() == content and cache.get("k") is None
    assert "left alone" in caplog.text and str(path) in caplog.text


def test_a_link_that_leads_nowhere_is_not_replaced(tmp_path) -> None:
    loop = tmp_path / "loop"
    loop.symlink_to(tmp_path / "other")
    (tmp_path / "other").symlink_to(loop)
    ProbeCache(loop).put("k", worked())
    assert loop.is_symlink() and os.readlink(loop) == str(tmp_path / "other")


@pytest.mark.parametrize(
    "damage",
    [
        {"at": "yesterday"},
        {"at": True},
        {"devices": [{"engine": 1}]},
        {"devices": [{**json.loads(json.dumps(DEVICE.__dict__)), "kind": "toaster"}]},
        {"devices": [{**json.loads(json.dumps(DEVICE.__dict__)), "memory_bytes": "lots"}]},
        {"devices": "none"},
        {"kernels": "add"},
        {"error": None},
        {"info": {"name": "acme"}},
        {"info": {**INFO.__dict__, "kernel_languages": "acme-ir"}},
    ],
)
def test_a_record_of_the_wrong_shape_is_ignored(tmp_path, damage: dict) -> None:
    path = tmp_path / "probes.json"
    cache = ProbeCache(path)
    cache.put("k", worked())
    data = json.loads(path.read_text())
    data["probes"]["k"].update(damage)
    path.write_text(json.dumps(data))
    assert ProbeCache(path).get("k") is None


def test_a_path_that_is_not_a_file_is_left_alone(tmp_path) -> None:
    folder = tmp_path / "a-folder"
    folder.mkdir()
    cache = ProbeCache(folder)
    cache.put("k", worked())  # nothing to write to, and nothing raised
    assert folder.is_dir() and not any(folder.iterdir())


def test_clear_forgets_every_probe(tmp_path) -> None:
    cache = ProbeCache(tmp_path / "probes.json")
    cache.put("a", worked())
    cache.put("b", failed())
    cache.clear()
    assert ProbeCache(tmp_path / "probes.json").get("a") is None and cache.get("b") is None


def test_the_key_ignores_pie_engines_and_follows_what_changes_a_probe(tmp_path, monkeypatch) -> None:
    key = cache_key("acme", "pie-engine-acme", "1.0")
    monkeypatch.setenv("PIE_ENGINES", "acme,cpu")
    monkeypatch.setenv("PIE_MODEL_DIR", str(tmp_path))
    assert cache_key("acme", "pie-engine-acme", "1.0") == key
    monkeypatch.setenv("PIE_CPU_ACTIVATIONS", "xyz")  # an engine's own setting: a corrected one misses the record
    assert cache_key("acme", "pie-engine-acme", "1.0") != key
    monkeypatch.delenv("PIE_CPU_ACTIVATIONS")
    monkeypatch.setenv("VK_ICD_FILENAMES", "/usr/share/vulkan/icd.d/lvp_icd.x86_64.json")
    driver_key = cache_key("acme", "pie-engine-acme", "1.0")
    assert driver_key != key
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    before = cache_key("acme", "pie-engine-acme", "1.0")
    (site / "acme_driver-2.0.dist-info").mkdir()  # what `pip install acme-driver` does to the folder
    assert cache_key("acme", "pie-engine-acme", "1.0") != before
    assert cache_key("acme", "pie-engine-acme", "1.1") != cache_key("acme", "pie-engine-acme", "1.0")


def test_a_failure_read_from_the_cache_says_so_and_how_to_probe_again(install_engine, tmp_path) -> None:
    install_engine("probeerr", fake_engines.PROBE_ERROR)
    cache_path = tmp_path / "probes.json"
    fresh = EngineRegistry(env={}, probe_cache=ProbeCache(cache_path)).status("probeerr", cached=True)
    assert fresh.status == "broken" and "remembered" not in fresh.reason
    remembered = EngineRegistry(env={}, probe_cache=ProbeCache(cache_path)).status("probeerr", cached=True)
    assert remembered.reason.startswith(fresh.reason)
    assert "remembered from a probe" in remembered.reason and "`pie engines --refresh`" in remembered.reason


def test_an_engine_asked_for_is_probed_again_when_its_failure_is_remembered(install_engine, tmp_path) -> None:
    install_engine("acme", fake_engines.WORKING)
    cache = ProbeCache(tmp_path / "probes.json")
    cache.put(cache_key("acme", "pie-engine-acme", "9.9"), Probe(INFO, error="device probe failed: no driver"))
    registry = EngineRegistry(env={}, probe_cache=cache)
    assert registry.status("acme", cached=True).status == "broken"  # listing trusts what it remembers
    device, _ = registry.select("acme")  # the user may have installed the driver since
    assert device.name == "acme"
    assert ProbeCache(tmp_path / "probes.json").get(cache_key("acme", "pie-engine-acme", "9.9")).error == ""


def test_probes_are_shared_by_every_pie_engines_value(install_engine, tmp_path) -> None:
    install_engine("acme", fake_engines.WORKING)
    cache_path = tmp_path / "probes.json"
    EngineRegistry(env={"PIE_ENGINES": "acme"}, probe_cache=ProbeCache(cache_path)).statuses()
    EngineRegistry(env={"PIE_ENGINES": "acme,cpu"}, probe_cache=ProbeCache(cache_path)).statuses()
    probes = json.loads(cache_path.read_text())["probes"]
    assert len(probes) == 2, "one record per engine (acme, cpu), whatever PIE_ENGINES selected"


def test_records_too_old_or_damaged_are_dropped_when_another_is_written(tmp_path, monkeypatch) -> None:
    path = tmp_path / "probes.json"
    cache = ProbeCache(path)
    cache.put("old", worked())
    cache.put("failed", failed())
    data = json.loads(path.read_text())
    data["probes"]["damaged"] = {"at": "yesterday"}
    path.write_text(json.dumps(data))
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + MAX_AGE_SECONDS + 1)
    ProbeCache(path).put("new", Probe(INFO, (DEVICE,)))
    assert set(json.loads(path.read_text())["probes"]) == {"new"}


# -- failures of this process, not of the engine --------------------------------

SHORT_OF_FILES = fake_engines.WORKING.replace(
    'return [DeviceInfo(NAME, 0, "Fake Device", "Acme", "fake1", "gpu", 1 << 30)]',
    "import errno\n    raise OSError(errno.EMFILE, 'Too many open files')",
)
KILLED_IN_PROBE = fake_engines.WORKING.replace(
    'return [DeviceInfo(NAME, 0, "Fake Device", "Acme", "fake1", "gpu", 1 << 30)]',
    "import os, signal\n    os.kill(os.getpid(), signal.SIGKILL)",
)


def _refuse_to_spawn(*args, **kwargs):
    raise OSError(errno.EMFILE, "Too many open files")


@pytest.mark.parametrize("how", ["spawn", "in the child", "killed"])
def test_a_probe_that_failed_for_want_of_this_process_is_not_remembered(
    install_engine, tmp_path, monkeypatch, how: str
) -> None:
    """`ulimit -n 16; pie engines --refresh` made the next ten minutes of `pie run` pass over the CPU engine,
    remembered as broken with the fix "pip install --force-reinstall"."""
    install_engine("acme", {"spawn": fake_engines.WORKING, "in the child": SHORT_OF_FILES,
                            "killed": KILLED_IN_PROBE}[how])
    cache_path = tmp_path / "probes.json"
    with monkeypatch.context() as patch:
        if how == "spawn":
            patch.setattr(subprocess, "Popen", _refuse_to_spawn)
        status = EngineRegistry(env={"PIE_ENGINES": "acme"}, probe_cache=ProbeCache(cache_path)).status("acme")
    assert status.status == "broken", status
    expected = {"spawn": "could not start a probe process: [Errno 24] Too many open files",
                "in the child": "device probe failed: OSError: [Errno 24] Too many open files",
                "killed": "was killed (signal 9, SIGKILL) while probing devices"}[how]
    assert status.reason.startswith(expected), status.reason
    assert status.fix == SHORT_OF_RESOURCES_FIX and "pip install" not in status.fix
    key = cache_key("acme", "pie-engine-acme", "9.9")
    assert ProbeCache(cache_path).get(key) is None, "a failure of this process was remembered"
    if how == "spawn":  # with the files back, the engine works at once
        again = EngineRegistry(env={"PIE_ENGINES": "acme"}, probe_cache=ProbeCache(cache_path)).status("acme", True)
        assert again.status == "ok" and ProbeCache(cache_path).get(key) is not None


def test_a_failure_of_the_engine_itself_keeps_its_reinstall_fix_and_is_remembered(install_engine, tmp_path) -> None:
    install_engine("acme", fake_engines.IMPORT_ERROR)
    cache_path = tmp_path / "probes.json"
    status = EngineRegistry(env={"PIE_ENGINES": "acme"}, probe_cache=ProbeCache(cache_path)).status("acme")
    assert status.status == "broken" and status.fix == "pip install --force-reinstall pie-engine-acme"
    assert ProbeCache(cache_path).get(cache_key("acme", "pie-engine-acme", "9.9")) is not None


# -- failures of the user's settings, not of the engine ---------------------------


def test_a_setting_error_crosses_the_probe_child_and_is_not_remembered(install_engine, tmp_path) -> None:
    """The user corrects the variable next; and an engine's setting need not be one the cache key holds."""
    install_engine("acme", fake_engines.SETTING_ERROR)
    cache_path = tmp_path / "probes.json"
    for _ in range(2):
        status = EngineRegistry(env={"PIE_ENGINES": "acme"}, probe_cache=ProbeCache(cache_path)).status("acme", True)
        assert status.reason == "device probe failed: EngineSettingError: PIE_ACME_MODE is 'fast'; expected one of " \
            "slow, steady", status.reason  # the second time too: probed again, not "remembered from a probe"
        assert status.fix == SETTING_FIX and "pip install" not in status.fix
        assert ProbeCache(cache_path).get(cache_key("acme", "pie-engine-acme", "9.9")) is None


def test_the_setting_flag_survives_a_probe_record_and_the_cache_keeps_none(tmp_path) -> None:
    probe = Probe(INFO, error="device probe failed: EngineSettingError: PIE_ACME_MODE is 'fast'", setting=True)
    back = probe_from_record(json.loads(json.dumps(probe_record(probe))))  # what a probe child reports
    assert back.setting and not back.transient and back.error == probe.error
    assert not probe_from_record(probe_record(failed())).setting
    cache = ProbeCache(tmp_path / "probes.json")
    cache.put("k", probe)
    assert cache.get("k") is None and ProbeCache(tmp_path / "probes.json").get("k") is None
