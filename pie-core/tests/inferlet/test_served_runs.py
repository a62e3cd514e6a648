"""Inferlets run in worker processes over the host's scheduler: the same results as in-process, every page back."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import tempfile
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pie.inferlet import InferletHost, load_inferlet
from pie.inferlet import workers
from pie.inferlet.fork_server import ForkServer
from pie.inferlet.wire import decode, encode
from pie.inferlet.workers import RunLimits, RunOutcome, WorkerPool, _Run, serve_run
from pie.model.tokenizer import Tokenizer
from pie.serve.engine import Emitted

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
EXAMPLE_ARGS = {
    "best_of_n": ["The quick brown fox", "--n", "3", "--max-tokens", "5", "--temperature", "1.0", "--seed", "4"],
    "beam_search": ["The answer is", "--beams", "3", "--max-tokens", "4"],
    "constrained_choice": ["Is the sky blue? Answer:", "--option", " yes", "--option", " no", "--option", " maybe"],
    "two_agents": ["Tell me about foxes", "--turns", "2", "--max-tokens", "6"],
}


async def served(host: InferletHost, tokenizer: Tokenizer, runs: list[tuple[Path, list[str]]],
                 limits: RunLimits = RunLimits(wall_seconds=60)) -> list[tuple[RunOutcome, list[Any]]]:
    vocab = host.scheduler.runner.config.vocab_size
    pool = WorkerPool(tokenizer.to_json(), vocab, size=min(len(runs), 2), sandbox=None)
    pool.start()

    async def one(path: Path, args: list[str]) -> tuple[RunOutcome, list[Any]]:
        emitted: list[Any] = []
        worker = await pool.take()
        outcome = await serve_run(host.scheduler, worker, path.stem, path, args, limits, emitted.append)
        return outcome, emitted

    try:
        return list(await asyncio.gather(*(one(path, args) for path, args in runs)))
    finally:
        await pool.close()


def assert_same(served: Any, in_process: Any, where: str = "result") -> None:
    """Equal, tokens and text exactly; log-probabilities to float rounding (other runs shared the batches)."""
    if isinstance(in_process, float):
        assert served == pytest.approx(in_process, rel=1e-5, abs=1e-6), where
    elif isinstance(in_process, dict):
        assert isinstance(served, dict) and served.keys() == in_process.keys(), where
        for key in in_process:
            assert_same(served[key], in_process[key], f"{where}.{key}")
    elif isinstance(in_process, list):
        assert isinstance(served, list) and len(served) == len(in_process), where
        for index, (a, b) in enumerate(zip(served, in_process, strict=True)):
            assert_same(a, b, f"{where}[{index}]")
    else:
        assert served == in_process, where


@pytest.mark.parametrize("name", sorted(EXAMPLE_ARGS))
def test_an_example_served_gives_what_it_gives_in_process(
    make_host: Callable[..., InferletHost], tokenizer: Tokenizer, example: Callable[[str], Any], name: str
) -> None:
    expected = asyncio.run(make_host().run(example(name), EXAMPLE_ARGS[name], name=name))
    assert expected.ok, expected.details
    host = make_host()
    ((outcome, _),) = asyncio.run(served(host, tokenizer, [(EXAMPLES / f"{name}.py", EXAMPLE_ARGS[name])]))
    assert outcome.ok, outcome.error
    assert_same(outcome.value, expected.value)
    allocator = host.scheduler.core.runner.pages
    assert allocator.used_count == 0 and host.scheduler.core.sequences() == []


SLEEPER = '''"""Says it started, then waits."""
import asyncio


async def main(ctx, args):
    ctx.emit("started")
    await asyncio.sleep(60)
'''
DESCRIPTORS = '''"""What its open descriptors are."""
import os


async def main(ctx, args):
    targets = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:
            pass  # the listing's own descriptor, closed
    return targets
'''
GREEDY = '''"""Greedy tokens of one prompt."""


async def main(ctx, args):
    context = ctx.context("The quick brown fox")
    return await context.generate_tokens(4)
'''


def test_a_worker_holds_no_descriptor_of_the_fork_server(
    make_host: Callable[..., InferletHost], tokenizer: Tokenizer, tmp_path: Path
) -> None:
    (tmp_path / "descriptors.py").write_text(DESCRIPTORS)
    host = make_host()

    async def scenario() -> tuple[dict[str, str], set[str]]:
        pool = WorkerPool(tokenizer.to_json(), host.scheduler.runner.config.vocab_size, size=1, sandbox=None)
        pool.start()
        try:
            worker = await pool.take()
            fork_server = await pool.fork_server()
            fds = Path(f"/proc/{fork_server.pid}/fd")
            held = {(fds / fd).readlink().as_posix() for fd in os.listdir(fds)}
            outcome = await serve_run(host.scheduler, worker, "descriptors", tmp_path / "descriptors.py", [],
                                      RunLimits(wall_seconds=60), lambda value: None)
            assert outcome.ok, outcome.error
            return outcome.value, held
        finally:
            await pool.close()

    worker_fds, fork_server_fds = asyncio.run(scenario())
    sockets = {target for target in fork_server_fds if target.startswith("socket:")}
    assert sockets, fork_server_fds  # its socket to the host
    assert not sockets & set(worker_fds.values()), (worker_fds, fork_server_fds)


def test_when_the_fork_server_dies_its_runs_end_with_a_clear_error_and_the_next_run_is_served(
    make_host: Callable[..., InferletHost], tokenizer: Tokenizer, tmp_path: Path
) -> None:
    (tmp_path / "sleeper.py").write_text(SLEEPER)
    (tmp_path / "greedy.py").write_text(GREEDY)
    expected = asyncio.run(make_host().run(load_inferlet(tmp_path / "greedy.py"), []))
    host = make_host()

    async def scenario() -> tuple[RunOutcome, RunOutcome]:
        pool = WorkerPool(tokenizer.to_json(), host.scheduler.runner.config.vocab_size, size=1, sandbox=None)
        pool.start()
        try:
            first = await pool.take()
            fork_server = await pool.fork_server()
            started = asyncio.Event()
            run = asyncio.ensure_future(serve_run(host.scheduler, first, "sleeper", tmp_path / "sleeper.py", [],
                                                  RunLimits(wall_seconds=60), lambda value: started.set()))
            await asyncio.wait_for(started.wait(), 30)
            os.kill(fork_server.pid, signal.SIGKILL)
            lost = await asyncio.wait_for(run, 30)
            second = await asyncio.wait_for(pool.take(), 60)
            again = await serve_run(host.scheduler, second, "greedy", tmp_path / "greedy.py", [],
                                    RunLimits(wall_seconds=60), lambda value: None)
            return lost, again
        finally:
            await pool.close()

    lost, again = asyncio.run(scenario())
    assert lost.error is not None and "fork server" in lost.error and "SIGKILL" in lost.error, lost.error
    assert again.ok and again.value == expected.value, again.error
    assert host.scheduler.core.runner.pages.used_count == 0


PLANTED = """# Says it ran, then hands over the real module, as an attacker would, unnoticed.
import os, sys
open({ran!r}, "w").close()
sys.path[:] = [entry for entry in sys.path if entry != os.path.dirname(__file__)]
del sys.modules["secrets"]
import secrets
"""


def test_the_fork_server_imports_nothing_from_the_temporary_folder(
    make_host: Callable[..., InferletHost], tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It ran as ``python -m`` in the temporary folder, which put that folder first on its sys.path: any local
    user's /tmp/secrets.py ran in the fork server, outside any sandbox, as the server's user (root, often)."""
    temporary, ran = tmp_path / "tmp", tmp_path / "planted-ran"
    temporary.mkdir()
    (temporary / "secrets.py").write_text(PLANTED.format(ran=str(ran)))  # the fork server imports secrets
    monkeypatch.setenv("TMPDIR", str(temporary))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() looks again
    assert tempfile.gettempdir() == str(temporary)
    vocab = make_host().scheduler.runner.config.vocab_size

    async def start() -> None:
        server = ForkServer({"op": "init", "tokenizer": tokenizer.to_json(), "vocab": vocab, "sandbox": None})
        try:
            await server.start()
        finally:
            await server.close()

    asyncio.run(start())
    assert not ran.exists(), "the planted module ran in the fork server"


def raw(*bodies: bytes) -> str:
    """An inferlet that writes ``bodies`` to the host as messages, past its worker's own checks (``RUN`` in them:
    its run's number)."""
    return ("import gc\nfrom pie.inferlet.wire import HEADER\nfrom pie.inferlet.worker import Channel\n\n\n"
            "async def main(ctx, args):\n"
            "    channel = next(o for o in gc.get_objects() if isinstance(o, Channel))\n"
            f"    for body in {list(bodies)!r}:\n"
            "        body = body.replace(b'RUN', str(ctx.scheduler.run).encode())\n"
            "        channel._sock.sendall(HEADER.pack(len(body)) + body)\n"
            "    return 'unreachable'\n")


PROTOCOL_BREAKERS = {
    "bad_page": ("async def main(ctx, args):\n    return ctx.page_refcount(-1)\n",
                 "raised ValueError: page -1 is not held by this run's contexts"),
    "unjsonable": ("async def main(ctx, args):\n    return object()\n",
                   "main returned a value JSON cannot hold: Object of type object is not JSON serializable"),
    "huge_result": ("async def main(ctx, args):\n    return 'y' * (2 << 20)\n",
                    "main returned a value of 2097154 bytes of JSON, over the limit of 1045552"),
    "huge_emit": ("async def main(ctx, args):\n    ctx.emit('z' * (2 << 20))\n",
                  "emit: a value of 2097154 bytes of JSON, over the limit of 1045552"),
    "deep": (raw(b'{"op":"emit","value":' + b"[" * 200000 + b"]" * 200000 + b"}"),
             "its worker broke the protocol (a message nests too deeply to be read)"),
    "nan": (raw(b'{"op":"emit","value":NaN}'), "its worker broke the protocol (a message is not JSON: NaN is not JSON)"),
    "infinity": (raw(b'{"op":"emit","value":[1e400]}'),
                 "its worker broke the protocol (a message is not JSON: 1e400 is past the range of a float)"),
    "surrogate": (raw(b'{"op":"emit","run":RUN,"value":"\\ud800"}'), "the worker's 'emit' could not be done: a string holds "
                  "'\\ud800', a lone surrogate, which is no Unicode text"),
    "surrogate_result": (raw(b'{"op":"result","run":RUN,"value":["\\udfff"],"error":null,"where":"",'
                             b'"threads_left":0,"engine_failure":false}'),
                         "the worker's 'result' could not be done: a string holds '\\udfff', a lone surrogate"),
    "emit_surrogate": ("async def main(ctx, args):\n    ctx.emit('\\ud800')\n",
                       "raised TypeError: emit takes values JSON can hold: a string holds '\\ud800', a lone surrogate"),
    "return_surrogate": ("async def main(ctx, args):\n    return {'x': 'a\\udc00'}\n",
                         "main returned a value JSON cannot hold: a string holds '\\udc00', a lone surrogate"),
    "error_surrogate": ("async def main(ctx, args):\n    raise ValueError('bad \\ud800 text')\n",
                        "raised ValueError: bad ? text"),  # the error's words are kept, the lone surrogate replaced
}


def test_what_the_host_cannot_take_from_a_worker_ends_the_run_saying_what_it_was(
    make_host: Callable[..., InferletHost], tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """Values JSON cannot hold (a lone surrogate among them) or too large for one message fail in the inferlet,
    where it made them; a worker that writes past the protocol (bytes nested too deep for the reader, NaN, a number
    past a float's range, a lone surrogate) is stopped with that said, never left hanging nor reported as killed."""
    runs = []
    for name, (source, _) in PROTOCOL_BREAKERS.items():
        path = tmp_path / f"{name}.py"
        path.write_text(source)
        runs.append((path, []))
    outcomes = asyncio.run(served(make_host(), tokenizer, runs))
    for (name, (_, message)), (outcome, emitted) in zip(PROTOCOL_BREAKERS.items(), outcomes, strict=True):
        assert not outcome.ok and message in (outcome.error or ""), (name, outcome)
        assert emitted == [], name


PADDED_FLOOD = '''import gc
from pie.inferlet.wire import HEADER
from pie.inferlet.worker import Channel


async def main(ctx, args):
    channel = next(o for o in gc.get_objects() if isinstance(o, Channel))
    body = b'{"op":"refcount","page":0,"pad":[' + b"[]," * 340_000 + b'[]],"id":1}'
    while True:
        channel._sock.sendall(HEADER.pack(len(body)) + body)
'''
NEW = b'{"op":"new","run":RUN,"seq":1,"priority":0}'
FLOODS = {
    "padded": (PADDED_FLOOD, "the inferlet's worker sent more than the 17408 bytes its budgets let it send"),
    "asking": ("async def main(ctx, args):\n    c = ctx.context('The quick brown fox')\n    await c.flush()\n"
               "    while True:\n        c.kv_pages()\n",
               "the inferlet's worker sent more than the 17408 bytes its budgets let it send"),
    "unknown_key": (raw(b'{"op":"emit","value":1,"pad":[[],[]]}'),
                    "the worker's 'emit' carried what the protocol has no place for: ['pad']"),
    "spaced": (raw(b'{"op":"new","seq":1,' + b" " * 1000 + b'"priority":0}'),
               "the worker's 'new' took 1033 bytes, more than the 256 it needs"),
    "fat_forward": (raw(NEW, b'{"op":"forward","seq":1,"tokens":[1,2],"logits":true,"all_logits":false,"row":0,'
                             b'"id":1' + b" " * 300 + b"}"),
                    "the worker's 'forward' took 387 bytes, more than the 264 it needs"),
    "long_count": (raw(b'{"op":"result","run":RUN,"value":1,"error":null,"where":"","engine_failure":false,'
                       b'"threads_left":[' + b"1," * 5000 + b'1]}'), "the worker sent threads_left=[1, 1, 1"),
    "stuffed_failure": (raw(b'{"op":"result","run":RUN,"value":null,"error":"x","where":"","threads_left":0,'
                            b'"engine_failure":"yes"}'),
                        "the worker sent engine_failure='yes' where true or false belongs"),
    "stuffed_flag": (raw(NEW, b'{"op":"forward","run":RUN,"seq":1,"tokens":[1],"logits":[[]],"all_logits":false,'
                              b'"row":0,"id":1}'),
                     "the worker sent logits=[[]] where true or false belongs"),
}


def test_a_worker_that_floods_the_host_is_stopped_before_the_host_reads_more_than_its_budgets_allow(
    make_host: Callable[..., InferletHost], tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Messages padded to 1 MiB were parsed on the engine's thread without limit (0.03 s of a worker's CPU cost the
    host 3.8 s). Now what a run's worker may send in all follows from its budgets (RunLimits.received_bytes: its emit
    budget and 1 KiB a token, each message counted with 128 bytes more), each message is no larger than what it
    carries needs, and a message with a key the protocol does not know ends the run."""
    limits = RunLimits(wall_seconds=60, token_budget=16, emit_bytes=1024)
    assert limits.received_bytes == 17408
    parsed: list[int] = []

    def counted(body: bytes) -> dict[str, Any]:
        parsed.append(len(body))
        return decode(body)

    monkeypatch.setattr(workers, "decode", counted)
    runs = []
    for name, (source, _) in FLOODS.items():
        (tmp_path / f"{name}.py").write_text(source)
        runs.append((tmp_path / f"{name}.py", []))
    host = make_host()
    outcomes = asyncio.run(served(host, tokenizer, runs, limits))
    for (name, (_, message)), (outcome, emitted) in zip(FLOODS.items(), outcomes, strict=True):
        assert not outcome.ok and message in (outcome.error or "") and len(outcome.error or "") < 400, (name, outcome)
        assert emitted == [], name
    assert sum(parsed) <= len(runs) * limits.received_bytes, sum(parsed)
    assert host.scheduler.core.runner.pages.used_count == 0


def test_a_worker_that_says_an_engine_failure_ended_a_run_whose_passes_all_went_well_failed_of_its_own(
    make_host: Callable[..., InferletHost], tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """The worker's word that the engine's failure ended its run (its result's engine_failure) names no failure
    itself: the run is answered as the failure of one of its passes that the host saw, and with none it is the
    inferlet's own."""
    (tmp_path / "claims.py").write_text(raw(b'{"op":"result","run":RUN,"value":null,"error":"it says the engine '
                                            b'failed","where":"","threads_left":0,"engine_failure":true}'))
    ((outcome, _),) = asyncio.run(served(make_host(), tokenizer, [(tmp_path / "claims.py", [])]))
    assert outcome.error == "it says the engine failed" and outcome.failure is None


EMITTERS = {
    "small": "async def main(ctx, args):\n    while True:\n        ctx.emit(0)\n",
    "lists": "async def main(ctx, args):\n    while True:\n        ctx.emit([[]] * 1000)\n",
}


@pytest.mark.parametrize("name", sorted(EMITTERS))
def test_what_the_host_holds_of_a_runs_emitted_values_is_bounded_by_its_emit_budget(
    make_host: Callable[..., InferletHost], tokenizer: Tokenizer, tmp_path: Path, name: str
) -> None:
    """The emit budget counted JSON bytes while the host kept the values as Python objects, until the client read
    them: 21 times larger for lists of empty lists, and about 150 times for a stream of small numbers. Now the host
    keeps each as its JSON text, counted with 128 bytes more for what carries it, as a client that reads nothing
    would leave the run's events queued (each in a list of its own, as one step's events are delivered)."""
    (tmp_path / f"{name}.py").write_text(EMITTERS[name])
    limits = RunLimits(wall_seconds=60, emit_bytes=64 << 10)
    host = make_host()

    async def scenario() -> tuple[RunOutcome, int]:
        pool = WorkerPool(tokenizer.to_json(), host.scheduler.runner.config.vocab_size, size=1, sandbox=None)
        pool.start()
        try:
            worker = await pool.take()
            queued: list[list[Emitted]] = []
            tracemalloc.start()
            try:
                outcome = await serve_run(host.scheduler, worker, name, tmp_path / f"{name}.py", [], limits,
                                          lambda value: queued.append([Emitted(value)]))
                held = tracemalloc.get_traced_memory()[0]
                queued.clear()
                held -= tracemalloc.get_traced_memory()[0]
            finally:
                tracemalloc.stop()
            return outcome, held
        finally:
            await pool.close()

    outcome, held = asyncio.run(scenario())
    assert outcome.error is not None and "emitted more than 65536 bytes" in outcome.error, outcome
    assert held <= 2 * limits.emit_bytes, held


PROBE = '''"""The refcounts of its own prompt's pages, and what it is told of the pages it names."""


async def main(ctx, args):
    context = ctx.context(tokens=[int(t) for t in args[0].split(",")])
    await context.flush()
    context.fork()
    named = {}
    for page in map(int, args[1].split(",")):
        try:
            named[page] = ctx.page_refcount(page)
        except ValueError as exc:
            named[page] = str(exc)
    return {"mine": {page: ctx.page_refcount(page) for page in context.kv_pages()}, "named": named}
'''


def test_a_run_finds_only_its_own_pages_in_the_prefix_cache_and_counts_only_those(
    make_host: Callable[..., InferletHost], tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """Another tenant's cached prompt, guessed: the run's context took that tenant's pages from the prefix cache and
    page_refcount said so (2 for each), an exact oracle for others' prompts; refcount answered for any page. Now each
    run's sequences have a cache salt of their own, and a run is told the refcount of its own pages only."""
    (tmp_path / "probe.py").write_text(PROBE)
    host = make_host()
    prompt = list(range(11, 28))  # 4 full pages of 4 tokens and one of 1

    async def scenario() -> tuple[RunOutcome, list[int]]:
        tenant = host.scheduler.new_sequence()  # an HTTP request without cache_salt
        await host.scheduler.forward(tenant, prompt)
        assert tenant.device is not None
        theirs = list(tenant.device.pages)
        ((outcome, _),) = await served(host, tokenizer, [(tmp_path / "probe.py", [
            ",".join(map(str, prompt)), ",".join(map(str, theirs))])])
        host.scheduler.core.drop(tenant)
        return outcome, theirs

    outcome, theirs = asyncio.run(scenario())
    assert outcome.ok, outcome.error
    mine = {int(page): count for page, count in outcome.value["mine"].items()}
    assert len(mine) == 5 and not set(mine) & set(theirs), (mine, theirs)
    assert set(mine.values()) == {2}, "the run's context and its fork share its pages, and nobody else does"
    for page in theirs:
        assert "is not held by this run's contexts" in outcome.value["named"][str(page)], outcome.value["named"]
    assert host.scheduler.core.runner.pages.used_count == 0


PAST_CONTEXT = '''"""Passes that would take a context past the model's 256 positions: one long one, then one at a time."""
from pie.inferlet.context import ContextError


async def main(ctx, args):
    refused = []
    long = ctx.context(tokens=[5] * 300)
    try:
        await long.flush()
    except ContextError as exc:
        refused.append(str(exc))
    context = ctx.context(tokens=[5] * 250)
    try:
        await context.generate_tokens(10, stop_token_ids=[])
    except ContextError as exc:
        refused.append(str(exc))
    return {"refused": refused, "tokens": len(context.tokens)}
'''


def test_a_pass_that_would_take_a_context_past_the_models_context_is_refused(
    make_host: Callable[..., InferletHost], tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """HTTP requests are checked against the model's context (max_position_embeddings); a served run's passes went
    on past it, to positions the model has no embedding for. Now such a pass is refused before it reaches the
    engine, with ContextError saying why, and the context keeps what it held."""
    (tmp_path / "past_context.py").write_text(PAST_CONTEXT)
    host = make_host()
    assert host.scheduler.runner.config.max_position_embeddings == 256
    ((outcome, _),) = asyncio.run(served(host, tokenizer, [(tmp_path / "past_context.py", [])]))
    assert outcome.ok, outcome.error
    assert outcome.value["refused"] == [
        "the pass would take its context to 300 tokens, past the model's context of 256",
        "the pass would take its context to 257 tokens, past the model's context of 256",
    ]
    assert outcome.value["tokens"] == 257  # 256 forwarded, and the last token picked, which never needs its KV
    assert host.scheduler.core.runner.pages.used_count == 0


def test_a_served_inferlets_usage_error_and_help_reach_the_client(
    make_host: Callable[..., InferletHost], tokenizer: Tokenizer
) -> None:
    """argparse writes its usage and error to stderr and its --help to stdout, which no one reads in a worker: the
    run's error carries the first, and --help's text is the run's value."""
    example = EXAMPLES / "best_of_n.py"
    runs = [(example, ["x", "--n", "abc"]), (example, ["--help"]), (example, ["x", "--n", "2", "--max-tokens", "2"])]
    (failed, _), (helped, _), (fine, _) = asyncio.run(served(make_host(), tokenizer, runs))
    assert failed.error and "exited with status 2; it wrote: usage: " in failed.error, failed.error
    assert "argument --n: 'abc' is not a whole number" in failed.error
    assert helped.ok and helped.value.startswith("usage: best_of_n") and "--max-tokens" in helped.value, helped
    assert fine.ok, fine.error
    assert isinstance(fine.value, dict), "what a run returns is not replaced by what it printed"


def test_a_worker_that_never_reads_its_replies_is_not_read_either(make_host: Callable[..., InferletHost]) -> None:
    """A worker that asks for its pages again and again and reads none of the answers: the host answered each at
    once into an unbounded buffer (603 MB of replies in the review's flood), handling the burst in one turn of the
    engine's loop. Now it stops reading such a worker until the worker reads."""
    host = make_host()

    async def flood() -> tuple[int, bool]:
        inside, outside = socket.socketpair()
        reader, writer = await asyncio.open_unix_connection(sock=inside)
        worker = SimpleNamespace(reader=reader, writer=writer, rows=SimpleNamespace(vocab=1))
        run = _Run(host.scheduler, worker, RunLimits(wall_seconds=60),  # type: ignore[arg-type]
                   lambda prompt, generation: None, lambda value: None)
        requests = b"".join(encode({"op": "pages", "run": run.number, "seq": 1, "id": i}) for i in range(100_000))
        new = encode({"op": "new", "run": run.number, "seq": 1, "priority": 0})
        sender = threading.Thread(target=lambda: _send_until_closed(outside, new + requests))
        sender.start()
        serving = asyncio.ensure_future(run.serve())
        largest = 0
        for _ in range(100):  # bounded: a second of the loop's turns
            await asyncio.sleep(0.01)
            largest = max(largest, writer.transport.get_write_buffer_size())
        running = not serving.done()
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)
        outside.shutdown(socket.SHUT_RDWR)  # wakes the sender, blocked on a full socket
        sender.join(10)
        outside.close()
        writer.close()
        await run.close(keep_worker=True)
        return largest, running

    largest, running = asyncio.run(flood())
    assert running, "the run waits for the worker to read; it did not fail"
    assert largest < 1 << 20, f"{largest} bytes of replies waited in the host"


def _send_until_closed(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass  # the test closed its end: the host stopped reading, as it should


WIDE_TEXT = '''"""Text whose every character is outside ASCII, near the most a value may be (MAX_VALUE_BYTES of JSON)."""


async def main(ctx, args):
    ctx.emit("é" * 400_000)
    return "😀" * 200_000
'''


def test_a_value_of_text_outside_ascii_is_sent_as_its_size_was_measured(
    make_host: Callable[..., InferletHost], tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """The worker measured a value in UTF-8 and sent it escaped (\\u00e9: 6 bytes for 2): a value within its limit
    arrived at 2.4 MB, past what the host reads in one message, and the run ended as a protocol breach."""
    (tmp_path / "wide_text.py").write_text(WIDE_TEXT)
    ((outcome, emitted),) = asyncio.run(served(make_host(), tokenizer, [(tmp_path / "wide_text.py", [])],
                                               RunLimits(wall_seconds=60, emit_bytes=4 << 20)))
    assert outcome.ok, outcome.error
    assert outcome.value == "😀" * 200_000
    assert [json.loads(value) for value in emitted] == ["é" * 400_000]


def test_a_worker_that_cannot_get_a_descriptor_is_a_failure_said_once_not_a_traceback(
    make_host: Callable[..., InferletHost], tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Out of descriptors (`--inferlet-workers 100000`), each start's task died with its OSError unread: asyncio
    printed a traceback per worker, and what the start had made stayed open."""
    host = make_host()
    made: list[Path] = []
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp(*args: Any, **kwargs: Any) -> str:
        made.append(Path(real_mkdtemp(*args, **kwargs)))
        return str(made[-1])

    real_memfd_create = os.memfd_create

    def no_descriptor_left(name: str, *args: Any, **kwargs: Any) -> int:  # the start's last descriptor: its stderr
        if name == "pie-worker-stderr":
            raise OSError(24, "Too many open files")
        return real_memfd_create(name, *args, **kwargs)

    monkeypatch.setattr(workers, "RESTART_PAUSE_S", 0.0)
    monkeypatch.setattr(workers.tempfile, "mkdtemp", mkdtemp)
    monkeypatch.setattr(workers.os, "memfd_create", no_descriptor_left)
    unread: list[dict[str, Any]] = []

    async def scenario() -> list[str]:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unread.append(context))
        pool = WorkerPool(tokenizer.to_json(), host.scheduler.runner.config.vocab_size, size=2, sandbox=None)
        pool.start()
        try:
            for _ in range(200):  # bounded: a few starts fail in well under this
                if len(pool.failures) >= 2:
                    break
                await asyncio.sleep(0.01)
            return list(pool.failures)
        finally:
            await pool.close()

    failures = asyncio.run(scenario())
    assert failures and all("a worker could not be started: [Errno 24] Too many open files" in f for f in failures)
    assert not unread, unread
    assert made and not any(path.exists() for path in made), "a failed start removes its folder"


def test_the_pool_never_starts_past_its_size(make_host: Callable[..., InferletHost], tokenizer: Tokenizer) -> None:
    """A soak of cancelled and disconnected runs left 4 idle workers in a pool of 2 (about 30 MB each): a
    replacement start that paired with no take grew the pool for good."""
    host = make_host()

    async def scenario() -> tuple[int, int]:
        pool = WorkerPool(tokenizer.to_json(), host.scheduler.runner.config.vocab_size, size=2, sandbox=None)
        pool.start()
        try:
            taken = await pool.take()
            await taken.end()
            for _ in range(3):  # replacements asked for beyond the take's own
                pool._spawn()
            for _ in range(600):  # bounded: the starts end in well under this
                if not pool._starting:
                    break
                await asyncio.sleep(0.05)
            return pool.ready_count, len(pool._starting)
        finally:
            await pool.close()

    assert asyncio.run(scenario()) == (2, 0)


MEDDLERS = {
    "closes_stderr": ("import sys\n\nasync def main(ctx, args):\n    print('a word first', file=sys.stderr)\n"
                      "    sys.stderr.close()\n    raise ValueError('after closing')\n",
                      "inferlet 'closes_stderr' raised ValueError: after closing; it wrote: a word first"),
    "deep_result": ("async def main(ctx, args):\n    value = []\n    for _ in range(100_000):\n        value = [value]\n"
                    "    return value\n",
                    "main returned a value JSON cannot hold: lists or objects nested too deeply for JSON"),
    "deep_emit": ("async def main(ctx, args):\n    value = []\n    for _ in range(100_000):\n        value = [value]\n"
                  "    ctx.emit(value)\n",
                  "raised TypeError: emit takes values JSON can hold: lists or objects nested too deeply for JSON"),
    "stops_loop": ("import asyncio\n\nasync def main(ctx, args):\n    asyncio.get_running_loop().stop()\n"
                   "    await asyncio.sleep(0.01)\n",
                   "inferlet 'stops_loop' stopped the event loop it runs on before it ended"),
}


def test_an_inferlet_meddling_with_its_worker_fails_saying_what_it_did_and_the_next_run_is_served(
    make_host: Callable[..., InferletHost], tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """Each crashed its worker, and the run's error was the worker's exit: closing its stderr (the worker read what it
    had written from the closed buffer), a value nested past the JSON encoder's recursion, a stopped event loop."""
    runs = []
    for name, (source, _) in MEDDLERS.items():
        (tmp_path / f"{name}.py").write_text(source)
        runs.append((tmp_path / f"{name}.py", []))
    (tmp_path / "greedy.py").write_text(GREEDY)
    *meddled, (fine, _) = asyncio.run(served(make_host(), tokenizer, [*runs, (tmp_path / "greedy.py", [])]))
    for (name, (_, message)), (outcome, _) in zip(MEDDLERS.items(), meddled, strict=True):
        assert not outcome.ok and message in (outcome.error or ""), (name, outcome.error)
        assert "worker exited" not in (outcome.error or ""), (name, outcome.error)
    assert fine.ok and len(fine.value) == 4, fine


STDERR_FLOOD = '''import os


async def main(ctx, args):
    written = 0
    try:
        for _ in range(16):
            written += os.write(2, b"x" * 2**20)
    except OSError:
        pass
    return written
'''

LAST_WORDS = '''import os


async def main(ctx, args):
    os.write(2, b"some noise\\nthe last words\\n")
    os._exit(3)
'''


def test_what_a_worker_writes_to_its_stderr_is_bounded_and_its_last_words_still_reach_the_error(
    make_host: Callable[..., InferletHost], tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """A worker's stderr (its descriptor 2: what the inferlet's own ``sys.stderr`` writes is kept apart) was a file in
    the host's temporary folder, bounded only by the worker's file-size limit: a run's raw writes left 256 MiB there
    for each worker (and without the sandbox, no bound at all). Now it is a memory file of WORKER_STDERR_BYTES that
    cannot grow, whose last line a crashed worker's error still names."""
    (tmp_path / "flood.py").write_text(STDERR_FLOOD)
    (tmp_path / "crash.py").write_text(LAST_WORDS)
    (flood, _), (crash, _) = asyncio.run(
        served(make_host(), tokenizer, [(tmp_path / "flood.py", []), (tmp_path / "crash.py", [])])
    )
    assert flood.ok and 0 < flood.value <= workers.WORKER_STDERR_BYTES, flood
    assert not crash.ok and crash.error.endswith("its worker exited with status 3 (the last words)"), crash.error
