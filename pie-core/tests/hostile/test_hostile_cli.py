"""Hostile command lines for `pie run`, `pie tune` and the rule for every command: a message, never a traceback.

Each case runs the real `pie` in a child process (see `pie_process`). The internal-error cases use a
genuinely broken engine plugin, installed as a real distribution, whose upload hook divides by zero.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

from pie_process import PIE, PieResult, assert_ok, assert_user_error, run_pie
from pie.testing.models import make_gguf_model

BROKEN_ENGINE = '''
import numpy as np
from pie.contract import CONTRACT_VERSION, DeviceInfo, EngineInfo
from pie.hookspecs import hookimpl

@hookimpl
def pie_engine_info():
    return EngineInfo("broken", CONTRACT_VERSION, 1, ("numpy",), "an engine whose upload has a bug")

@hookimpl
def pie_probe_devices():
    return [DeviceInfo("broken", 0, "Broken Device", "Acme", "b1", "gpu", 1 << 30)]

@hookimpl
def pie_list_kernels(device):
    return {"add": ("numpy",), "append_kv": ("numpy",), "attention": ("numpy",)}

@hookimpl
def pie_compile_kernel(device, request):
    return lambda *args: None

@hookimpl
def pie_allocate_pages(device, layout):
    return np.zeros(layout.shape, np.float32)

@hookimpl
def pie_upload(device, array):
    return 1 / 0

@hookimpl
def pie_download(device, tensor):
    return np.array(tensor)
'''


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_gguf_model(tmp_path_factory.mktemp("model") / "tiny.gguf", "F32"))


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with its final norm's weights set to NaN: every logit is NaN."""
    path = make_gguf_model(tmp_path_factory.mktemp("nan") / "nan.gguf", "F32")
    (norm,) = [t for t in GGUFReader(path, "r+").tensors if t.name == "output_norm.weight"]
    norm.data[:] = np.nan
    norm.data.flush()
    return str(path)


@pytest.fixture
def env(pie_env: dict[str, str]) -> dict[str, str]:
    """`pie_env`, wide enough that a usage error's box keeps each message on one line."""
    return {**pie_env, "COLUMNS": "250"}


def pie_run(model: str, *args: str, env: dict[str, str]) -> PieResult:
    return run_pie("run", "--model", model, "--max-tokens", "4", *args, env=env)


# -- tracebacks before -------------------------------------------------------------------------------


def test_a_prompt_that_is_not_utf8(model: str, env: dict[str, str]) -> None:
    # What a shell passes for $'\xff\xfe': Python holds the bytes as lone surrogates.
    assert_user_error(pie_run(model, "\udcff\udcfe", env=env), "the prompt is not valid UTF-8")


def test_a_negative_seed(model: str, env: dict[str, str]) -> None:
    assert_user_error(pie_run(model, "--seed", "-1", "--temperature", "1", "hi", env=env), "seed", ">= 0")


@pytest.mark.parametrize("args", [["--version"], ["engines"], ["run", "--max-tokens", "4", "hi"]])
def test_output_to_a_full_device(model: str, env: dict[str, str], args: list[str]) -> None:
    # Was an internal error with a report (`pie engines > /dev/full`): the disk is the user's to free.
    if args[0] == "run":
        args = [*args, "--model", model]
    result = run_pie(*args, env=env, stdout="full")
    assert_user_error(result, "cannot write the output: No space left on device")
    assert result.returncode == 1 and "internal error" not in result.stderr and "Exception ignored" not in result.stderr


def test_output_with_stdout_closed(model: str, env: dict[str, str]) -> None:
    # `pie run ... >&-` was an internal error ('NoneType' object has no attribute 'write'); the text goes nowhere.
    assert_ok(run_pie("run", "--model", model, "--max-tokens", "4", "hi", env=env, stdout="closed"))


@pytest.mark.parametrize(("setting", "printed"), [
    ({"PYTHONIOENCODING": "ascii"}, "caf\\xe9 \\ud800"),
    ({"PYTHONIOENCODING": "utf-8"}, "café \\ud800"),
    ({"PYTHONIOENCODING": "", "LC_ALL": "C.UTF-8"}, "café \\ud800"),  # every stock container: surrogateescape
], ids=["ascii", "utf-8", "c-utf-8-locale"])
def test_output_a_terminal_cannot_encode(
    model: str, tmp_path: Path, env: dict[str, str], setting: dict[str, str], printed: str
) -> None:
    # An ASCII terminal stopped the output at its first other character (UnicodeEncodeError), and half a surrogate
    # pair (which no encoding holds) did so on any terminal: both are written as escapes.
    inferlet = tmp_path / "says.py"
    inferlet.write_text('async def main(ctx, args):\n    return "caf\\u00e9 \\ud800"\n')
    result = run_pie("run", "--model", model, "--inferlet", str(inferlet), env={**env, **setting})
    assert_ok(result)
    assert result.stdout == printed + "\n"


def test_an_unknown_cpu_activation_setting(model: str, env: dict[str, str]) -> None:
    # Not a reason to fall back to the numpy kernels without a word: the setting is named.
    result = pie_run(model, "--engine", "cpu", "hi", env={**env, "PIE_CPU_ACTIVATIONS": "int4"})
    assert_user_error(result, "PIE_CPU_ACTIVATIONS is 'int4'", "expected one of float, int8, int16")


def test_an_unknown_cpu_activation_setting_with_no_engine_named(model: str, env: dict[str, str]) -> None:
    # Ran on the XLA engine, the setting's error only in the dim status line: the user's setting is theirs to
    # correct, never a reason to run another engine.
    result = pie_run(model, "hi", env={**env, "PIE_ENGINES": "", "PIE_CPU_ACTIVATIONS": "xyz"})
    assert_user_error(result, "PIE_CPU_ACTIVATIONS is 'xyz'", "expected one of float, int8, int16", "--engine")
    assert result.returncode == 1, result
    assert result.stdout == "" and "highest priority" not in result.stderr, f"it ran on another engine: {result}"


@pytest.mark.parametrize("args", [["--kv-tokens", "99999999999"], ["--kv-tokens", str(10**9)]])
def test_a_kv_cache_beyond_the_devices_memory(model: str, env: dict[str, str], args: list[str]) -> None:
    # Was an internal error (MemoryError) for the first, and for the second a failure deep in the engine.
    assert_user_error(pie_run(model, *args, "hi", env=env), f"not enough memory for a KV cache of {args[1]} tokens")


def test_an_unknown_logit_param(model: str, env: dict[str, str]) -> None:
    result = pie_run(model, "--logit-epilogue", "in x: f32; out y = x", "--logit-param", "cap=1", "hi", env=env)
    assert_user_error(result, "no param named 'cap'")


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_nan_logits_from_an_epilogue(model: str, env: dict[str, str], sampled: bool) -> None:
    flags = ["--temperature", "1", "--seed", "3"] if sampled else []
    result = pie_run(model, *flags, "--logit-epilogue", "in x: f32; out y = (x - x) * inf", "hi", env=env)
    assert_user_error(result, "logits hold NaN", "--logit-epilogue made them")


def test_nan_logits_from_the_weights(nan_model: str, env: dict[str, str]) -> None:
    """It blamed the model alone ("the model made them (damaged weights?)"): an engine can compute NaN too."""
    assert_user_error(pie_run(nan_model, "hi", env=env), "logits hold NaN", "engine 'cpu' produced them on cpu:0",
                      "the model's weights may be damaged, or the engine may compute wrongly")


def test_a_damaged_tune_partial_is_named_before_the_tune(
    tmp_path: Path, env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pie.plugins import EngineRegistry
    from pie.profiles.tuner import Tuner, TuneSettings

    monkeypatch.setenv("PIE_ENGINES", "cpu")  # probe no other engine here (jax's threads would then meet fork)
    target = tmp_path / "mine.toml"
    partial = tmp_path / "mine.partial.json"
    key = Tuner(EngineRegistry().select("cpu")[0], TuneSettings.quick(), partial)._run_key()
    partial.write_text(json.dumps({"format": 1, "key": key, "seconds": float("nan"), "cells": {}}))
    result = run_pie("tune", "--engine", "cpu", "--budget", "1", "-o", str(target), env=env)
    assert_ok(result, f"{partial}: its measurements make no valid profile", "tune.seconds", "measuring from scratch")
    assert target.is_file() and not partial.exists()


# -- nonsense accepted before ------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "-1"])
def test_max_tokens_below_one(model: str, env: dict[str, str], value: str) -> None:
    result = run_pie("run", "--model", model, "--max-tokens", value, "hi", env=env)
    assert_user_error(result, "--max-tokens", "greater than or equal to 1")


@pytest.mark.parametrize(
    ("setting", "needle"),
    [
        (["--temperature", "nan"], "temperature must be a finite number"),
        (["--temperature", "inf"], "temperature must be a finite number"),
        (["--top-p", "nan"], "top_p"),
        (["--min-p", "nan"], "min_p"),
        (["--top-k", "-1"], "top_k"),
    ],
)
def test_sampling_values_that_cannot_sample(model: str, env: dict[str, str], setting: list[str], needle: str) -> None:
    assert_user_error(pie_run(model, *setting, "hi", env=env), needle)


def test_an_epilogue_with_two_outputs_as_the_logit_epilogue(model: str, env: dict[str, str]) -> None:
    result = pie_run(model, "--logit-epilogue", "in x: f32; out y = x; out z = x * 2.0", "hi", env=env)
    assert_user_error(result, "one f32 output", "y: f32, z: f32")


@pytest.mark.parametrize(
    "flags",
    [["--temperature", "0.7"], ["--logit-epilogue", "in x: f32; out y = x"], ["--max-tokens", "5", "--no-chat"]],
    ids=["sampling", "epilogue", "length and template"],
)
def test_prompt_options_with_an_inferlet(model: str, tmp_path: Path, env: dict[str, str], flags: list[str]) -> None:
    inferlet = tmp_path / "ok.py"
    inferlet.write_text("async def main(ctx, args):\n    return 'ran'\n")
    result = run_pie("run", "--model", model, "--inferlet", str(inferlet), *flags, env=env)
    assert_user_error(result, flags[0], "cannot be used with --inferlet")
    assert "ran" not in result.stdout


def test_an_inferlet_timeout_without_an_inferlet(model: str, env: dict[str, str]) -> None:
    assert_user_error(pie_run(model, "--inferlet-timeout", "5", "hi", env=env), "--inferlet-timeout", "without")


def test_an_unquoted_prompt(model: str, env: dict[str, str]) -> None:
    assert_user_error(pie_run(model, "tell", "me", "more", env=env), "one quoted argument", "me more")


# -- the KV cache --------------------------------------------------------------------------------------


def test_kv_tokens_below_one(model: str, env: dict[str, str]) -> None:
    assert_user_error(pie_run(model, "--kv-tokens", "0", "hi", env=env), "--kv-tokens", "greater than or equal to 1")


def test_a_kv_cache_too_small_while_generating(model: str, env: dict[str, str]) -> None:
    result = run_pie("run", "--model", model, "--kv-tokens", "16", "--max-tokens", "64", "hi there", env=env)
    assert_user_error(result, "KV cache")


def test_a_kv_cache_that_fits(model: str, env: dict[str, str]) -> None:
    assert_ok(run_pie("run", "--model", model, "--kv-tokens", "128", "--max-tokens", "4", "hi", env=env))


# -- internal errors -------------------------------------------------------------------------------------


@pytest.fixture
def broken_engine_env(tmp_path: Path, env: dict[str, str]) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "pie_engine_broken_plugin.py").write_text(BROKEN_ENGINE)
    info = site / "pie_engine_broken-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pie-engine-broken\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[pie.engines]\nbroken = pie_engine_broken_plugin\n")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {**env, "PYTHONPATH": path, "PIE_ENGINES": "broken,cpu", "XDG_STATE_HOME": str(tmp_path / "state")}


def test_an_internal_error_is_one_line_and_a_report(model: str, broken_engine_env: dict[str, str]) -> None:
    result = run_pie("run", "--model", model, "--engine", "broken", "hi", env=broken_engine_env)
    assert result.returncode == 70, result
    assert_user_error(result, "internal error: ZeroDivisionError: division by zero", "the full report is in")
    (line,) = [text for text in result.stderr.splitlines() if "internal error" in text]
    report = Path(line.split("the full report is in ")[1].rstrip(")"))
    assert report.parent == Path(broken_engine_env["XDG_STATE_HOME"]) / "pie" / "log"
    text = report.read_text()
    assert "command: pie run --model" in text and "PIE_ENGINES=broken,cpu" in text
    assert "Traceback (most recent call last)" in text and "in pie_upload" in text


@pytest.mark.parametrize("how", ["--debug", "PIE_DEBUG=1"])
def test_debug_shows_the_traceback_instead(model: str, broken_engine_env: dict[str, str], how: str) -> None:
    env = {**broken_engine_env, "PIE_DEBUG": "1"} if how == "PIE_DEBUG=1" else broken_engine_env
    flags = ["--debug"] if how == "--debug" else []
    result = run_pie(*flags, "run", "--model", model, "--engine", "broken", "hi", env=env)
    assert result.returncode == 70, result
    assert "Traceback (most recent call last)" in result.stderr and "ZeroDivisionError" in result.stderr
    assert not (Path(broken_engine_env["XDG_STATE_HOME"]) / "pie" / "log").exists()


@pytest.mark.parametrize("after_s", [0.05, 0.2, 0.4])
def test_a_ctrl_c_while_pie_starts_is_no_traceback(env: dict[str, str], after_s: float) -> None:
    """A Ctrl-C in the first half second (pie importing its modules, typer building its commands) printed a
    traceback; a later one already ended it with 130 and no word."""
    process = subprocess.Popen([PIE, "engines"], env={**os.environ, **env}, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    time.sleep(after_s)  # where the interrupt lands: any moment of the start must do
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=120)
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr
    assert process.returncode in (0, 130, -signal.SIGINT), (process.returncode, stderr)
