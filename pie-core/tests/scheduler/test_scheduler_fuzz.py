"""Randomized differential test of the batch scheduler, its paged KV cache, prefix cache and host-pool offload.

Each seed draws a scenario (:class:`Settings`: pool, host pool, scheduler limits, failure odds) and drives
``BatchScheduler`` step by step. Clients arrive with priorities and salts, prefill (some in two passes, many from a
shared prefix), decode greedily or from the top tokens, score (every row's logits), fork, truncate, think, cancel a
pass (pending, or just delivered) and drop; the runner's passes and the page copies fail at random
(:class:`FailureInjector`). The test checks

- after every step, the page pools' bookkeeping (:func:`check_pool`) and each sequence against what its client was
  told (:func:`check_sequence`);
- every delivered pass against the same tokens run alone (:class:`SoloRuns`), a token choice only where the
  alone run is not a near-tie (``MARGIN``); and every failed pass against what may fail it
  (:meth:`Scenario.check_failure`: an injected failure only the passes of the batch it hit, a failed swap none);
- on a fifth of the steps and at the end, the KV of every sequence (on the device or the host) and of every
  published page against the KV of its tokens run alone (:meth:`Scenario.check_kv`);
- at the end, that every page came back and nothing is left (:func:`assert_nothing_left`).

A test of its own checks that the seeds together reach every path they are there for (:data:`PATHS`).
``PIE_FUZZ_SEEDS=N`` runs seeds 0 to N-1 instead of the default ones, to look further after a change to the
scheduler: ``PIE_FUZZ_SEEDS=2000 pytest tests/scheduler/test_scheduler_fuzz.py``.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import pytest
from fuzz_support import (
    SWAP_COPIES,
    FailureInjector,
    FailureOdds,
    Injected,
    SeedRuns,
    SoloRuns,
    assert_nothing_left,
    assert_same_choice,
    assert_same_logits,
    fuzz_model,
    pages_kv,
    reference_runner,
    seeds,
)
from pie.generation.sampling import TopTokens
from pie.model.config import ModelConfig
from pie.plugins import Device
from pie.runtime.kv_cache import SequencePages, chain_keys
from pie.runtime.model_runner import ModelRunner
from pie.runtime.page_pool import PagePool
from pie.scheduler import (
    BatchScheduler,
    HostPagePool,
    RequestTooLarge,
    SchedulerConfig,
    Sequence,
    SequenceDropped,
)
from pie.scheduler.core import Pass, PassResult

SEEDS = seeds(200)
MAX_STEPS = 3000
"""A scenario still running after this many steps is a livelock."""
PATHS = (
    "preemptions", "swap_outs", "swap_ins", "recomputes", "swap_failures", "too_large", "prefix_cached_tokens",
    "replay_cached_tokens", "fork", "truncate", "cancel a pending pass", "cancel a delivered pass",
    "drop with passes queued", "failed by forward", "failed by prepare", "failed by page copy",
    "failed by the engine after the pass",
)
"""What the seeds together must reach, or they no longer test it: the scheduler's counters and the scenario's."""

POOL_SIZES = ((3, 14),) * 4 + ((1, 4), (40, 61))
"""The device pool sizes (in pages, from and below) a scenario draws from: mostly small, so that sequences preempt
each other all the time; some of 1 to 3 pages, where a sequence shares or waits; some large, where cached pages
linger until evicted."""
PassKind = Literal["logits", "top", "all_logits", "fill"]
FIRST_PASSES: tuple[PassKind, ...] = ("logits", "logits", "top", "all_logits")
"""What a client's prompt asks for, when it comes in one pass: half of them the logits."""


@dataclass(frozen=True)
class Settings:
    page_size: int
    pool_pages: int
    host_pages: int
    """0: no host pool, every preemption recomputes."""
    config: SchedulerConfig
    clients: int
    """How many clients arrive; forks come on top."""
    busy: int
    """Scales how fast clients arrive and how many passes each sends."""
    thinking: float
    """How likely an idle client is to hold its pages a few steps without a pass."""
    longest: int
    """The longest history a client grows to (within the model's context: no pass is refused for it)."""
    failures: FailureOdds

    @classmethod
    def draw(cls, rng: np.random.Generator, context: int) -> Settings:
        page_size = int(rng.choice([1, 2, 3, 4, 8]))
        low, high = POOL_SIZES[int(rng.integers(0, len(POOL_SIZES)))]
        pool_pages = int(rng.integers(low, high))
        busy = int(rng.choice([1, 1, 2, 3]))
        config = SchedulerConfig(
            max_batch_tokens=int(rng.integers(1, 48)), max_batch_sequences=int(rng.integers(1, 9)),
            prefill_chunk=int(rng.integers(1, 17)), short_prefill_tokens=int(rng.choice([0, 2, 4, 128])),
            prefix_caching=bool(rng.random() < 0.75),
        )
        return cls(
            page_size=page_size, pool_pages=pool_pages, host_pages=int(rng.choice([0, 0, 1, 2, 4, 16, 64])),
            config=config, clients=int(rng.integers(2, 12)) * busy, busy=busy,
            thinking=float(rng.choice([0.15, 0.15, 0.3])),
            longest=min(pool_pages * page_size + int(rng.integers(-2, 3)), context - 4),
            failures=draw_failure_odds(rng),
        )


def draw_failure_odds(rng: np.random.Generator) -> FailureOdds:
    """Half the scenarios inject no failure."""
    if rng.random() < 0.5:
        return FailureOdds()
    return FailureOdds(
        prepare=float(rng.choice([0.0, 0.05])), forward=float(rng.choice([0.0, 0.05, 0.15])),
        page_copy=float(rng.choice([0.0, 0.2])), after_pass=float(rng.choice([0.0, 0.1])),
        swap=float(rng.choice([0.0, 0.2, 0.5])),
    )


@dataclass(eq=False)
class PassRecord:
    """A pass a client sent, and what became of it."""

    tokens: list[int]
    kind: PassKind
    top: int
    handle: Pass | None = None
    state: Literal["pending", "done", "failed", "cancelled"] = "pending"
    result: PassResult = None
    error: BaseException | None = None
    delivered: bool = False
    delivered_at: int = -1
    """The step that delivered it."""


@dataclass(eq=False)
class Client:
    number: int
    seq: Sequence
    budget: int
    """Passes it still sends before it leaves."""
    history: list[int] = field(default_factory=list)
    """The tokens its passes delivered: what its sequence must hold."""
    passes: list[PassRecord] = field(default_factory=list)
    next_token: int | None = None
    """The token its last result chose (or a fork forced), to send next."""
    thinking: int = 0
    """Steps it still waits, holding its pages, before its next pass."""
    dropped: bool = False

    def pending(self) -> list[PassRecord]:
        return [record for record in self.passes if record.state == "pending"]

    def queued_length(self) -> int:
        return len(self.history) + sum(len(record.tokens) for record in self.pending())


def check_pool(name: str, pool: PagePool, tables: list[SequencePages]) -> None:
    """Each page's refcount is the number of page tables holding it; the pages nobody holds are exactly the free
    ones and the cached ones, each listed once; a cached page is published; the key maps are each other's inverse."""
    holders = Counter(page for table in tables for page in table.pages)
    for table in tables:
        assert len(table.pages) == -(-table.length // table.page_size), (
            f"{name}: a table of {table.length} tokens holds {len(table.pages)} pages of {table.page_size}"
        )
    wrong = {page: (pool.refcount(page), holders[page]) for page in range(pool.num_pages)
             if pool.refcount(page) != holders[page]}
    assert not wrong, f"{name} pages whose refcount is not their number of holders (refcount, holders): {wrong}"
    free, cached = pool._free, list(pool._idle)
    assert len(set(free) | set(cached)) == len(free) + len(cached), f"{name}: a page is listed twice as free"
    unheld = {page for page in range(pool.num_pages) if not holders[page]}
    assert unheld == set(free) | set(cached), (
        f"{name}: pages held by nobody {sorted(unheld)}, free or cached {sorted(set(free) | set(cached))}"
    )
    assert all(pool.is_published(page) for page in cached), f"{name}: a cached page is not published"
    assert len(pool._page_of) == len(pool._key_of) and all(
        pool._page_of[key] == page for page, key in pool._key_of.items()
    ), f"{name}: the page-of-key and key-of-page maps disagree"


def check_sequence(seq: Sequence, delivered: list[int]) -> None:
    """The sequence lives in one pool at most, holds no KV past its history, and its history is what its passes
    delivered (and, while a pass is under way, begins with that)."""
    assert seq.device is None or seq.host is None, f"{seq} is both on the device and on the host"
    assert seq.kv_length <= len(seq.history), f"{seq} holds KV past its history"
    if seq.queue:
        assert seq.history[: len(delivered)] == delivered, f"{seq}'s history does not begin with what was delivered"
    else:
        assert seq.history == delivered, f"{seq}'s history is not the {len(delivered)} tokens delivered"


class Scenario:
    """One seed's clients, pools and failures, driven step by step and checked all along."""

    def __init__(self, seed: int, device: Device, model: tuple[ModelConfig, dict[str, np.ndarray]], solo: SoloRuns):
        config, weights = model
        self.rng = rng = np.random.default_rng(seed)
        self.vocab = config.vocab_size
        self.settings = settings = Settings.draw(rng, config.max_position_embeddings)
        self.runner = ModelRunner(config, weights.items(), device, page_size=settings.page_size,
                                  max_cached_tokens=settings.pool_pages * settings.page_size)
        self.host = HostPagePool.for_runner(self.runner, settings.host_pages) if settings.host_pages else None
        self.core = BatchScheduler(self.runner, self.host, settings.config)
        self.solo = solo
        self.events: deque[str] = deque(maxlen=30)
        self.step_number = 0
        self.injector = FailureInjector(settings.failures, rng, self.note)
        self.injector.install(self.runner, self.host)
        self.clients: list[Client] = []
        self.arrivals = 0
        self.prefixes = [self.random_tokens(1, 3 * settings.page_size + 3) for _ in range(3)]
        self.page_tokens: dict[bytes, list[int]] = {}
        """The tokens up to and including each full page any sequence held, by the page's prefix-cache key."""
        self.reached: Counter[str] = Counter()

    def run(self) -> Counter[str]:
        """Run to the end; what it reached (the scheduler's counters and the scenario's)."""
        try:
            self.drive()
        except AssertionError as failure:
            events = "\n".join(self.events)
            raise AssertionError(f"at step {self.step_number}: {failure}\nits last events:\n{events}") from failure
        finally:
            self.runner.close()
            if self.host is not None:
                self.host.close()
        stats = vars(self.core.stats)
        return self.reached + Counter({path: stats[path] for path in PATHS if path in stats})

    def drive(self) -> None:
        for _ in range(2):
            self.arrive()
        for step in range(1, MAX_STEPS + 1):
            self.step_number = step
            self.act()
            self.check_bookkeeping()
            if not self.core.has_work():
                if self.arrivals >= self.settings.clients and not self.live():
                    break
                if not self.live() and self.rng.random() < 0.5:
                    self.arrive()
            self.injector.batch = []
            self.core.step()
            self.check_deliveries()
            self.check_bookkeeping()
            if self.rng.random() < 0.2:
                self.check_kv()
        else:
            raise AssertionError(f"no end after {MAX_STEPS} steps: {self.core.sequences()}")
        self.check_kv()
        assert_nothing_left(self.core)

    def note(self, event: str) -> None:
        self.events.append(f"[{self.step_number}] {event}")

    def random_tokens(self, low: int, high: int) -> list[int]:
        """Between ``low`` and ``high - 1`` random tokens (none of the special ones)."""
        return self.rng.integers(3, self.vocab, int(self.rng.integers(low, high))).tolist()

    def live(self) -> list[Client]:
        return [client for client in self.clients if not client.dropped]

    # -- what the clients do -------------------------------------------------

    def act(self) -> None:
        """Before a step: some clients cancel their last pass or leave with passes queued, a client may arrive,
        and each client with no pass under way makes its next move."""
        for client in self.live():
            self.maybe_interrupt(client)
        idle = [client for client in self.live() if not client.pending()]
        if self.arrivals < self.settings.clients and self.rng.random() < 0.4 * self.settings.busy:
            self.arrive()
        for client in idle:
            self.next_move(client)

    def maybe_interrupt(self, client: Client) -> None:
        """Cancel the last pass, pending or delivered by the step just run (before the client acted on it), or
        leave while passes are pending."""
        if not client.passes:
            return
        last = client.passes[-1]
        just_delivered = last.state == "done" and last.delivered_at == self.step_number - 1
        if self.rng.random() < 0.04 and (last.state == "pending" or just_delivered):
            self.cancel(client, last)
        elif self.rng.random() < 0.01 and client.pending():
            self.drop(client)

    def arrive(self) -> None:
        rng = self.rng
        salt = None if rng.random() < 0.8 else str(rng.choice(["a", "b"]))
        seq = self.core.new_sequence(priority=int(rng.choice([0, 0, 0, 1, 2])), cache_salt=salt)
        client = Client(len(self.clients), seq, budget=int(rng.integers(1, 10 * self.settings.busy)))
        self.clients.append(client)
        self.arrivals += 1
        if rng.random() < 0.5:
            prompt = self.prefixes[int(rng.integers(0, 3))] + self.random_tokens(0, 5)
        else:
            prompt = self.random_tokens(1, 2 * self.settings.page_size + 4)
        self.note(f"client {client.number} arrives: {seq}, salt {salt}, prompt of {len(prompt)}")
        if rng.random() < 0.2 and len(prompt) > 1:
            cut = int(rng.integers(1, len(prompt)))
            self.submit(client, prompt[:cut], "fill")
            self.submit(client, prompt[cut:], "logits")
        else:
            self.submit(client, prompt, FIRST_PASSES[int(rng.integers(0, len(FIRST_PASSES)))])

    def next_move(self, client: Client) -> None:
        """What a client with no pass under way does next: think, leave, fork, truncate, or send its next pass."""
        rng = self.rng
        if client.thinking:
            client.thinking -= 1
            return
        if rng.random() < self.settings.thinking:
            client.thinking = int(rng.integers(1, 8))
            return
        move = rng.random()
        if move < 0.03:
            self.drop(client)
        elif move < 0.10 and client.history and len(self.clients) < self.settings.clients + 6:
            self.fork(client)
        elif move < 0.15 and client.history:
            self.truncate(client)
            if client.history:
                self.send_next(client)
            else:
                self.submit(client, self.random_tokens(1, 6), "logits")
        else:
            self.send_next(client)

    def send_next(self, client: Client) -> None:
        """The client's chosen token (a random one when it has none), as a decode step or within a longer pass."""
        rng = self.rng
        if client.budget <= 0 or (client.next_token is None and not client.history):
            self.drop(client)
            return
        token = client.next_token if client.next_token is not None else self.random_tokens(1, 2)[0]
        if client.queued_length() + 1 > self.settings.longest:
            self.drop(client)
            return
        client.budget -= 1
        kind = rng.random()
        if kind < 0.08:
            self.submit(client, [token] + self.random_tokens(1, 6), "fill")
            self.submit(client, self.random_tokens(1, 2), "logits")
        elif kind < 0.15:
            self.submit(client, [token] + self.random_tokens(0, 5), "all_logits")
        elif kind < 0.35:
            self.submit(client, [token], "top")
        else:
            self.submit(client, [token], "logits")

    def submit(self, client: Client, tokens: list[int], kind: PassKind) -> None:
        record = PassRecord(tokens, kind, top=int(self.rng.choice([1, 2, 5])) if kind == "top" else 0)

        def on_done(result: PassResult, error: BaseException | None) -> None:
            assert not record.delivered, f"client {client.number}'s {kind} pass was delivered twice"
            record.delivered, record.result, record.error = True, result, error
            record.delivered_at = self.step_number

        record.handle = self.core.submit(client.seq, tokens, on_done, logits=kind != "fill",
                                         all_logits=kind == "all_logits", top=record.top)
        client.passes.append(record)
        top = f" (top {record.top})" if record.top else ""
        self.note(f"client {client.number} sends a {kind}{top} pass of {len(tokens)} tokens")

    def cancel(self, client: Client, record: PassRecord) -> None:
        was = record.state
        assert record.handle is not None
        self.core.cancel(client.seq, record.handle)
        record.state = "cancelled"
        if was == "done":  # the client had not acted on it yet: the pass is rolled back as if never delivered
            del client.history[len(client.history) - len(record.tokens) :]
            client.next_token = None
        self.reached["cancel a delivered pass" if was == "done" else "cancel a pending pass"] += 1
        self.note(f"client {client.number} cancels its {was} {record.kind} pass")
        if not client.pending():
            assert client.seq.history == client.history, f"client {client.number}'s cancel left another history"

    def drop(self, client: Client) -> None:
        pending = client.pending()
        self.core.drop(client.seq)
        client.dropped = True
        for record in pending:
            assert record.delivered and isinstance(record.error, SequenceDropped), (
                f"a pass of dropped client {client.number} got {record.error!r} (delivered: {record.delivered})"
            )
            record.state = "failed"
        if pending:
            self.reached["drop with passes queued"] += 1
        self.note(f"client {client.number} leaves")

    def fork(self, parent: Client) -> None:
        """n > 1: one to two children, each going on with the parent's chosen token or another one."""
        rng = self.rng
        for _ in range(int(rng.integers(1, 3))):
            priority = int(rng.choice([0, 1])) if rng.random() < 0.3 else None
            child = Client(len(self.clients), self.core.fork(parent.seq, priority=priority),
                           budget=int(rng.integers(1, 6)), history=list(parent.history))
            child.next_token = parent.next_token if rng.random() < 0.5 else self.random_tokens(1, 2)[0]
            self.clients.append(child)
            self.reached["fork"] += 1
            self.note(f"client {parent.number} forks client {child.number}: {child.seq}")

    def truncate(self, client: Client) -> None:
        length = int(self.rng.integers(0, len(client.history) + 1))
        self.core.truncate(client.seq, length)
        del client.history[length:]
        if not length:
            client.next_token = None
        self.reached["truncate"] += 1
        self.note(f"client {client.number} truncates to {length}")

    # -- what the passes got ---------------------------------------------------

    def check_deliveries(self) -> None:
        """Each pass the step delivered: its result against the oracle, or its failure against what may fail it."""
        for client in self.clients:
            for record in client.pending():
                if not record.delivered:
                    continue
                if record.error is not None:
                    self.check_failure(client, record)
                else:
                    self.check_result(client, record)

    def pages_for(self, client: Client, record: PassRecord) -> int:
        return -(-(len(client.history) + len(record.tokens)) // self.settings.page_size)

    def check_failure(self, client: Client, record: PassRecord) -> None:
        """A pass may fail for being larger than the whole pool, or from a failure injected into its own batch."""
        record.state = "failed"
        client.next_token = None
        error, pool = record.error, self.settings.pool_pages
        what = f"client {client.number}'s {record.kind} pass"
        if isinstance(error, RequestTooLarge):
            pages = self.pages_for(client, record)
            assert pages > pool, f"{what} of {pages} pages was refused as too large for a pool of {pool}"
        elif isinstance(error, Injected):
            assert str(error) not in SWAP_COPIES, f"{what} failed from a failed swap copy ({error})"
            assert self.injector.in_failing_batch(client.seq), f"{what} failed ({error}) but was not in that batch"
            self.reached[f"failed by {error}"] += 1
        else:
            raise AssertionError(f"{what} failed: {type(error).__name__}: {error}") from error
        self.note(f"{what} failed: {type(error).__name__} {error}")

    def check_result(self, client: Client, record: PassRecord) -> None:
        """The pass's result is what the client's whole history, run alone, gives."""
        pages = self.pages_for(client, record)
        assert pages <= self.settings.pool_pages, f"a pass of {pages} pages ran in a pool of {self.settings.pool_pages}"
        before = len(client.history)
        client.history.extend(record.tokens)
        record.state = "done"
        result, what = record.result, f"client {client.number}'s {record.kind} pass"
        if record.kind == "fill":
            assert result is None, f"{what} got a result"
            client.next_token = None
            return
        reference = self.solo.logits(client.history)
        if record.kind == "all_logits":
            rows = reference[before:]
            assert isinstance(result, np.ndarray) and result.shape == rows.shape, f"{what} got {result!r:.80}"
            for row, (got, want) in enumerate(zip(result, rows, strict=True)):
                assert_same_logits(got, want, f"{what}, row {row}")
            client.next_token = int(np.argmax(result[-1]))
        elif isinstance(result, TopTokens):
            assert record.kind == "top", f"{what} got the top tokens"
            check_top_tokens(result, reference[-1], what)
            client.next_token = int(result.indices[0])
        else:
            assert isinstance(result, np.ndarray), f"{what} got {type(result).__name__}"
            assert_same_logits(result, reference[-1], what)
            client.next_token = int(np.argmax(result))

    # -- invariants ----------------------------------------------------------

    def check_bookkeeping(self) -> None:
        """The scheduler's sequences are the live clients'; both pools and every sequence are consistent."""
        sequences = self.core.sequences()
        live = self.live()
        assert {seq.id for seq in sequences} == {client.seq.id for client in live}, (
            f"the scheduler has {sequences}, the clients {[client.seq for client in live]}"
        )
        check_pool("device", self.runner.pages, [seq.device for seq in sequences if seq.device is not None])
        if self.host is not None:
            check_pool("host", self.host, [seq.host for seq in sequences if seq.host is not None])
        for client in live:
            check_sequence(client.seq, client.history)
        if self.settings.config.prefix_caching:
            self.learn_page_keys(sequences)

    def learn_page_keys(self, sequences: list[Sequence]) -> None:
        """Remember the tokens each full page of each sequence's history stands for, by its prefix-cache key."""
        size = self.settings.page_size
        for seq in sequences:
            full = len(seq.history) // size * size
            for index, key in enumerate(chain_keys(seq.history[:full], size, seq.cache_root)):
                self.page_tokens.setdefault(key, seq.history[: (index + 1) * size])

    def check_kv(self) -> None:
        """Every sequence's KV, on the device or on the host, and every published page's, is its tokens' alone."""
        for seq in self.core.sequences():
            if not seq.kv_length:
                continue
            pool, table = (self.runner.pages, seq.device) if seq.device is not None else (self.host, seq.host)
            assert pool is not None and table is not None
            got = pages_kv(pool, table.pages, seq.kv_length)
            want = self.solo.kv(seq.history[: seq.kv_length])
            if not np.allclose(got, want, atol=1e-4, rtol=1e-4):
                wrong = np.abs(got - want).max(axis=(0, 1, 3, 4)) > 1e-4
                raise AssertionError(f"{seq}: KV differs from alone from token {int(np.argmax(wrong))}")
        size, device = self.settings.page_size, self.runner.pages
        for key, tokens in self.page_tokens.items():
            page = device.lookup(key)
            if page is None:
                continue
            got = pages_kv(device, [page], size)
            assert np.allclose(got, self.solo.kv(tokens)[:, :, -size:], atol=1e-4, rtol=1e-4), (
                f"published page {page} (held {device.refcount(page)} times) holds another KV than its key names"
            )


def check_top_tokens(result: TopTokens, reference: np.ndarray, what: str) -> None:
    """The first token is the alone run's choice; each is among its most likely; the values are its logits."""
    assert_same_choice(int(result.indices[0]), reference, what)
    floor = np.sort(reference)[-len(result.indices)]
    assert np.all(reference[result.indices] >= floor - 1e-3), f"{what}: {result.indices} are not the most likely"
    if result.values is not None:
        assert np.allclose(result.values, reference[result.indices], atol=2e-3, rtol=1e-3), (
            f"{what}: top values {result.values}, alone {reference[result.indices]}"
        )


@pytest.fixture(scope="module")
def runs(cpu: Device) -> Iterator[SeedRuns]:
    model = fuzz_model()
    solo = reference_runner(cpu, model)
    yield SeedRuns(lambda seed: Scenario(seed, cpu, model, SoloRuns(solo)).run())
    solo.close()


@pytest.mark.parametrize("seed", SEEDS)
def test_every_pass_equals_its_tokens_run_alone_and_the_pages_stay_consistent(runs: SeedRuns, seed: int) -> None:
    runs.reached(seed)


def test_the_seeds_reach_every_path_they_check(runs: SeedRuns) -> None:
    missing = runs.missing(SEEDS, PATHS)
    assert not missing, f"no seed of {SEEDS} reached {missing}: the fuzz test no longer checks those"
