"""Many inferlets at once: batched together; a crashing, hanging or oversized one fails alone."""

from __future__ import annotations

import asyncio
import os
import sys
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pie.inferlet import InferletHost, InferletLoadError, Session, load_inferlet
from pie.inferlet.cli import run_inferlet_file
from pie.runtime.model_runner import ModelRunner
from pie.testing.models import make_gguf_model

HostFactory = Callable[..., InferletHost]
PROMPTS = ["The quick brown fox", "Pie serves language models", "A paged key-value cache", "Tokenizers split text"]


def healthy(prompt: str, count: int = 8):
    async def main(ctx: Session, args: list[str]) -> dict[str, Any]:
        c = ctx.context(prompt)
        tokens = await c.generate_tokens(count, stop_token_ids=())
        return {"prompt": ctx.tokenize(prompt), "tokens": tokens}

    return main


async def crashing(ctx: Session, args: list[str]) -> None:
    c = ctx.context("Héllo wörld")
    await c.generate_tokens(3)
    raise ValueError("boom")


async def waits_forever(ctx: Session, args: list[str]) -> None:
    c = ctx.context("The quick brown fox jumps over the lazy dog.")
    await c.flush()  # holds pages while it hangs
    await asyncio.Event().wait()


async def generates_forever(ctx: Session, args: list[str]) -> None:
    base = ctx.context("def forward(x):")
    await base.flush()
    while True:  # busy with forward passes, never done
        child = base.fork()
        await child.generate_tokens(4, stop_token_ids=())
        child.drop()


async def spins_without_awaiting(ctx: Session, args: list[str]) -> None:
    c = ctx.context("A runaway loop")
    await c.flush()  # holds pages while it spins
    while True:  # never awaits: the event loop is blocked until the watchdog stops it
        try:
            sum(range(1000))
        except Exception:  # swallowing errors does not keep it alive
            pass


async def too_greedy(ctx: Session, args: list[str]) -> None:
    c = ctx.context(tokens=[5] * 200)
    await c.flush()


async def survives_too_greedy(ctx: Session, args: list[str]) -> str:
    from pie.scheduler import RequestTooLarge

    c = ctx.context("Pie serves")
    try:
        await c.fill(tokens=[5] * 200).flush()
    except RequestTooLarge:
        pass
    small = ctx.context("Pie serves")
    return ctx.detokenize(await small.generate_tokens(3, stop_token_ids=()))


def assert_all_pages_back(host: InferletHost) -> None:
    core = host.scheduler.core
    assert core.runner.pages.free_count == core.runner.pages.num_pages
    if core.host is not None:
        assert core.host.free_count == core.host.num_pages
    assert core.sequences() == []


def test_concurrent_inferlets_share_forward_passes(
    make_host: HostFactory, reference: ModelRunner, helpers: Any
) -> None:
    host = make_host()
    programs = [(f"p{i}", healthy(PROMPTS[i % 4], count=10), []) for i in range(8)]
    results = asyncio.run(host.run_many(programs))
    assert all(r.ok for r in results), [r.error for r in results]
    stats = host.scheduler.core.stats
    assert stats.largest_batch == 8
    assert stats.steps <= 10 + 1  # 8 x 10 passes in about 10 steps, not 80
    for result in results:
        value = result.value
        assert value["tokens"] == helpers.greedy(reference, value["prompt"], 10)
    assert_all_pages_back(host)


def test_crashing_and_hanging_inferlets_fail_alone_and_give_their_pages_back(
    make_host: HostFactory, reference: ModelRunner, helpers: Any
) -> None:
    host = make_host(timeout_s=1.0)
    ended: list[str] = []

    def noting_its_end(name: str, main: Any) -> Any:
        async def noted(ctx: Session, args: list[str]) -> Any:
            try:
                return await main(ctx, args)
            finally:
                ended.append(name)  # on return, raise, or when the host stops it

        return noted

    programs = [
        ("crash", crashing, []),
        ("ok0", healthy(PROMPTS[0], count=12), []),
        ("waits", waits_forever, []),
        ("spins", generates_forever, []),
        ("ok1", healthy(PROMPTS[1], count=12), []),
    ]
    crash, ok0, waits, spins, ok1 = asyncio.run(
        host.run_many([(name, noting_its_end(name, main), args) for name, main, args in programs])
    )
    assert crash.error == "inferlet 'crash' raised ValueError: boom"
    assert 'raise ValueError("boom")' in crash.details and crash.dropped_contexts == 1
    assert crash.where.endswith('in crashing: raise ValueError("boom")')
    for hung in (waits, spins):
        assert hung.error == f"inferlet {hung.name!r} did not finish within 1 s and was stopped"
        assert hung.dropped_contexts >= 1
    for ok in (ok0, ok1):
        assert ok.ok and ok.value["tokens"] == helpers.greedy(reference, ok.value["prompt"], 12)
    # Not held up by the hanging ones: both finished while those still ran.
    assert set(ended[:3]) == {"crash", "ok0", "ok1"} and set(ended[3:]) == {"waits", "spins"}
    assert_all_pages_back(host)


def test_an_inferlet_that_will_not_stop_when_cancelled_is_closed_and_the_others_go_on(make_host: HostFactory) -> None:
    """asyncio.wait_for waits for a cancelled task to end: these two held the host, and `pie run`, for ever."""

    async def cleans_up_for_ever(ctx: Session, args: list[str]) -> None:
        ctx.context("Pie serves")
        try:
            await asyncio.sleep(1000)
        finally:
            await asyncio.sleep(1000)

    async def catches_its_cancellation(ctx: Session, args: list[str]) -> None:
        while True:
            try:
                await asyncio.sleep(1000)
            except asyncio.CancelledError:
                pass

    host = make_host(timeout_s=0.5)
    cleaning, catching, fine = asyncio.run(host.run_many([
        ("cleaning", cleans_up_for_ever, []), ("catching", catches_its_cancellation, []),
        ("fine", healthy(PROMPTS[0]), [])]))
    for stuck in (cleaning, catching):
        assert stuck.error == f"inferlet {stuck.name!r} did not finish within 0.5 s and was stopped"
    assert cleaning.dropped_contexts == 1 and fine.ok
    assert_all_pages_back(host)


def test_the_tasks_an_inferlet_starts_are_held_to_its_deadline_and_end_with_it(make_host: HostFactory) -> None:
    """A task started by the inferlet was watched by nothing: one that never awaited held `pie run` for ever, and
    one left waiting outlived its inferlet."""
    spun: list[str] = []

    async def spins_in_a_task(ctx: Session, args: list[str]) -> str:
        async def spin() -> None:
            spun.append("started")
            while True:
                pass

        asyncio.get_running_loop().create_task(spin())
        await asyncio.sleep(0)  # the spin starts, and holds the event loop until the watchdog stops it
        return "returned"

    left: list[asyncio.Task[None]] = []

    async def leaves_a_task_waiting(ctx: Session, args: list[str]) -> str:
        left.append(asyncio.create_task(asyncio.sleep(1000)))
        return "returned"

    host = make_host(timeout_s=0.5)
    spins, leaves = asyncio.run(host.run_many([("spins", spins_in_a_task, []), ("leaves", leaves_a_task_waiting, [])]))
    assert spun == ["started"] and spins.error is None and spins.value == "returned", spins
    assert leaves.value == "returned" and left[0].cancelled(), "what it started ended with it"
    assert asyncio.run(host.run(healthy(PROMPTS[0]))).ok, "the host goes on"
    assert_all_pages_back(host)


def test_an_inferlet_that_never_awaits_is_stopped_and_the_others_go_on(
    make_host: HostFactory, reference: ModelRunner, helpers: Any
) -> None:
    host = make_host(timeout_s=30.0)

    async def run_all() -> list[Any]:
        return await asyncio.gather(
            host.run(healthy(PROMPTS[0], count=12), name="ok0"),
            host.run(spins_without_awaiting, name="runaway", timeout_s=1.0),
            host.run(healthy(PROMPTS[1], count=12), name="ok1"),
        )

    ok0, runaway, ok1 = asyncio.run(run_all())
    assert runaway.error == "inferlet 'runaway' did not finish within 1 s and was stopped"
    assert runaway.dropped_contexts == 1
    for ok in (ok0, ok1):
        assert ok.ok, ok.error
        assert ok.value["tokens"] == helpers.greedy(reference, ok.value["prompt"], 12)
    assert_all_pages_back(host)
    # The host keeps serving afterwards: nothing is left pending in the event loop's thread.
    (again,) = asyncio.run(host.run_many([("again", healthy(PROMPTS[2], count=4), [])]))
    assert again.ok, again.error
    assert_all_pages_back(host)


def test_an_inferlet_asking_for_more_than_fits_gets_a_clear_error(make_host: HostFactory) -> None:
    host = make_host(pages=32)  # 128 tokens
    greedy_one, survivor, fine = asyncio.run(
        host.run_many(
            [("greedy", too_greedy, []), ("survivor", survives_too_greedy, []), ("fine", healthy(PROMPTS[2]), [])]
        )
    )
    assert greedy_one.error is not None
    assert greedy_one.error.startswith("inferlet 'greedy' asked for more KV cache than fits: a sequence of 200 tokens")
    assert "needs 50 KV pages of 4 tokens, but the whole pool has 32 pages" in greedy_one.error
    assert survivor.ok and isinstance(survivor.value, str)
    assert fine.ok and len(fine.value["tokens"]) == 8
    assert_all_pages_back(host)


def test_preempted_contexts_come_back_intact(make_host: HostFactory, reference: ModelRunner, helpers: Any) -> None:
    # 12 pages for 6 inferlets that each need 4 by the end: most of them get swapped out on the way.
    host = make_host(pages=12, host_pages=8)
    programs = [(f"p{i}", healthy(PROMPTS[i % 4], count=10), []) for i in range(6)]
    results = asyncio.run(host.run_many(programs))
    assert all(r.ok for r in results), [r.error for r in results]
    stats = host.scheduler.core.stats
    assert stats.preemptions > 0 and stats.swap_outs > 0
    for result in results:
        assert result.value["tokens"] == helpers.greedy(reference, result.value["prompt"], 10)
    assert_all_pages_back(host)


def test_an_inferlet_raising_a_base_exception_fails_alone(make_host: HostFactory) -> None:
    class Escape(BaseException):
        pass

    async def escapes(ctx: Session, args: list[str]) -> None:
        await ctx.context("Pie serves").flush()
        raise Escape("out of the host")

    async def interrupts(ctx: Session, args: list[str]) -> None:
        raise KeyboardInterrupt("not the user's")  # a real Ctrl-C reaches the host as the main task's cancellation

    async def says_nothing(ctx: Session, args: list[str]) -> None:
        raise KeyboardInterrupt

    host = make_host()
    escaped, interrupted, silent, fine = asyncio.run(host.run_many(
        [("escapes", escapes, []), ("interrupts", interrupts, []), ("silent", says_nothing, []),
         ("fine", healthy(PROMPTS[0]), [])]))
    assert escaped.error == "inferlet 'escapes' raised Escape: out of the host" and escaped.dropped_contexts == 1
    assert interrupted.error == "inferlet 'interrupts' raised KeyboardInterrupt: not the user's"
    assert silent.error == "inferlet 'silent' raised KeyboardInterrupt", "no ': ' before a message it does not have"
    assert fine.ok
    assert_all_pages_back(host)


def test_an_exception_that_cannot_say_what_it_is_and_a_cancellation_of_its_own_fail_alone(
    make_host: HostFactory,
) -> None:
    """Both escaped the host: the first's message raised again while the host told of it, and the second was
    taken for the host's own stop. Either stopped every inferlet beside it."""

    class Mute(Exception):
        def __str__(self) -> str:
            raise RuntimeError("no words")

    async def mute(ctx: Session, args: list[str]) -> None:
        raise Mute()

    async def cancels(ctx: Session, args: list[str]) -> None:
        raise asyncio.CancelledError("its own")

    host = make_host()
    # Before Python 3.11 a task cannot tell a cancellation of its own from one raised inside it.
    own = [("cancels", cancels, [])] if sys.version_info >= (3, 11) else []
    muted, *cancelled, fine = asyncio.run(host.run_many([("mute", mute, []), *own, ("fine", healthy(PROMPTS[0]), [])]))
    assert muted.error == "inferlet 'mute' raised Mute: (its message could not be made: RuntimeError)"
    assert [result.error for result in cancelled] == ["inferlet 'cancels' raised CancelledError: its own"] * len(own)
    assert fine.ok
    assert_all_pages_back(host)


def test_an_inferlet_may_not_fork_and_the_application_around_it_still_may(make_host: HostFactory) -> None:
    """A forked child went on as a second copy of the host's process (under `pie run`, it printed a second result)."""

    async def forks(ctx: Session, args: list[str]) -> str:
        async def in_a_task() -> int:
            return os.fork()

        results = []
        for fork in (os.fork, in_a_task):
            try:
                pid = await fork() if fork is in_a_task else fork()
            except PermissionError as exc:
                results.append(str(exc))
            else:
                if pid == 0:  # the old code's child: it must not go on as a copy of this test
                    os._exit(0)
                results.append(f"forked {pid}")
        return " | ".join(results)

    result = asyncio.run(make_host().run(forks, name="forks"))
    refused = "[Errno 1] an inferlet may not fork pie's process"
    assert result.ok and result.value.count(refused) == 2, result
    pid = os.fork()  # outside an inferlet's code: the guard forks
    if pid == 0:
        os._exit(7)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7


def test_an_async_generator_left_suspended_is_closed_before_the_run_ends(make_host: HostFactory) -> None:
    """It was closed at the event loop's shutdown, after its run and past its deadline, where cleanup that awaited for
    ever held the process for ever."""
    cleaned: list[str] = []

    async def numbers() -> Any:
        try:
            yield 1
        finally:
            cleaned.append("began")
            await asyncio.sleep(5)  # past the grace (CANCEL_GRACE_S): the cleanup is ended when it is over

    async def leaves_one(ctx: Session, args: list[str]) -> int:
        generator = numbers()
        leaves_one.generator = generator  # type: ignore[attr-defined]  # kept alive past the run
        return await generator.__anext__()

    async def scenario() -> tuple[Any, list[str]]:
        result = await make_host(timeout_s=30).run(leaves_one, name="leaves")
        return result, list(cleaned)

    result, cleaned_by_then = asyncio.run(scenario())
    assert result.ok and result.value == 1
    assert cleaned_by_then == ["began"], "its cleanup ran within the run"
    assert leaves_one.generator.ag_frame is None, "and it is closed"  # type: ignore[attr-defined]


def test_bad_arguments_exit_with_argparse_status(make_host: HostFactory) -> None:
    main = load_inferlet(Path(__file__).resolve().parents[3] / "examples" / "best_of_n.py")
    for args in (["x", "--n", "not-a-number"], ["x", "--n", "0"], ["x", "--max-tokens", "-5"]):
        result = asyncio.run(make_host().run(main, args, name="best_of_n"))
        assert result.error == "inferlet 'best_of_n' exited with status 2", (args, result.error)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (None, "no such inferlet file"),
        ("a loop of links", "no such inferlet file or package (Symlink loop"),  # an internal error (RuntimeError)
        ("a FIFO", "not a Python file or package (a device, a FIFO or a socket)"),  # "no such inferlet file"
        ("a folder", "a folder without __init__.py is no inferlet package"),
        ("def main(ctx, args):\n    return 1\n", "an inferlet defines `async def main(ctx, args)`"),
        ("x = 1\n", "an inferlet defines `async def main(ctx, args)`"),
        ("async def main(ctx):\n    return 1\n", "main must take exactly (ctx, args)"),
        ("async def main(ctx, args)\n", "importing it failed: SyntaxError"),
        ("import no_such_module_here\n", "importing it failed: ModuleNotFoundError"),
        # each ended the whole command: a traceback, or a silent exit with the inferlet's status
        ("import sys\nsys.exit(3)\n", "importing it exited with status 3"),
        ("raise KeyboardInterrupt('at import')\n", "importing it failed: KeyboardInterrupt: at import"),
        ("class Out(BaseException):\n    pass\nraise Out('x')\n", "importing it failed: Out: x"),
    ],
)
def test_unusable_inferlet_files_are_refused_clearly(tmp_path: Path, source: str | None, message: str) -> None:
    path = tmp_path / "inferlet.py"
    if source == "a folder":
        path.mkdir()
    elif source == "a loop of links":
        path.symlink_to(tmp_path / "other.py")
        (tmp_path / "other.py").symlink_to(path)
    elif source == "a FIFO":
        os.mkfifo(path)
    elif source is not None:
        path.write_text(source)
    with pytest.raises(InferletLoadError, match=message.replace("(", r"\(").replace(")", r"\)").replace("`", ".")):
        load_inferlet(path)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gguf_model(tmp_path_factory.mktemp("model") / "tiny.gguf", "F32")


def test_cli_runs_an_inferlet_file_and_prints_its_value(tiny_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    examples = Path(__file__).resolve().parents[3] / "examples"
    code = run_inferlet_file(
        str(examples / "constrained_choice.py"),
        ["Is it?", "--option", " yes", "--option", " no"],
        str(tiny_gguf),
        "cpu",
    )
    out = capsys.readouterr().out
    assert code == 0
    value = json.loads(out)
    assert value["choice"] in (" yes", " no") and value["tokens"]


def test_cli_exit_codes_for_a_failing_and_an_unusable_inferlet(
    tmp_path: Path, tiny_gguf: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    failing = tmp_path / "fails.py"
    failing.write_text("async def main(ctx, args):\n    raise RuntimeError('nope: ' + ' '.join(args))\n")
    assert run_inferlet_file(str(failing), ["a", "b"], str(tiny_gguf), "cpu") == 1
    err = capsys.readouterr().err
    assert "pie: inferlet 'fails' raised RuntimeError: nope: a b" in err
    assert f"  at {failing}:2 in main: raise RuntimeError('nope: ' + ' '.join(args))" in err
    assert "Traceback" not in err
    assert run_inferlet_file(str(failing), [], str(tiny_gguf), "cpu", show_traceback=True) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err
    assert run_inferlet_file(str(tmp_path / "missing.py"), [], str(tiny_gguf), "cpu") == 1  # a file's problem
    assert "no such inferlet file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "variable", "message"),
    [
        (-1.0, None, "--inferlet-timeout must be a finite number of seconds above 0, not -1"),
        (0.0, None, "--inferlet-timeout must be a finite number of seconds above 0, not 0"),
        (float("nan"), None, "--inferlet-timeout must be a finite number of seconds above 0, not nan"),
        (float("inf"), None, "--inferlet-timeout must be a finite number of seconds above 0, not inf"),
        (None, "nan", "PIE_INFERLET_TIMEOUT must be a finite number of seconds above 0, not nan"),
        (None, "-5", "PIE_INFERLET_TIMEOUT must be a finite number of seconds above 0, not -5"),
        (None, "soon", "PIE_INFERLET_TIMEOUT must be a number of seconds, not 'soon'"),
    ],
)
def test_a_timeout_that_is_not_a_positive_number_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    flag: float | None, variable: str | None, message: str,
) -> None:
    if variable is None:
        monkeypatch.delenv("PIE_INFERLET_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("PIE_INFERLET_TIMEOUT", variable)
    inferlet = tmp_path / "ok.py"
    inferlet.write_text("async def main(ctx, args):\n    return 1\n")
    # Refused before any model is loaded: this one does not exist. The option's value is a usage error (2), the
    # variable's a setting's (1), as every command's.
    status = 2 if variable is None else 1
    assert run_inferlet_file(str(inferlet), [], str(tmp_path / "no-model.gguf"), "cpu", timeout_s=flag) == status
    assert capsys.readouterr().err == f"pie: {message}\n"


def test_a_value_json_cannot_hold_is_shown_even_when_its_repr_fails() -> None:
    """Both were internal errors of `pie run --inferlet` after the inferlet had finished."""
    from pie.inferlet.cli import format_value

    class Unshowable:
        def __repr__(self) -> str:
            raise ValueError("no")

    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert format_value(Unshowable()) == "<a Unshowable that cannot be shown: its repr raised ValueError>"
    assert format_value(deep) == "<a list that cannot be shown: its repr raised RecursionError>"
    assert format_value({"ok": [1]}) == '{\n  "ok": [\n    1\n  ]\n}'


def test_an_inferlet_that_never_finishes_importing_is_stopped_in_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inferlet = tmp_path / "loops.py"
    inferlet.write_text("while True:\n    pass\n")
    assert run_inferlet_file(str(inferlet), [], str(tmp_path / "no-model.gguf"), "cpu", timeout_s=0.5) == 1
    assert "loops.py: importing it did not finish in time and was stopped" in capsys.readouterr().err


STOPPED_STEP_THEN_TRACE = """
import sys, threading, time
from pie.inferlet import watchdog
step = watchdog._Step(deadline=0.0)
step.enter()
stopper = threading.Thread(target=step.stop_if_overdue, args=(time.monotonic(),))
try:
    stopper.start()
    stopper.join()
    for _ in range(1000):
        pass
except watchdog.InferletStalled:  # it landed in the step, which ends by it
    pass
stopper.join()
step.leave()
def called():
    return 1
sys.settrace(lambda *args: None)
called()
sys.settrace(None)
print("returned")
"""


def test_a_stopped_step_leaves_traced_code_running() -> None:
    """As a step that was raised into ended, the watchdog cancelled any raise still pending, which (pending or not)
    leaves CPython 3.11's eval breaker signalled for good: every call under sys.settrace after it (a debugger,
    coverage, a test counting lines) spun at its first line for ever."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", STOPPED_STEP_THEN_TRACE], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0 and done.stdout == "returned\n", done.stderr
