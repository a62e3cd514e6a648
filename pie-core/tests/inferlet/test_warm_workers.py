"""Warm workers: a worker taken for an installed inferlet serves that inferlet's next runs, and only after clean ends."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pie.inferlet import InferletHost, load_inferlet
from pie.inferlet.workers import RunLimits, RunOutcome, WorkerPool, serve_run
from pie.model.tokenizer import Tokenizer

COUNTING = '''"""Greedy tokens, this process's id and how many runs this module has served."""
import os

RUNS = 0


async def main(ctx, args):
    global RUNS
    RUNS += 1
    if args and args[0] == "fail":
        raise RuntimeError("asked to fail")
    if args and args[0] == "spin":
        import time

        while time.process_time() < float(args[1]):
            pass
    context = ctx.context("The quick brown fox")
    return {"pid": os.getpid(), "runs": RUNS, "tokens": await context.generate_tokens(4)}
'''
OTHER = '''"""This process's id."""
import os


async def main(ctx, args):
    return {"pid": os.getpid()}
'''


LEAVER = '''"""Leaves something of its run behind that emits later: a thread, or a timer's signal handler; or waits, or
constrains its output (which starts pie's own thread for the grammar's masks)."""
import _thread
import asyncio
import os
import signal
import time


async def main(ctx, args):
    if args[0] == "thread":  # a thread threading.enumerate() does not list
        _thread.start_new_thread(lambda: (time.sleep(1), ctx.emit({"leaked": args[1]})), ())
    elif args[0] == "signal":
        signal.signal(signal.SIGALRM, lambda *_: ctx.emit({"leaked": args[1]}))
        signal.setitimer(signal.ITIMER_REAL, 1.0)
    elif args[0] == "grammar":
        await ctx.context("The answer is").generate(8, regex="(yes|no)")
    else:
        await asyncio.sleep(2)
    return {"pid": os.getpid()}
'''


@pytest.fixture
def inferlets(tmp_path: Path) -> dict[str, Path]:
    paths = {"counting": tmp_path / "counting.py", "other": tmp_path / "other.py", "leaver": tmp_path / "leaver.py"}
    paths["counting"].write_text(COUNTING)
    paths["other"].write_text(OTHER)
    paths["leaver"].write_text(LEAVER)
    return paths


def run_in_turn(host: InferletHost, tokenizer: Tokenizer, runs: list[tuple[Path, list[str], bool]],
                runs_per_worker: int = 64, sandbox: dict[str, Any] | None = None,
                emitted: list[list[Any]] | None = None) -> list[RunOutcome]:
    """Each run (its inferlet, its arguments, whether it is taken as an installed inferlet) one after another;
    what each emits goes to a list of its own in ``emitted``."""

    async def scenario() -> list[RunOutcome]:
        pool = WorkerPool(tokenizer.to_json(), host.scheduler.runner.config.vocab_size, size=2, sandbox=sandbox,
                          runs_per_worker=runs_per_worker)
        pool.start()
        outcomes = []
        try:
            for path, args, installed in runs:
                worker = await asyncio.wait_for(pool.take(str(path) if installed else None), 60)
                values: list[Any] = []
                outcome = await serve_run(host.scheduler, worker, path.stem, path, args, RunLimits(wall_seconds=60),
                                          lambda text, into=values: into.append(json.loads(text)))
                if emitted is not None:
                    emitted.append(values)
                await pool.give_back(worker)
                outcomes.append(outcome)
                assert host.scheduler.core.runner.pages.used_count == 0  # every run's pages back
            return outcomes
        finally:
            await pool.close()

    return asyncio.run(scenario())


def values(outcomes: list[RunOutcome]) -> list[dict[str, Any]]:
    for outcome in outcomes:
        assert outcome.ok, outcome.error
    return [outcome.value for outcome in outcomes]


def test_a_warm_worker_serves_its_inferlets_next_runs_with_the_same_tokens_up_to_its_run_count(
    make_host: Callable[..., InferletHost], tokenizer: Tokenizer, inferlets: dict[str, Path]
) -> None:
    expected = asyncio.run(make_host().run(load_inferlet(inferlets["counting"]), []))
    assert expected.ok, expected.details
    served = values(run_in_turn(make_host(), tokenizer, [(inferlets["counting"], [], True)] * 4, runs_per_worker=3))
    assert [value["tokens"] for value in served] == [expected.value["tokens"]] * 4
    pids = [value["pid"] for value in served]
    assert pids[0] == pids[1] == pids[2] != pids[3], pids
    assert [value["runs"] for value in served] == [1, 2, 3, 1]  # the module stays loaded in its worker


def test_a_run_that_ends_in_an_error_retires_its_worker(
    make_host: Callable[..., InferletHost], tokenizer: Tokenizer, inferlets: dict[str, Path]
) -> None:
    counting = inferlets["counting"]
    first, failed, after = run_in_turn(make_host(), tokenizer, [(counting, [], True), (counting, ["fail"], True),
                                                                 (counting, [], True)])
    assert failed.error is not None and "asked to fail" in failed.error
    assert first.ok and after.ok, (first.error, after.error)
    assert first.value["runs"] == 1 and after.value["runs"] == 1  # a new worker after the failure
    assert first.value["pid"] != after.value["pid"]


def test_a_worker_not_taken_for_an_installed_inferlet_serves_one_run(
    make_host: Callable[..., InferletHost], tokenizer: Tokenizer, inferlets: dict[str, Path]
) -> None:
    counting = inferlets["counting"]
    served = values(run_in_turn(make_host(), tokenizer, [(counting, [], False)] * 3))
    assert len({value["pid"] for value in served}) == 3
    assert [value["runs"] for value in served] == [1, 1, 1]


def test_warm_workers_serve_only_the_inferlet_they_were_taken_for(
    make_host: Callable[..., InferletHost], tokenizer: Tokenizer, inferlets: dict[str, Path]
) -> None:
    counting, other = inferlets["counting"], inferlets["other"]
    served = values(run_in_turn(make_host(), tokenizer, [(counting, [], True), (other, [], True), (counting, [], True),
                                                          (other, [], True)]))
    assert served[0]["pid"] == served[2]["pid"] and served[1]["pid"] == served[3]["pid"]
    assert served[0]["pid"] != served[1]["pid"]
    assert served[2]["runs"] == 2


def test_a_worker_near_its_cpu_limit_serves_no_further_run(
    make_host: Callable[..., InferletHost], tokenizer: Tokenizer, inferlets: dict[str, Path]
) -> None:
    # The sandbox's CPU limit counts a worker's whole life: past half of it, the next run gets a new worker.
    sandbox = {"memory_bytes": 2 << 30, "cpu_seconds": 2, "read_only": [str(inferlets["counting"].parent)],
               "required": []}
    counting = inferlets["counting"]
    served = values(run_in_turn(make_host(), tokenizer, [(counting, [], True), (counting, ["spin", "1.2"], True),
                                                          (counting, [], True)], sandbox=sandbox))
    assert served[0]["pid"] == served[1]["pid"] != served[2]["pid"]


def test_a_run_taken_for_one_inferlet_cannot_run_another(
    make_host: Callable[..., InferletHost], tokenizer: Tokenizer, inferlets: dict[str, Path]
) -> None:
    host = make_host()

    async def scenario() -> None:
        pool = WorkerPool(tokenizer.to_json(), host.scheduler.runner.config.vocab_size, size=1, sandbox=None)
        pool.start()
        try:
            worker = await asyncio.wait_for(pool.take(str(inferlets["counting"])), 60)
            with pytest.raises(ValueError, match="cannot run"):
                await serve_run(host.scheduler, worker, "other", inferlets["other"], [], RunLimits(), lambda v: None)
            await worker.end()
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_past_the_pools_size_the_warm_worker_idle_longest_is_ended(
    make_host: Callable[..., InferletHost], tokenizer: Tokenizer, inferlets: dict[str, Path]
) -> None:
    # A pool of 2 keeps 2 warm workers: after other, then counting twice at once, the other inferlet's worker
    # (idle longest) is the one ended, though counting's list is the longer.
    host = make_host()
    counting, other = inferlets["counting"], inferlets["other"]

    async def scenario() -> None:
        pool = WorkerPool(tokenizer.to_json(), host.scheduler.runner.config.vocab_size, size=2, sandbox=None)
        pool.start()
        try:
            async def run(path: Path) -> Any:
                worker = await asyncio.wait_for(pool.take(str(path)), 60)
                outcome = await serve_run(host.scheduler, worker, path.stem, path, [], RunLimits(wall_seconds=60),
                                          lambda value: None)
                assert outcome.ok, outcome.error
                return worker

            lone = await run(other)
            await pool.give_back(lone)
            pair = await asyncio.gather(run(counting), run(counting))
            for worker in pair:
                await pool.give_back(worker)
            assert pool.warm_count == 2 and not lone.running and all(worker.running for worker in pair)
        finally:
            await pool.close()

    asyncio.run(scenario())


def test_what_a_run_leaves_behind_never_reaches_the_next_run_in_its_worker(
    make_host: Callable[..., InferletHost], tokenizer: Tokenizer, inferlets: dict[str, Path]
) -> None:
    """A warm worker delivered to the next run (another client's) what an earlier run's leftover thread emitted. Now
    a worker whose run left a thread running serves no further run (it counts its threads, not only those
    threading knows); and every message names the run it belongs to, so what a run leaves behind without a thread
    (a timer's signal handler) is dropped, and its worker too after that run. The threads pie itself starts (the
    grammar's) do not count. The sandbox applies where it can (the thread count is read through a descriptor opened
    before the lock-down)."""
    leaver = inferlets["leaver"]
    sandbox = {"memory_bytes": 2 << 30, "cpu_seconds": 60, "read_only": [str(leaver.parent)], "required": []}
    emitted: list[list[Any]] = []
    runs = [(leaver, ["grammar"], True), (leaver, ["thread", "alice"], True), (leaver, ["wait"], True),
            (leaver, ["signal", "carol"], True), (leaver, ["wait"], True), (leaver, ["wait"], True)]
    pids = [value["pid"] for value in values(run_in_turn(make_host(), tokenizer, runs, sandbox=sandbox,
                                                         emitted=emitted))]
    assert emitted == [[]] * 6, emitted
    assert pids[0] == pids[1] != pids[2] == pids[3] == pids[4] != pids[5], pids
