"""The `pie` command. Commands stay thin: the work lives in the modules they call.

Errors: a command turns what a user got wrong into one line (``pie: ...``, exit 1). Anything else
that escapes a command is a bug of pie: `PieApp` writes its traceback to a report file and prints
one line naming it (exit 70), or prints the traceback itself under ``pie --debug`` (PIE_DEBUG=1).
"""

from __future__ import annotations

import codecs
import errno
import json
import os
import platform
import sys
import threading
import traceback
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, NoReturn, Optional

import typer

from pie import __version__
from pie.cli_errors import fail, path_argument, usage, utf8_argument
from pie.contract import KvDtype
from pie.model.errors import is_rust_panic
from pie.weights import Dtype

INTERNAL_ERROR_EXIT = 70
"""Exit status of an internal error (EX_SOFTWARE of sysexits.h); a user's error exits with 1."""

DtypeOption = Annotated[Dtype, typer.Option(
    help="The type the model's matrices load in: auto keeps its files' types; float32, float16 and bfloat16 "
    "convert its float matrices (a block-quantized one to float32 only).")]


class PieApp(typer.Typer):
    """The typer app, with one rule for every subcommand: no traceback reaches the terminal unless
    ``--debug`` asks for it."""

    debug: bool = False
    """Set from ``--debug`` / PIE_DEBUG before any command runs."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        running = set(threading.enumerate())
        try:
            return self._call(*args, **kwargs)
        except SystemExit as exc:
            _exit_past_lingering_threads(exc, running)
            raise

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        _usable_output()
        _usable_terminal_size()
        try:
            return super().__call__(*args, **kwargs)
        except OSError as exc:
            if exc.errno not in FULL_DEVICE:
                raise _internal_error(exc, self.debug) from None
            where = exc.filename or "the output"  # no name: a write to stdout or stderr
            _exit_quietly(1, f"pie: cannot write {where}: {exc.strerror}")
        except MemoryError as exc:  # what the machine has, not a fault of pie's
            detail = f" ({exc})" if str(exc) else ""
            typer.secho(f"pie: not enough memory for what was asked{detail}: ask for less (a smaller --kv-tokens, "
                        "--concurrency or model)", err=True, fg=typer.colors.RED)
            sys.exit(1)
        except Exception as exc:  # click has handled usage errors, Exit, Abort and a closed stdout pipe
            if isinstance(exc, RuntimeError) and str(exc) == NO_THREAD:  # threading's words for EAGAIN
                _exit_quietly(1, f"pie: the system refused a new thread ({exc}): a limit on memory (ulimit -v) or "
                              "processes (ulimit -u) is too low for pie")
            raise _internal_error(exc, self.debug) from None
        except BaseException as exc:
            if not is_rust_panic(exc):  # KeyboardInterrupt, SystemExit: Python's own handling
                raise
            raise _internal_error(exc, self.debug) from None  # a Rust library's panic, which is no Exception


NO_THREAD = "can't start new thread"
"""The message of the RuntimeError ``threading.Thread.start`` raises when the system refuses a thread."""
FULL_DEVICE = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
"""Errors of a write that the machine refuses (a full disk or quota, a file-size limit): the user's to fix."""


def _exit_past_lingering_threads(exc: SystemExit, running: set[threading.Thread]) -> None:
    """End the process now, with ``exc``'s status, where the command started a thread that is not a daemon and
    still runs (engine code, imported into this process, can leave one): Python waits for such a thread at exit,
    forever for one that never ends, after pie's work is done. pie's own threads (named pie-...) do not count."""
    if not any(t not in running and not t.daemon and not t.name.startswith("pie-") for t in threading.enumerate()):
        return
    code = exc.code
    if code is not None and not isinstance(code, int):  # sys.exit("message"), as Python's own exit says it
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or full output: what it held is lost either way
            pass
    os._exit(code or 0)


def _escape_unwritable(error: UnicodeError) -> tuple[bytes, int]:
    """An encoding error handler: what ``surrogateescape`` writes back as the bytes they stand for (U+DC80 to
    U+DCFF, from undecodable bytes of a file name, say) as those bytes, any other character as its escape."""
    if not isinstance(error, UnicodeEncodeError):
        raise error
    written = bytearray()
    for char in error.object[error.start : error.end]:
        point = ord(char)
        if 0xDC80 <= point <= 0xDCFF:
            written.append(point - 0xDC00)
        else:
            written += char.encode("ascii", "backslashreplace")
    return bytes(written), error.end


codecs.register_error("pie.escape", _escape_unwritable)


def _usable_output() -> None:
    """Output that takes whatever pie prints: a closed stdout or stderr (``>&-``) becomes /dev/null, and text the
    terminal's encoding cannot hold (``PYTHONIOENCODING=ascii``, a lone surrogate: under a C.UTF-8 locale Python's
    own ``surrogateescape`` takes only some of them) is written as escapes."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is None:
            setattr(sys, name, open(os.devnull, "w", encoding="utf-8"))  # noqa: SIM115 - open for the process's life
        elif getattr(stream, "errors", None) in ("strict", "surrogateescape") and hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="pie.escape")


def _usable_terminal_size() -> None:
    """Drop a COLUMNS or LINES that is not a size (0, negative, not a number), so the terminal's own is used, as
    ``shutil.get_terminal_size`` does: rich takes ``COLUMNS=0`` as a width of 0 and prints help, usage errors
    and progress bars as nothing, and ``LINES=²`` made every command an internal error."""
    for name in ("COLUMNS", "LINES"):
        value = os.environ.get(name)
        if value is not None and not (value.isdecimal() and int(value) > 0):
            del os.environ[name]


def _exit_quietly(code: int, message: str) -> NoReturn:
    """Say ``message`` on stderr if it still takes it, and exit with ``code``, dropping what stdout still holds:
    flushing it at exit would fail again, as a traceback."""
    try:
        typer.secho(message, err=True, fg=typer.colors.RED)
    except (OSError, ValueError):
        pass
    sys.stdout = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - the process is ending
    sys.exit(code)


def _internal_error(exc: BaseException, debug: bool) -> SystemExit:
    """Report a bug of pie (the traceback under --debug, else a report file and one line) and exit 70."""
    if debug:
        traceback.print_exception(exc)
    else:
        typer.secho(f"pie: {_internal_error_line(exc)}", err=True, fg=typer.colors.RED)
    return SystemExit(INTERNAL_ERROR_EXIT)


def _internal_error_line(exc: BaseException) -> str:
    """What went wrong and where the full report is, in one line."""
    lines = str(exc).strip().splitlines()
    what = f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__
    try:
        where = f"the full report is in {write_error_report(exc)}"
    except OSError as failure:
        where = f"no report could be written ({failure}); run `pie --debug ...` to see the traceback"
    return f"internal error: {what} ({where})"


def write_error_report(exc: BaseException) -> Path:
    """Write the versions, the command line, pie's environment variables and ``exc``'s traceback to a
    new file in the user log folder; returns its path."""
    import platformdirs

    folder = Path(platformdirs.user_log_dir("pie"))
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"error-{datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}.txt"
    lines = [
        f"pie {__version__}, Python {platform.python_version()}, {platform.platform()}",
        f"command: pie {' '.join(sys.argv[1:])}",
        *(f"{name}={value}" for name, value in sorted(os.environ.items()) if name.startswith("PIE_")),
        "",
        *traceback.format_exception(exc),
    ]
    path.write_text("\n".join(line.rstrip("\n") for line in lines) + "\n", encoding="utf-8", errors="backslashreplace")
    return path


app = PieApp(no_args_is_help=True, add_completion=False, help="Pie: one LLM serving runtime for every engine.")


def _version(value: bool) -> None:
    if value:
        typer.echo(f"pie {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        Optional[bool], typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = None,
    debug: Annotated[
        bool, typer.Option("--debug", envvar="PIE_DEBUG", help="Show the traceback of an internal error.")
    ] = False,
) -> None:
    """Pie: one LLM serving runtime for every engine."""
    app.debug = debug




@app.command()
def engines(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    refresh: Annotated[
        bool, typer.Option("--refresh", help="Probe every device afresh instead of using remembered probes.")
    ] = False,
) -> None:
    """List installed engines, their status and devices, and which one would run."""
    from pie.plugins import EngineError
    from pie.reports import engines_report, format_engines

    try:
        report = engines_report(cached=not refresh)
    except EngineError as exc:  # e.g. a PIE_PROBE_TIMEOUT that is not a number of seconds
        raise fail(str(exc)) from exc
    typer.echo(json.dumps(report, indent=2) if as_json else format_engines(report))


@app.command()
def doctor() -> None:
    """For each engine: what is missing (library, driver, system package) and the command that fixes it."""
    from pie.plugins import EngineError
    from pie.reports import doctor_report

    try:
        text, healthy = doctor_report()
    except EngineError as exc:
        raise fail(str(exc)) from exc
    typer.echo(text)
    if not healthy:
        raise typer.Exit(1)


@app.command()
def plan(
    model: Annotated[Optional[str], typer.Argument(help="Model name or path (default: the embedded default).")] = None,
    engine: Annotated[Optional[str], typer.Option(help="Engine to lower for.")] = None,
    emit: Annotated[
        Optional[str],
        typer.Option(help="Write each kernel's or region's generated source into this folder (e.g. stablehlo)."),
    ] = None,
    dtype: DtypeOption = "auto",
) -> None:
    """Print the Poem plan: regions and the kernel chosen for each, and the type each weight loads in."""
    from pie.plugins import EngineError
    from pie.reports import emit_sources
    from pie.runtime.llm import LLM
    from pie.runtime.model_runner import SequenceWork
    from pie.weights import describe_dtype_conversions

    if emit is not None:  # checked before the model loads: the sources are written after the plan is printed
        path_argument(emit, "--emit", "a folder to write the sources into")
        try:
            Path(emit).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise fail(f"--emit {emit}: cannot make that folder ({exc.strerror or exc})") from exc
    try:
        llm = LLM.load(model, engine, max_cached_tokens=64, dtype=dtype)
    except (EngineError, OSError, ValueError) as exc:
        raise fail(str(exc)) from exc
    typer.echo(llm.runner.plan.describe())
    if dtype != "auto":
        typer.echo(describe_dtype_conversions(dtype, llm.dtype_conversions))
    typer.echo(llm.runner.describe_weights())
    if emit:
        # One forward step first: engines that specialise on shapes compile on first launch.
        sequence = llm.runner.new_sequence()
        llm.runner.step([SequenceWork(sequence, [llm.tokenizer.bos_token_id or 0])])
        sequence.free()
        try:
            written = emit_sources(llm.runner.plan, emit)
        except OSError as exc:
            raise fail(f"--emit {emit}: cannot write the sources there ({exc.strerror or exc})") from exc
        typer.echo(f"wrote {written} source file(s) to {emit}")


PROMPT_OPTIONS = (
    "max_tokens", "chat", "stop", "temperature", "top_k", "top_p", "min_p", "seed", "logit_epilogue", "logit_param",
    "json_schema", "regex",
)
"""Options of `pie run` for a prompt; an inferlet chooses all of these itself."""


@app.command()
def run(
    ctx: typer.Context,
    prompt: Annotated[Optional[str], typer.Argument(help="The prompt.")] = None,
    model: Annotated[Optional[str], typer.Option(help="Model name or path.")] = None,
    engine: Annotated[Optional[str], typer.Option(help="Engine (default: PIE_ENGINES or the best available).")] = None,
    max_tokens: Annotated[int, typer.Option(min=1, help="Most tokens to generate.")] = 128,
    chat: Annotated[
        bool, typer.Option("--chat/--no-chat", help="Wrap the prompt in the model's chat template.")
    ] = True,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option(help="Keep only the k likeliest tokens (0: all).")] = 0,
    top_p: Annotated[
        float, typer.Option(help="Keep the fewest likeliest tokens whose probabilities reach p (1: all).")
    ] = 1.0,
    min_p: Annotated[float, typer.Option(help="Drop tokens less likely than min-p times the likeliest one.")] = 0.0,
    seed: Annotated[
        Optional[int], typer.Option(help="Seed of the sampler: the same seed draws the same tokens.")
    ] = None,
    stop: Annotated[Optional[list[str]], typer.Option(help="Stop string (repeatable).")] = None,
    logit_epilogue: Annotated[
        Optional[str], typer.Option(help=(
            "An eta program applied to the logits on the device (one input; statements separated by ';' or "
            "newlines), e.g. 'in x: f32; out y = x / 0.7'."))
    ] = None,
    logit_param: Annotated[
        Optional[list[str]], typer.Option(help="NAME=VALUE for a param of --logit-epilogue (repeatable).")
    ] = None,
    json_schema: Annotated[
        Optional[str], typer.Option(help="The output is JSON valid against the JSON schema in this file.")
    ] = None,
    regex: Annotated[Optional[str], typer.Option(help="The output is what this regular expression matches.")] = None,
    kv_tokens: Annotated[
        Optional[int], typer.Option(min=1, help=(
            "Tokens the KV cache holds (default: one sequence, the prompt and --max-tokens or an inferlet's model "
            "context, within a quarter of the device's memory; on Vulkan and WebGPU no more than one layer's "
            "binding holds)."))
    ] = None,
    kv_dtype: Annotated[KvDtype, typer.Option(help="Element type of the KV cache's pages.")] = "float32",
    verbose: Annotated[
        bool, typer.Option("--verbose", help="Also print the memory the weights and the KV cache take.")
    ] = False,
    dtype: DtypeOption = "auto",
    inferlet: Annotated[Optional[str], typer.Option(help="Run this inferlet file instead of a prompt.")] = None,
    inferlet_timeout: Annotated[
        Optional[float], typer.Option(help="Seconds an inferlet may run (default: PIE_INFERLET_TIMEOUT, else 600).")
    ] = None,
    args: Annotated[
        Optional[list[str]], typer.Argument(help="Arguments for the inferlet (after --).", show_default=False)
    ] = None,
) -> None:
    """Generate text for a prompt, streamed to the terminal (or run an inferlet)."""
    from pie.generation import NonFiniteLogits, SamplingParams
    from pie.plugins import EngineError
    from pie.runtime.kv_cache import OutOfPages
    from pie.runtime.llm import LLM, encode_prompt

    if inferlet is not None:
        from pie.inferlet.cli import run_inferlet_file

        path_argument(inferlet, "--inferlet", "an inferlet's file or package folder")
        _refuse_given(ctx, PROMPT_OPTIONS, "with --inferlet (the inferlet chooses them)")
        _refuse_given(ctx, ("verbose",), "with --inferlet")
        extra = ([prompt] if prompt is not None else []) + list(args or [])
        try:
            extra = [utf8_argument(arg, f"inferlet argument {i + 1}") for i, arg in enumerate(extra)]
        except ValueError as exc:
            raise fail(str(exc)) from exc
        code = run_inferlet_file(
            inferlet, extra, model=model, engine=engine, timeout_s=inferlet_timeout, kv_tokens=kv_tokens,
            kv_dtype=kv_dtype, show_traceback=app.debug, dtype=dtype,
        )
        raise typer.Exit(code)
    _refuse_given(ctx, ("inferlet_timeout",), "without --inferlet")
    if prompt is None:
        raise usage("give a prompt, or --inferlet FILE")
    if json_schema is not None and regex is not None:
        raise usage("give --json-schema or --regex, not both")
    if json_schema is not None:
        path_argument(json_schema, "--json-schema", "the path of a file that holds a JSON schema")
    if args:
        raise usage(f"give the prompt as one quoted argument; these came after it: {' '.join(args)}")
    user_errors: tuple[type[Exception], ...] = (EngineError, OSError, ValueError)  # GrammarError is a ValueError
    if logit_epilogue is not None:  # only an epilogue needs the eta compiler (and a start without it is faster)
        from pie.eta import EtaError

        user_errors += (EtaError,)
    try:
        sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    except ValueError as exc:  # an option's value: a usage error
        raise usage(str(exc)) from exc
    params = _logit_params(logit_epilogue, logit_param or [])
    try:
        prompt = utf8_argument(prompt, "the prompt")
        stops = [utf8_argument(text, "--stop") for text in stop or ()]
        epilogue = _logit_epilogue(logit_epilogue, params)
        asked, what = _output_constraint(json_schema, regex)
        llm = LLM.load(model, engine, logit_epilogue=epilogue, max_cached_tokens=kv_tokens, kv_dtype=kv_dtype,
                       dtype=dtype,
                       sequence_tokens=lambda tokenizer: len(encode_prompt(tokenizer, prompt, chat)) + max_tokens)
    except user_errors as exc:
        raise fail(str(exc)) from exc
    info = llm.device.info
    typer.secho(f"[{info.key} {info.name}: {llm.engine_reason}; {llm.profile_reason}]", err=True, dim=True)
    if verbose and llm.memory is not None:
        typer.secho(f"[{llm.memory.describe()}]", err=True, dim=True)
    constraint = None
    if asked is not None:
        from pie.generation.constraints import GrammarError, GrammarUnavailable, GrammarVocabulary

        try:
            constraint = GrammarVocabulary.for_tokenizer(llm.tokenizer, llm.runner.config.vocab_size).compile(asked).matcher()
        except (GrammarError, GrammarUnavailable) as exc:
            raise fail(f"{what}: {exc}") from exc
    written = False
    try:
        for piece in llm.generate(prompt, chat=chat, sampling=sampling, max_tokens=max_tokens, stop=stops,
                                  constraint=constraint):
            sys.stdout.write(piece)
            sys.stdout.flush()
            written = True
    except (ValueError, RuntimeError) as exc:
        sys.stdout.write("\n" if written else "")  # the message goes on a line of its own
        message = str(exc)
        if isinstance(exc, NonFiniteLogits):
            message += "; the --logit-epilogue made them" if epilogue else (
                f"; engine {llm.device.name!r} produced them on {llm.device.info.key}: the model's weights may be "
                "damaged, or the engine may compute wrongly")
        elif isinstance(exc, OutOfPages):
            message += " (--kv-tokens sizes the KV cache)"
        elif constraint is not None and isinstance(exc, GrammarError):  # the engine gave up following it
            message = f"{what}: {message}"
        raise fail(message) from exc
    sys.stdout.write("\n")
    if constraint is not None and not constraint.is_accepting:
        raise fail(f"the output stopped at --max-tokens {max_tokens} before it matched {what}; it is incomplete")


MAX_SCHEMA_BYTES = 16 << 20
"""The largest --json-schema file read (a schema that large already takes long to compile)."""


def _file_problem(exc: OSError | UnicodeDecodeError) -> str:
    """Why a file given on the command line cannot be read, in words (an OSError's own text, no repr)."""
    if isinstance(exc, UnicodeDecodeError):
        return f"it is not UTF-8 text (byte {exc.start})"
    return exc.strerror or str(exc)


def _output_constraint(json_schema: str | None, regex: str | None):  # type imported lazily
    """What --json-schema or --regex asks for, and how to name it in a message; (None, "") for neither."""
    if json_schema is None and regex is None:
        return None, ""
    from pie.generation.constraints import GrammarError, GrammarSpec

    try:
        if json_schema is not None:
            what = f"--json-schema {json_schema}"
            from pie.files import read_regular_file

            try:  # a regular file of bounded size: /dev/zero was read until the machine ran out of memory
                text = read_regular_file(json_schema, MAX_SCHEMA_BYTES).decode("utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"{what}: cannot read it: {_file_problem(exc)}") from None
            return GrammarSpec.json_schema(text), what
        what = "--regex"
        return GrammarSpec.regex(utf8_argument(regex, "--regex")), what  # type: ignore[arg-type]  # given
    except GrammarError as exc:
        raise ValueError(f"{what}: {exc}") from None


def _refuse_given(ctx: typer.Context, names: tuple[str, ...], why: str) -> None:
    """A usage error naming each of ``names`` that the command line set (even to its default)."""
    given = [
        "/".join(param.opts + param.secondary_opts)
        for param in ctx.command.params
        if param.name in names and _source_name(ctx, param.name) == "COMMANDLINE"
    ]
    if given:
        raise typer.BadParameter(f"cannot be used {why}", ctx=ctx, param_hint=", ".join(given))


def _source_name(ctx: typer.Context, name: str) -> str | None:
    # By name: typer >= 0.24 carries its own copy of click, whose ParameterSource is another class.
    source = ctx.get_parameter_source(name)
    return None if source is None else source.name


def _logit_params(source: str | None, params: list[str]) -> tuple[tuple[str, float], ...]:
    """The --logit-param values as (name, value) pairs; a usage error for one that is not NAME=NUMBER."""
    if source is None and params:
        raise usage("--logit-param needs --logit-epilogue")
    values = []
    for item in params:
        name, sep, value = item.partition("=")
        if not sep:
            raise usage(f"--logit-param {item!r} is not NAME=VALUE")
        try:
            values.append((name.strip(), float(value)))
        except ValueError:
            raise usage(f"--logit-param {item!r}: {value!r} is not a number") from None
    return tuple(values)


def _logit_epilogue(source: str | None, params: tuple[tuple[str, float], ...]):  # type imported lazily
    from pie.poem.graph import LogitEpilogue

    if source is None:
        return None
    return LogitEpilogue(utf8_argument(source, "--logit-epilogue"), params)  # the text as given, as `pie eta` reads it


@app.command()
def bench(
    model: Annotated[Optional[str], typer.Option(help="Model name or path.")] = None,
    engine: Annotated[Optional[str], typer.Option(help="Engine.")] = None,
    prompt_tokens: Annotated[int, typer.Option(min=1, help="Prompt length for the prefill measurement.")] = 128,
    decode_tokens: Annotated[int, typer.Option(min=1, help="Tokens per decode measurement.")] = 64,
    runs: Annotated[int, typer.Option(min=1, help="Repeats; the median is reported.")] = 3,
    concurrency: Annotated[
        int, typer.Option(min=1, help="Simultaneous requests, at most 512 (1: single-sequence latency run).")
    ] = 1,
    kv_dtype: Annotated[KvDtype, typer.Option(help="Element type of the KV cache's pages.")] = "float32",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    dtype: DtypeOption = "auto",
) -> None:
    """Measure prefill and decode tokens/s (median of runs) against the memory-bandwidth roofline."""
    from pie.bench import run_bench
    from pie.scheduler.bench import MAX_CONCURRENCY

    if concurrency > MAX_CONCURRENCY:  # before the model loads: its KV cache is sized for every request
        raise usage(f"--concurrency {concurrency}: at most {MAX_CONCURRENCY}, the most requests the scheduler decodes "
                    "in one step (its batch of that many tokens); more would take turns instead of running at once")
    try:
        report = run_bench(model, engine, prompt_tokens, decode_tokens, runs, concurrency, kv_dtype, dtype=dtype)
    except (OSError, ValueError, RuntimeError) as exc:  # RuntimeError: EngineError, and the KV cache running out
        raise fail(str(exc)) from exc
    typer.echo(json.dumps(report, indent=2) if as_json else report["text"])


ETA_TARGETS_HELP = "cuda, hip, metal, wgsl, opencl or slang"
"""``pie.eta.TARGETS`` in words, written out: importing the compiler to say them would slow every `pie` command."""


@app.command(name="eta")
def eta(
    expr: Annotated[
        str, typer.Argument(help="eta source (statements separated by ';' or newlines), or a stdlib epilogue name")
    ],
    target: Annotated[str, typer.Option(help=ETA_TARGETS_HELP)] = "cuda",
) -> None:
    """Compile an eta epilogue and print the generated source."""
    from pie.eta.cli import eta_command  # imported on use: the compiler is not needed to list engines

    eta_command(expr, target)


def _register_subcommands() -> None:
    from pie.model.cli import model_app
    from pie.profiles.cli import profile_app, tune_command
    from pie.serve.cli import serve_command

    app.add_typer(model_app, name="model", help="Pull, list, verify, import and remove models.")
    app.add_typer(profile_app, name="profile", help="Device profiles: the fastest kernel variant per shape.")
    app.command(name="tune", help="Measure kernel variants on this device and write your profile.")(tune_command)
    app.command(name="serve")(serve_command)


_register_subcommands()
