from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from pie import __version__
from pie.cli import INTERNAL_ERROR_EXIT, PieApp, app
from pie.testing.models import make_gguf_model

runner = CliRunner()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return make_gguf_model(tmp_path_factory.mktemp("m") / "tiny.gguf", "F32")


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"pie {__version__}"


def test_python_dash_m_pie_is_the_pie_command() -> None:
    """For an environment whose scripts folder is not on PATH (``python -m pie.entry`` printed nothing)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "pie", "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"pie {__version__}", done


def test_engines_json_lists_cpu_and_the_choice(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PIE_PROBE_CACHE", str(tmp_path / "probes.json"))
    result = runner.invoke(app, ["engines", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    cpu = next(e for e in report["engines"] if e["name"] == "cpu")
    assert cpu["status"] == "ok" and cpu["distribution"] == "pie-engine-cpu"
    assert cpu["devices"][0]["kind"] == "cpu" and cpu["devices"][0]["memory_bytes"] > 0
    assert report["chosen"]["engine"] and report["chosen"]["reason"]


def test_engines_table_says_which_engine_runs_and_why(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PIE_PROBE_CACHE", str(tmp_path / "probes.json"))
    monkeypatch.setenv("PIE_ENGINES", "cpu")
    result = runner.invoke(app, ["engines"])
    assert result.exit_code == 0
    assert "chosen: cpu on cpu:0 (first of PIE_ENGINES=cpu)" in result.output


def test_doctor_reports_each_engine_and_how_to_install_missing_ones() -> None:
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    assert "cpu (pie-engine-cpu" in result.output and "[ok] numpy" in result.output


def test_plan_prints_regions_and_chosen_kernels(tiny_gguf) -> None:
    result = runner.invoke(app, ["plan", str(tiny_gguf), "--engine", "cpu"])
    assert result.exit_code == 0, result.output
    assert "L0.attn_in" in result.output and "L1.mlp_out" in result.output
    assert re.search(r"-> rms_norm_gate_up_silu(\[[^\]]*\])? \(fused\)", result.output), result.output
    # The CPU engine runs the attention region as one launch where its native kernels build.
    attention = r"L0\.attention +append_kv \+ attention\n +-> (append_kv(\[[^\]]*\])? \(primitive\)|region \(whole region\))"
    assert re.search(attention, result.output), result.output


def test_plan_emit_writes_sources_and_refuses_a_folder_it_cannot_make_before_loading(tiny_gguf, tmp_path) -> None:
    folder = tmp_path / "sources" / "cpu"
    result = runner.invoke(app, ["plan", str(tiny_gguf), "--engine", "cpu", "--emit", str(folder)])
    assert result.exit_code == 0, result.output
    written = int(re.search(r"wrote (\d+) source file\(s\)", result.output).group(1))
    assert folder.is_dir() and written == len(list(folder.iterdir()))  # the CPU engine shows no generated source
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for emit, status, message in ((str(a_file), 1, f"--emit {a_file}: cannot make that folder (File exists)"),
                                  ("", 2, "--emit is empty: give a folder to write the sources into")):
        result = runner.invoke(app, ["plan", str(tiny_gguf), "--engine", "cpu", "--emit", emit])
        assert result.exit_code == status, result.output
        assert message in result.output and "L0.attn_in" not in result.output, "refused before the plan is made"


def test_run_streams_text_on_a_tiny_model(tiny_gguf) -> None:
    result = runner.invoke(app, ["run", "Hello", "--model", str(tiny_gguf), "--engine", "cpu", "--max-tokens", "5"])
    assert result.exit_code == 0, result.output
    assert "cpu:0" in result.output


def test_run_with_a_logit_epilogue(tiny_gguf) -> None:
    args = ["run", "Hi", "--model", str(tiny_gguf), "--engine", "cpu", "--max-tokens", "3", "--no-chat"]
    epilogue = ["--logit-epilogue", "in x: f32\nparam cap: f32; out y = cap * tanh(x / cap)  # not a \\newline",
                "--logit-param", "cap=2"]
    assert runner.invoke(app, args + epilogue).exit_code == 0
    result = runner.invoke(app, args + ["--logit-epilogue", "in x: f32; out y = x +* 1"])
    assert result.exit_code == 1 and "column" in result.output


def test_a_logit_epilogue_that_is_not_utf8_is_named(tiny_gguf) -> None:
    """Bytes that are not UTF-8 (what a shell passes for $'\\xff') were named as the character '\\udcff'."""
    args = ["run", "Hi", "--model", str(tiny_gguf), "--engine", "cpu", "--max-tokens", "3"]
    result = runner.invoke(app, [*args, "--logit-epilogue", "in x: f32; out y = x \udcff"])
    assert result.exit_code == 1, result.output
    assert "--logit-epilogue is not valid UTF-8 (character 22 is not)" in result.output and "udcff" not in result.output


def test_run_reads_a_logit_epilogue_as_pie_eta_does(tiny_gguf) -> None:
    """A backslash-n is no line break for either command: both refuse it at the same column."""
    source = "in x: f32\\nout y = x"
    eta = runner.invoke(app, ["eta", source])
    run = runner.invoke(app, ["run", "Hi", "--model", str(tiny_gguf), "--engine", "cpu", "--logit-epilogue", source])
    assert eta.exit_code == run.exit_code == 1
    assert "pie: line 1, column 10: unexpected character '\\\\'; statements are separated by ';'" in eta.output
    assert eta.output in run.output


def test_an_engine_that_is_not_installed_is_a_clear_error(tiny_gguf) -> None:
    result = runner.invoke(app, ["run", "Hello", "--model", str(tiny_gguf), "--engine", "nosuch"])
    assert result.exit_code == 1
    assert "engine 'nosuch' is not installed" in result.output


def test_a_missing_model_file_is_a_clear_error(tmp_path) -> None:
    result = runner.invoke(app, ["run", "Hello", "--model", str(tmp_path / "nope.gguf"), "--engine", "cpu"])
    assert result.exit_code == 1
    assert "nope.gguf" in result.output


def _failing_app() -> PieApp:
    """A PieApp whose only command (run without naming it) fails as a bug would."""
    failing = PieApp()

    @failing.command()
    def explode() -> None:
        raise LookupError("first line\nsecond line")

    return failing


def test_running_out_of_memory_is_the_users_limit_not_an_internal_error(capsys) -> None:
    starved = PieApp()

    @starved.command()
    def allocate() -> None:
        raise MemoryError("Unable to allocate 172. GiB for an array")

    with pytest.raises(SystemExit) as exit_info:
        starved([], prog_name="pie")
    assert exit_info.value.code == 1
    assert capsys.readouterr().err.splitlines() == [
        "pie: not enough memory for what was asked (Unable to allocate 172. GiB for an array): ask for less (a smaller "
        "--kv-tokens, --concurrency or model)"]


def test_a_thread_the_system_refuses_is_the_users_limit_not_an_internal_error(capsys) -> None:
    # What `ulimit -v 200000; pie serve` raised (an internal error with a report): threading's RuntimeError.
    limited = PieApp()

    @limited.command()
    def serve() -> None:
        raise RuntimeError("can't start new thread")  # threading.Thread.start's words, on Python 3.10 to 3.14

    with pytest.raises(SystemExit) as exit_info:
        limited([], prog_name="pie")
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "the system refused a new thread" in err and "ulimit" in err and "internal error" not in err


def test_an_internal_error_is_one_line_naming_its_report(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("PIE_ENGINES", "cpu")
    with pytest.raises(SystemExit) as exit_info:
        _failing_app()([], prog_name="pie")
    assert exit_info.value.code == INTERNAL_ERROR_EXIT
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("pie: internal error: LookupError: first line (the full report is in ")
    (report,) = (tmp_path / "state" / "pie" / "log").iterdir()
    assert line.endswith(f"{report})")
    text = report.read_text()
    assert text.startswith(f"pie {__version__}, Python ") and "PIE_ENGINES=cpu" in text
    assert "Traceback (most recent call last)" in text and 'raise LookupError("first line\\nsecond line")' in text


def test_an_internal_error_without_a_writable_log_folder_says_so(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "state").write_text("a file where the folder would go")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    with pytest.raises(SystemExit):
        _failing_app()([], prog_name="pie")
    (line,) = capsys.readouterr().err.splitlines()
    assert "no report could be written" in line and "pie --debug" in line


def test_debug_prints_the_traceback_and_writes_no_report(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    failing = _failing_app()
    failing.debug = True
    with pytest.raises(SystemExit) as exit_info:
        failing([], prog_name="pie")
    assert exit_info.value.code == INTERNAL_ERROR_EXIT
    assert "Traceback (most recent call last)" in capsys.readouterr().err
    assert not (tmp_path / "state").exists()


def test_a_user_error_is_not_an_internal_one(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    with pytest.raises(SystemExit) as exit_info:
        app(["run", "--max-tokens", "0", "hi"], prog_name="pie")
    assert exit_info.value.code == 2 and "--max-tokens" in capsys.readouterr().err
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("args,message", [
    (["run", "--kv-tokens", "0", "hi"], "--kv-tokens"),
    (["serve", "--kv-tokens", "0"], "--kv-tokens must be at least 1"),
    (["run"], "give a prompt, or --inferlet FILE"),
    (["run", "tell", "me", "more"], "give the prompt as one quoted argument"),
    (["run", "--temperature", "nan", "hi"], "temperature must be a finite number"),
    (["run", "--logit-param", "cap=2", "hi"], "--logit-param needs --logit-epilogue"),
    (["run", "--logit-epilogue", "in x: f32; out y = x", "--logit-param", "cap", "hi"], "'cap' is not NAME=VALUE"),
    (["run", "--logit-epilogue", "in x: f32; out y = x", "--logit-param", "cap=big", "hi"], "'big' is not a number"),
    (["bench", "--runs", "0"], "--runs"),
    (["bench", "--concurrency", "-1"], "--concurrency"),
    (["bench", "--concurrency", "100000"], "--concurrency 100000: at most 512, the most requests the scheduler"),
    (["eta", "softmax", "--target", "ptx"], "unknown target 'ptx'"),
    # An empty path ("$FILE" of an unset variable) was taken for the current folder, and named it: ". is a folder".
    (["run", "--inferlet", ""], "--inferlet is empty: give an inferlet's file or package folder"),
    (["run", "--json-schema", "", "hi"], "--json-schema is empty: give the path of a file that holds a JSON schema"),
    (["tune", "-o", ""], "-o is empty: give the profile file to write"),
    (["profile", "plot", "mine", "-o", " "], "-o is empty: give the PNG file to write"),
    (["model", "import", ""], "the path is empty: give a GGUF file or a Hugging Face model's folder to import"),
])
def test_a_wrong_command_line_exits_2_under_every_command(args: list[str], message: str) -> None:
    """One status for one kind of mistake: ``--kv-tokens 0`` was 2 under ``run`` and 1 under ``serve``."""
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and message in result.output, result.output


@pytest.mark.parametrize("prompt_tokens", [300, 10**12])
def test_bench_past_the_models_context_names_the_context(tiny_gguf, prompt_tokens: int) -> None:
    """A request past both the context (256 tokens) and the device's memory was refused for the memory its KV cache
    would take ("not enough memory for a KV cache of 1000000000017 tokens"), not for the context."""
    result = runner.invoke(app, ["bench", "--model", str(tiny_gguf), "--engine", "cpu", "--prompt-tokens",
                                 str(prompt_tokens), "--decode-tokens", "1"])
    assert result.exit_code == 1, result.output
    assert (f"--prompt-tokens {prompt_tokens} and --decode-tokens 1 make {prompt_tokens + 1} tokens, more than the "
            "model's context of 256") in result.output, result.output


def test_bench_help_names_the_most_concurrency() -> None:
    from pie.scheduler.bench import MAX_CONCURRENCY

    result = runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and f"at most {MAX_CONCURRENCY}" in result.output, result.output


def test_eta_help_names_every_target() -> None:
    from pie.cli import ETA_TARGETS_HELP
    from pie.eta import TARGETS

    assert ETA_TARGETS_HELP.replace(" or ", ", ").split(", ") == list(TARGETS)


@pytest.mark.parametrize("name", ["COLUMNS", "LINES"])
@pytest.mark.parametrize("value", ["0", "-3", "wide", "²"])
def test_help_under_a_terminal_size_that_is_no_size_lists_the_commands(name, value, monkeypatch, capsys) -> None:
    # COLUMNS=0 printed an empty page, COLUMNS=² and LINES=² were internal errors. Through app() itself:
    # CliRunner.invoke calls typer's click command and skips PieApp.__call__, where the size is made usable.
    monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        app(["--help"], prog_name="pie")
    assert exit_info.value.code == 0
    assert {"engines", "doctor", "serve", "profile"} <= set(re.findall(r"^│ (\w+) ", capsys.readouterr().out, re.M))
