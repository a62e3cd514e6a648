"""Randomized test of the batch scheduler's asyncio face (``Scheduler.forward``, ``generate``) under cancellation.

Each seed draws a pool, a scheduler configuration, failure odds and a list of requests (:class:`Request`):
``generate`` calls, and forked ones as the server runs n > 1 (a prefill, ``fork``, children decoding at once, some
reading only the top token). They arrive over the event loop's turns; a quarter are cancelled after a random
step, and some tasks are cancelled in the very turn a step delivered (before they resume: the cancel must roll
the delivered pass back). Forward passes and the swap copies fail at random. Every request that completes must
have chosen each token as its tokens so far, run alone, choose it (:func:`assert_greedy`); one that fails may
fail only from an injected forward failure or for being larger than the pool; at the end nothing may be left
(:func:`assert_nothing_left`). A test of its own checks that the seeds together reach every path they are there
for (:data:`PATHS`).

``PIE_FUZZ_SEEDS=N`` runs seeds 0 to N-1 instead of the default ones (as in ``test_scheduler_fuzz.py``).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator, Sequence as Seq
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pytest
from fuzz_support import (
    FailureInjector,
    FailureOdds,
    Injected,
    SeedRuns,
    SoloRuns,
    assert_nothing_left,
    assert_same_choice,
    fuzz_model,
    reference_runner,
    seeds,
)
from pie.generation.sampling import TopTokens
from pie.model.config import ModelConfig
from pie.plugins import Device
from pie.runtime.model_runner import ModelRunner
from pie.scheduler import BatchScheduler, HostPagePool, RequestTooLarge, Scheduler, SchedulerConfig, Sequence, generate

SEEDS = seeds(100)
MAX_SETTLES = 5000
"""A scenario whose driver settled (once before each step) this many times is a livelock: its requests are
cancelled and it fails."""
PATHS = (
    "generate completed", "fork completed", "cancel", "cancel in the delivery's turn", "failed by forward",
    "too_large", "preemptions", "swap_outs", "swap_ins", "recomputes", "swap_failures", "prefix_cached_tokens",
)
"""What the seeds together must reach, or they no longer test it: the scenario's counts and the scheduler's."""

Branches = list[list[int]]
"""What a request got: the tokens of each branch (one, unless forked)."""


@dataclass(frozen=True)
class Request:
    arrival: int
    """The event-loop turn it arrives in."""
    kind: Literal["generate", "fork"]
    prompt: list[int]
    tokens: int
    """How many tokens it asks for (each branch, forked)."""
    priority: int


def assert_greedy(solo: SoloRuns, prompt: Seq[int], tokens: Seq[int], what: str) -> None:
    """Each token is the one the tokens before it, run alone, choose (within MARGIN)."""
    for index, token in enumerate(tokens):
        assert_same_choice(token, solo.logits([*prompt, *tokens[:index]])[-1], f"{what}, token {index}")


class DriverScenario:
    """One seed's requests, served concurrently by a :class:`Scheduler` and cancelled at random."""

    def __init__(self, seed: int, device: Device, model: tuple[ModelConfig, dict[str, np.ndarray]], solo: SoloRuns):
        config, weights = model
        self.rng = rng = np.random.default_rng(seed)
        self.vocab = config.vocab_size
        self.page_size = int(rng.choice([1, 2, 4]))
        self.pool_pages = int(rng.integers(4, 16))
        host_pages = int(rng.choice([0, 2, 8, 64]))
        scheduler_config = SchedulerConfig(
            max_batch_tokens=int(rng.integers(1, 40)), max_batch_sequences=int(rng.integers(1, 9)),
            prefill_chunk=int(rng.integers(1, 17)), short_prefill_tokens=int(rng.choice([0, 4, 128])),
            prefix_caching=bool(rng.random() < 0.75),
        )
        self.runner = ModelRunner(config, weights.items(), device, page_size=self.page_size,
                                  max_cached_tokens=self.pool_pages * self.page_size)
        self.host = HostPagePool.for_runner(self.runner, host_pages) if host_pages else None
        self.core = BatchScheduler(self.runner, self.host, scheduler_config)
        self.scheduler = Scheduler(self.core, on_settled=self.settled)
        odds = FailureOdds(forward=float(rng.choice([0.0, 0.0, 0.05, 0.15])), swap=float(rng.choice([0.0, 0.3])))
        FailureInjector(odds, rng).install(self.runner, self.host)
        self.solo = solo
        self.requests = self.draw_requests()
        self.tasks: list[asyncio.Task[Branches]] = []
        self.settles = 0
        """How many times the driver settled: before each step, and before it went idle."""
        self.cancels_after: dict[int, list[asyncio.Task[Branches]]] = {}
        """The tasks to cancel when the driver settles for that time."""
        self.cancels_on_delivery: list[asyncio.Task[Branches]] = []
        """The tasks to cancel right after the next step delivers, before they resume."""
        self.livelocked = False
        self.reached: Counter[str] = Counter()
        flush = self.core._flush_deliveries

        def deliver_then_cancel() -> None:
            flush()
            while self.cancels_on_delivery:
                if self.cancels_on_delivery.pop().cancel():
                    self.reached["cancel in the delivery's turn"] += 1

        self.core._flush_deliveries = deliver_then_cancel

    def draw_requests(self) -> list[Request]:
        rng = self.rng
        prefixes = [self.random_tokens(1, 3 * self.page_size + 2) for _ in range(2)]
        requests = []
        for _ in range(int(rng.integers(3, 25))):
            if rng.random() < 0.5:
                prompt = prefixes[int(rng.integers(0, 2))] + self.random_tokens(0, 4)
            else:
                prompt = self.random_tokens(1, 3 * self.page_size + 3)
            tokens = int(rng.integers(1, 12))
            kind: Literal["generate", "fork"] = "fork" if rng.random() < 0.25 else "generate"
            requests.append(Request(int(rng.integers(0, 20)), kind, prompt, tokens, int(rng.choice([0, 0, 1]))))
        return sorted(requests, key=lambda request: request.arrival)

    def random_tokens(self, low: int, high: int) -> list[int]:
        return self.rng.integers(3, self.vocab, int(self.rng.integers(low, high))).tolist()

    def run(self) -> Counter[str]:
        """Serve every request, check what each got, and that nothing is left; what it reached."""
        try:
            asyncio.run(self.serve_all())
            assert not self.livelocked, f"still stepping after {MAX_SETTLES} steps"
            for request, task in zip(self.requests, self.tasks, strict=True):
                self.check(request, task)
            assert_nothing_left(self.core)
        finally:
            self.runner.close()
            if self.host is not None:
                self.host.close()
        stats = vars(self.core.stats)
        return self.reached + Counter({path: stats[path] for path in PATHS if path in stats})

    async def serve_all(self) -> None:
        turn = 0
        for request in self.requests:
            while turn < request.arrival:  # arrivals spread over the event loop's turns
                await asyncio.sleep(0)
                turn += 1
            task = asyncio.ensure_future(self.serve(request))
            self.tasks.append(task)
            if self.rng.random() < 0.25:
                self.cancels_after.setdefault(self.settles + int(self.rng.integers(1, 13)), []).append(task)
        await asyncio.gather(*self.tasks, return_exceptions=True)
        driver = self.scheduler._driver
        if driver is not None:
            await driver  # it ends once it finds no work left

    def settled(self) -> None:
        """Cancel the tasks planned for now, and maybe plan one for the next step's delivery."""
        self.settles += 1
        if self.settles > MAX_SETTLES and not self.livelocked:
            self.livelocked = True
            for task in self.tasks:
                task.cancel()
        for task in self.cancels_after.pop(self.settles, []):
            if task.cancel():
                self.reached["cancel"] += 1
        if self.rng.random() < 0.15:
            running = [task for task in self.tasks if not task.done()]
            if running:
                self.cancels_on_delivery.append(running[int(self.rng.integers(0, len(running)))])

    async def serve(self, request: Request) -> Branches:
        if request.kind == "generate":
            return [await generate(self.scheduler, request.prompt, max_tokens=request.tokens,
                                   priority=request.priority)]
        return await self.forked(request)

    async def forked(self, request: Request) -> Branches:
        """n > 1 as the server runs it: the prompt once, then the parent and two to three children decoding at
        once, each child from a token forced on it."""
        core, scheduler = self.core, self.scheduler
        parent = scheduler.new_sequence(request.priority)
        branches = [parent]
        try:
            logits = await scheduler.forward(parent, request.prompt)
            assert isinstance(logits, np.ndarray)
            firsts = [int(np.argmax(logits))] + self.random_tokens(1, 3)
            branches += [core.fork(parent) for _ in firsts[1:]]
            outcomes = await asyncio.gather(
                *(self.decode(seq, first, request.tokens) for seq, first in zip(branches, firsts, strict=True)),
                return_exceptions=True,
            )
        finally:
            for seq in branches:
                core.drop(seq)
        branch_tokens = []
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
            branch_tokens.append(outcome)
        return branch_tokens

    async def decode(self, seq: Sequence, first: int, count: int) -> list[int]:
        tokens = [first]
        while len(tokens) < count:
            result = await self.scheduler.forward(seq, [tokens[-1]], top=int(self.rng.choice([0, 1])))
            tokens.append(int(result.indices[0]) if isinstance(result, TopTokens) else int(np.argmax(result)))
        return tokens

    def check(self, request: Request, task: asyncio.Task[Branches]) -> None:
        if task.cancelled():
            return
        what = f"the {request.kind} request of {len(request.prompt)} tokens and {request.tokens} more"
        error = task.exception()
        if error is None:
            self.check_tokens(request, task.result(), what)
        else:
            self.check_failure(request, error, what)

    def check_tokens(self, request: Request, branches: Branches, what: str) -> None:
        for branch, tokens in enumerate(branches):
            assert len(tokens) == request.tokens, f"{what}: branch {branch} got {len(tokens)} tokens"
            if branch == 0:  # greedy from the prompt
                assert_greedy(self.solo, request.prompt, tokens, what)
            else:  # greedy after the token forced on it
                assert_greedy(self.solo, [*request.prompt, tokens[0]], tokens[1:], f"{what}, branch {branch}")
        self.reached[f"{request.kind} completed"] += 1

    def check_failure(self, request: Request, error: BaseException, what: str) -> None:
        """A request may fail from an injected forward failure, or for being larger than the whole pool."""
        if isinstance(error, Injected):
            assert str(error) == "forward", f"{what} failed from a failed swap copy ({error})"
            self.reached["failed by forward"] += 1
        elif isinstance(error, RequestTooLarge):
            pages = -(-(len(request.prompt) + request.tokens - 1) // self.page_size)
            assert pages > self.pool_pages, (
                f"{what} ({pages} pages) was too large for a pool of {self.pool_pages}"
            )
        else:
            raise AssertionError(f"{what} failed: {type(error).__name__}: {error}") from error


@pytest.fixture(scope="module")
def runs(cpu: Device) -> Iterator[SeedRuns]:
    model = fuzz_model()
    solo = reference_runner(cpu, model)
    yield SeedRuns(lambda seed: DriverScenario(seed, cpu, model, SoloRuns(solo)).run())
    solo.close()


@pytest.mark.parametrize("seed", SEEDS)
def test_requests_get_their_tokens_run_alone_whenever_they_are_cancelled(runs: SeedRuns, seed: int) -> None:
    runs.reached(seed)


def test_the_seeds_reach_every_path_they_check(runs: SeedRuns) -> None:
    missing = runs.missing(SEEDS, PATHS)
    assert not missing, f"no seed of {SEEDS} reached {missing}: the fuzz test no longer checks those"
