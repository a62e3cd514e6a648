"""What the scheduler fuzz tests share: their model and seeds, the solo-run oracle, failure injection, and the checks
at the end of a run."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import numpy as np
from pie.model.config import ModelConfig
from pie.plugins import Device
from pie.runtime.kv_cache import SequencePages
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.runtime.page_pool import PagePool
from pie.scheduler import BatchScheduler, HostPagePool, Sequence
from pie.testing.models import random_weights, tiny_config

MARGIN = 1e-3
"""Two tokens whose reference logits are closer than this may come out in either order after float rounding (a
chunked prefill sums in another order than one prefill): choosing the other one of them is no bug."""
SWAP_COPIES = ("swap out", "swap in", "host read", "host write")
"""Where an injected failure only makes the scheduler recompute a sequence: it must never fail a pass."""


def seeds(default: int) -> range:
    """The seeds a fuzz test runs: ``default`` of them, or as many as ``PIE_FUZZ_SEEDS`` says."""
    return range(int(os.environ.get("PIE_FUZZ_SEEDS", default)))


def fuzz_model() -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """The scheduler tests' tiny model with two layers instead of one, so a page copy that moves one layer's KV
    and not the other's shows."""
    config = tiny_config(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16)
    weights = random_weights(config, seed=1)
    weights["lm_head.weight"] *= 20  # far-apart logits: few near-ties for MARGIN to excuse
    return config, weights


def reference_runner(device: Device, model: tuple[ModelConfig, dict[str, np.ndarray]]) -> ModelRunner:
    """A runner with room for one whole context, for :class:`SoloRuns`."""
    config, weights = model
    return ModelRunner(config, weights.items(), device, page_size=16, max_cached_tokens=config.max_position_embeddings)


class SeedRuns:
    """Each seed's scenario, run once: a seed's own test checks it, the coverage test adds up what all reached."""

    def __init__(self, run: Callable[[int], Counter[str]]):
        self._run = run
        self._reached: dict[int, Counter[str]] = {}

    def reached(self, seed: int) -> Counter[str]:
        """What the seed's scenario reached; it fails as its checks do."""
        if seed not in self._reached:
            self._reached[seed] = self._run(seed)
        return self._reached[seed]

    def missing(self, seeds: range, paths: Seq[str]) -> list[str]:
        """The paths no seed reached."""
        reached = sum((self.reached(seed) for seed in seeds), Counter())
        return [path for path in paths if not reached[path]]


def pages_kv(pool: PagePool, pages: Seq[int], length: int) -> np.ndarray:
    """The KV of the first ``length`` tokens held in ``pages``: ``[layers, 2, length, heads, dim]``. Read with the
    pool's class method, past a failing read a test installed on the pool."""
    kv = PagePool.read(pool, pages)  # [layers, pages, 2, page_size, heads, dim]
    layers, count, two, page_size, heads, dim = kv.shape
    return kv.transpose(0, 2, 1, 3, 4, 5).reshape(layers, two, count * page_size, heads, dim)[:, :, :length]


class SoloRuns:
    """The oracle: token lists run alone, each in one prefill on a fresh sequence, remembered for one scenario."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._runs: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}

    def _run(self, tokens: Seq[int]) -> tuple[np.ndarray, np.ndarray]:
        key = tuple(tokens)
        if key not in self._runs:
            seq = self.runner.new_sequence()
            rows = self.runner.step([SequenceWork(seq, list(tokens), all_logits=True)])
            self._runs[key] = (rows, pages_kv(self.runner.pages, seq.pages, len(tokens)).copy())
            seq.free()
        return self._runs[key]

    def logits(self, tokens: Seq[int]) -> np.ndarray:
        """``[len(tokens), vocab]``: the logits after each token."""
        return self._run(tokens)[0]

    def kv(self, tokens: Seq[int]) -> np.ndarray:
        """``[layers, 2, len(tokens), heads, dim]``: the KV of each token."""
        return self._run(tokens)[1]


def assert_same_choice(token: int, reference: np.ndarray, what: str) -> None:
    """``token`` is the reference row's argmax, or one MARGIN or less below it."""
    best = int(np.argmax(reference))
    shortfall = float(reference[best] - reference[token])
    assert token == best or shortfall <= MARGIN, f"{what}: token {token}, alone {best} (ahead by {shortfall:.4g})"


def assert_same_logits(got: np.ndarray, reference: np.ndarray, what: str) -> None:
    """The logits equal the reference's within 1e-3 of their scale, and choose the same token."""
    assert got.shape == reference.shape, f"{what}: logits of shape {got.shape}, alone {reference.shape}"
    difference = float(np.max(np.abs(got - reference)))
    scale = max(float(np.max(np.abs(reference))), 1.0)
    assert difference <= 1e-3 * scale, f"{what}: logits differ from alone by {difference:.4g} (scale {scale:.3g})"
    assert_same_choice(int(np.argmax(got)), reference, what)


def assert_nothing_left(core: BatchScheduler) -> None:
    """Every page of both pools is back (held by nobody), and no sequence, pass or delivery is left."""
    pools = [("device", core.runner.pages)] + ([("host", core.host)] if core.host is not None else [])
    for name, pool in pools:
        held = [page for page in range(pool.num_pages) if pool.refcount(page)]
        assert pool.free_count == pool.num_pages and not held, (
            f"{name} pages leaked: {pool.free_count} of {pool.num_pages} free, held {held}"
        )
    assert not core.sequences(), f"sequences left: {core.sequences()}"
    assert not core.has_work() and not core._deliveries, "passes or deliveries left"


class Injected(RuntimeError):
    """A failure the fuzzer injected; its message says where."""


@dataclass(frozen=True)
class FailureOdds:
    """How likely each call is to raise :class:`Injected`."""

    prepare: float = 0.0
    """The runner's prepare, before or after it reserved the batch's slots."""
    forward: float = 0.0
    page_copy: float = 0.0
    """The copy-on-write copy of a shared page, within prepare."""
    after_pass: float = 0.0
    """The engine, after every kernel of the pass ran (its tokens' KV is written)."""
    swap: float = 0.0
    """A device page read (swap out) or write (swap in); half this, a host pool's."""


class FailureInjector:
    """Makes the runner's calls and the page copies raise :class:`Injected` at random, each with its odds, and
    remembers the batch last prepared: a pass that fails must be one of it."""

    def __init__(self, odds: FailureOdds, rng: np.random.Generator, note: Callable[[str], None] = lambda _: None):
        self.odds = odds
        self.rng = rng
        self.note = note
        self.batch: list[SequencePages] = []
        """The page tables of the sequences of the batch last prepared."""

    def install(self, runner: ModelRunner, host: HostPagePool | None) -> None:
        odds = self.odds
        prepare = runner.prepare

        def recording_prepare(work: Seq[SequenceWork]) -> Any:
            self.batch = [item.pages for item in work]
            self._maybe_fail(odds.prepare / 2, "prepare")
            batch = prepare(work)
            self._maybe_fail(odds.prepare / 2, "prepare")  # its slots are reserved by now
            return batch

        runner.prepare = recording_prepare
        runner.forward = self._failing(runner.forward, odds.forward, "forward")
        runner.forward_top = self._failing(runner.forward_top, odds.forward, "forward")
        run = runner.plan.run

        def run_then_fail(*args: Any) -> Any:
            out = run(*args)
            self._maybe_fail(odds.after_pass, "the engine after the pass")
            return out

        runner.plan.run = run_then_fail
        pages = runner.pages
        pages.copy = self._failing(pages.copy, odds.page_copy, "page copy")
        pages.read = self._failing(pages.read, odds.swap, "swap out")
        pages.write = self._failing(pages.write, odds.swap, "swap in")
        if host is not None:
            host.read = self._failing(host.read, odds.swap / 2, "host read")
            host.write = self._failing(host.write, odds.swap / 2, "host write")

    def in_failing_batch(self, seq: Sequence) -> bool:
        return any(seq.device is pages for pages in self.batch)

    def _failing(self, call: Callable[..., Any], odds: float, where: str) -> Callable[..., Any]:
        def call_or_fail(*args: Any) -> Any:
            self._maybe_fail(odds, where)
            return call(*args)

        return call_or_fail

    def _maybe_fail(self, odds: float, where: str) -> None:
        if odds and self.rng.random() < odds:
            self.note(f"inject: {where} raises")
            raise Injected(where)
