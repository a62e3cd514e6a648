"""The engine side of the server: the batch scheduler and every request's generation, on a thread of their own.

A request becomes one scheduler sequence for its prompt, forked once per extra
choice (``n`` > 1: the prompt's pages are shared). Each choice samples, detokenizes
and matches stop strings as its tokens arrive; under an output constraint it masks its
logits first, with a grammar matcher of its own (made before the prompt's pass, so the
first masks are computed while it runs). What the choices produce goes into
an outbox that the scheduler's driver hands to the HTTP side once per step (see
``Scheduler.on_settled``), so the HTTP loop is woken once a step, not once a token.

Admission: at most ``max_running`` requests have sequences at a time; the rest
wait in arrival order. Cancelling a request (a client gone, a drain deadline)
reaches its task between two steps, which withdraws its pending pass and frees
its pages.

Stalls: the engine thread stamps when each step begins, and the HTTP side reads
the stamp: a step that has run past ``stall_seconds`` (a kernel or the device
hangs) makes the engine stalled until it returns (see :meth:`Engine.stalled_for`).
Nothing can end a stuck kernel, so the requests in flight are left to it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pie.generation import NonFiniteLogits, Sampler, SamplingParams, StopMatcher
from pie.generation.constraints import CompiledGrammar, Matcher
from pie.generation.sampling import TopTokens
from pie.inferlet.context import log_softmax
from pie.model.errors import is_rust_panic
from pie.plugins import lost_device
from pie.inferlet.workers import RUNS_PER_WORKER, RunLimits, RunOutcome, WorkerPool, serve_run
from pie.runtime.llm import LLM
from pie.scheduler import BatchScheduler, HostPagePool, Scheduler, SchedulerConfig
from pie.scheduler.core import PassResult, Sequence

log = logging.getLogger("pie.serve")

STALL_SECONDS = 600.0
"""How long one step may run before the engine counts as stalled (``pie serve --stall-seconds``). A step's work is
bounded (``SchedulerConfig.max_batch_tokens`` tokens: a whole prefill chunk), but on a slow device such a step of a
large model (the CPU engine's, with billions of parameters) takes minutes, and the first step of a shape may also
compile its kernels (CUDA on first use, XLA per shape bucket): ten minutes leaves room for both."""
STALL_CHECK_S = 1.0
"""How often (at most) the HTTP loop looks at the current step's age, to log a stall's start and end."""
PROMPT_LOGPROB_CHUNK = 256
"""Prompt tokens whose logits a request that scores its prompt (``echo`` with log-probabilities) holds at once:
[256, vocabulary] floats (50 MB for a vocabulary of 49,152)."""


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate, in tokens: everything the HTTP side checked and tokenized."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    """Tokens that end a choice: the model's end-of-sequence tokens, never shown, and the client's own, shown unless
    special (as vLLM)."""
    top_logprobs: int | None = None
    """None: no log-probabilities; k >= 0: the sampled token's and the k most likely ones', from the model's own
    logits (before logit_bias, the penalties, a grammar's mask and the temperature)."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    """Applied to the model's own logits of every token in the prompt or the output (see :class:`_LogitAdjustments`)."""
    min_tokens: int = 0
    """Until a choice has this many tokens, ``stop_token_ids`` cannot be sampled and stop strings are not looked
    for (vLLM's field); a grammar's own end is not held back."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: CompiledGrammar | None = None
    """The output must follow it: each choice gets its own matcher; the grammar's end is the choice's end."""
    cache_salt: str | None = None
    """The prompt's pages are found in the prefix cache only by requests of the same salt (vLLM's field)."""
    echo: str | None = None
    """The prompt's text, shown before each choice's output (``echo``), with each prompt token's log-probability
    given those before it where ``top_logprobs`` asks for them; None: the output alone. With ``echo``,
    ``max_tokens`` may be 0: the prompt is scored, nothing generated."""


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float | None
    """None for a prompt's first token, which nothing comes before."""
    top: list[tuple[int, float]]


@dataclass
class Delta:
    """New output of one choice: text safe to show (whole characters, no stop string), and its tokens."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob]
    finish_reason: str | None = None
    """"stop" (a stop token or string, or a grammar completed) or "length" (max_tokens or the context, a
    grammar maybe incomplete) on a choice's last delta."""
    echoed: bool = False
    """The prompt, echoed: its tokens are the prompt's, not generated ones."""
    unshown: int = 0
    """Tokens generated but not in ``token_ids``: an end-of-sequence token, which is never shown but counts in the
    completion's tokens (as vLLM and llama.cpp count it)."""

    @property
    def generated(self) -> int:
        """The tokens this delta adds to its choice's completion, as usage counts them."""
        return 0 if self.echoed else len(self.token_ids) + self.unshown


@dataclass
class Done:
    """The request's last event: every choice has finished."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass
class Failed:
    """The request ended with an error (a kernel failure names the kernel)."""

    error: BaseException


class EverythingHeldBack(Exception):
    """``min_tokens`` held back every token a choice could take next: its stop tokens were all the vocabulary, or all
    that the output constraint allowed there. The request's own contradiction, not the model's."""


class NoWorkerReady(Exception):
    """No inferlet worker could be had for a run within its wall-clock limit (every one busy, or none would start):
    the server's want, not the inferlet's fault, and one that may pass."""


@dataclass(frozen=True)
class RunRequest:
    """An inferlet to run in a worker process: its name, its code, its arguments and limits."""

    name: str
    path: str
    """An installed inferlet's file; for uploaded source, the file name it gets in its worker's own folder."""
    args: tuple[str, ...]
    limits: RunLimits
    source: str | None = None
    """Uploaded source, sent to a worker of its own; None for one of the operator's inferlets (whose runs may
    share a warm worker)."""

    @property
    def installed(self) -> bool:
        return self.source is None


@dataclass
class Emitted:
    """A value the inferlet emitted, as the JSON text its worker sent (checked, never parsed again)."""

    value: bytes


@dataclass
class RunEnded:
    """The run's last event: its result, or the error that ended it."""

    outcome: RunOutcome


@dataclass
class RunTokens:
    """Tokens of a run's pass just done, counted as :func:`pie.inferlet.workers.serve_run` says."""

    prompt: int
    generation: int


Event = Delta | Done | Failed | Emitted | RunTokens | RunEnded


Delivery = Callable[[list[Event]], None]
"""Receives a request's events on the HTTP loop, a list per hand-off (one per step)."""


@dataclass(eq=False)
class RequestHandle:
    """One request in the engine, created by :meth:`Engine.submit` on the HTTP side."""

    id: int
    request: GenerationRequest | RunRequest
    deliver: Delivery
    cancelled: bool = False
    task: asyncio.Task[None] | None = field(default=None, repr=False)


Outbox = dict[RequestHandle, list[Event]]


class Engine:
    """The scheduler and the requests' generation, run on a dedicated thread."""

    def __init__(
        self,
        llm: LLM,
        *,
        max_running: int = 64,
        host_pages: int = 0,
        config: SchedulerConfig | None = None,
        inferlet_workers: int = 0,
        sandbox: dict[str, Any] | None = None,
        runs_per_worker: int = RUNS_PER_WORKER,
        on_device_lost: Callable[[BaseException], object] | None = None,
        stall_seconds: float = STALL_SECONDS,
    ):
        """``inferlet_workers`` > 0 keeps that many inferlet worker processes started (sandboxed by
        ``sandbox``, a :class:`pie.inferlet.sandbox.SandboxPolicy` as keywords), each serving up to
        ``runs_per_worker`` runs of one installed inferlet. ``on_device_lost`` is called on the HTTP loop with the
        error of a forward pass that lost the device for good (:class:`pie.plugins.DeviceLost`), whichever request
        or inferlet run the pass was for. A step that has run longer than ``stall_seconds`` stalls the engine."""
        if max_running < 1:
            raise ValueError(f"max_running must be at least 1, not {max_running}")
        self.llm = llm
        self.max_running = max_running
        host = HostPagePool.for_runner(llm.runner, host_pages) if host_pages > 0 else None
        self.pool: WorkerPool | None = None
        if inferlet_workers > 0:
            vocab = llm.runner.config.vocab_size
            self.pool = WorkerPool(llm.tokenizer.to_json(), vocab, inferlet_workers, sandbox, runs_per_worker)
        self.core = _StampedScheduler(llm.runner, host, config)
        self.stall_seconds = stall_seconds
        self._stall_watch: asyncio.TimerHandle | None = None
        self._stalled_step: float | None = None
        """When the step the log last said stalled began; None once the log said it returned."""
        self._on_device_lost = on_device_lost
        self.core.on_failure = self._pass_failed
        self.scheduler = Scheduler(self.core, on_settled=self._flush)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pie-engine", daemon=True)
        self._http_loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count(1)
        self._waiting: deque[RequestHandle] = deque()
        self._running: set[RequestHandle] = set()
        self._runs: set[RequestHandle] = set()
        """Inferlet runs in progress (they wait for no place: the pool's workers bound them)."""
        self._outbox: Outbox = {}
        self._flush_scheduled = False

    # -- the HTTP side -------------------------------------------------------

    def start(self, http_loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread (and the inferlet workers); events go to ``http_loop``. A replica of the runner
        lost between passes (a follower process of a group that died) is reported as a pass that lost it would be."""
        self._http_loop = http_loop
        self._thread.start()
        if self.llm.runner.replicas is not None:
            self.llm.runner.replicas.watch(self._pass_failed)
        if self.pool is not None:
            self._loop.call_soon_threadsafe(self.pool.start)
        self._watch_stalls()

    def submit_run(self, request: RunRequest, deliver: Delivery) -> RequestHandle:
        """Start an inferlet run (from the HTTP loop); ``deliver`` gets what it emits, then how it ended."""
        if self.pool is None:
            raise RuntimeError("this engine runs no inferlet workers")
        handle = RequestHandle(next(self._ids), request, deliver)
        self._loop.call_soon_threadsafe(self._start_run, handle)
        return handle

    def submit(self, request: GenerationRequest, deliver: Delivery) -> RequestHandle:
        """Queue a request (from the HTTP loop); ``deliver`` gets its events there, a list per step."""
        handle = RequestHandle(next(self._ids), request, deliver)
        self._loop.call_soon_threadsafe(self._enqueue, handle)
        return handle

    def cancel(self, handle: RequestHandle) -> None:
        """Stop a request (from any thread): its pass is withdrawn and its pages freed before the next step."""
        if not handle.cancelled:
            handle.cancelled = True
            self._loop.call_soon_threadsafe(self._cancel, handle)

    @property
    def running_count(self) -> int:
        return len(self._running)

    @property
    def waiting_count(self) -> int:
        return len(self._waiting)

    @property
    def run_count(self) -> int:
        return len(self._runs)

    def step_seconds(self) -> float:
        """How long the current step has run; 0 between steps. Read on any thread, without a lock: the engine thread
        writes the step's start as one float. (A kernel that hangs holding the GIL stops the HTTP loop too: then
        nothing answers at all.)"""
        began = self.core.step_began
        return 0.0 if began is None else time.monotonic() - began

    def stalled_for(self) -> float | None:
        """How long the current step has run, where that is longer than ``stall_seconds``; None otherwise."""
        seconds = self.step_seconds()
        return seconds if seconds > self.stall_seconds else None

    def _watch_stalls(self) -> None:
        """On the HTTP loop, every STALL_CHECK_S: log a stall once as it is found, and once as its step returns."""
        began = self.core.step_began  # (read once: the engine thread may end the step meanwhile)
        now = time.monotonic()
        if began is not None and now - began > self.stall_seconds:
            if began != self._stalled_step:
                self._stalled_step = began
                log.warning("pie serve: %s; /health answers 503 and new requests are refused until it returns",
                            stall_words(now - began, self.stall_seconds))
        elif self._stalled_step is not None:
            log.warning("pie serve: the engine's stalled step returned, about %.0f s after it began; serving again",
                        now - self._stalled_step)
            self._stalled_step = None
        assert self._http_loop is not None
        self._stall_watch = self._http_loop.call_later(min(STALL_CHECK_S, self.stall_seconds / 2), self._watch_stalls)

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel everything and stop the engine thread."""
        if self._stall_watch is not None:
            self._stall_watch.cancel()
        if self.llm.runner.replicas is not None:
            self.llm.runner.replicas.watch(None)
        if not self._thread.is_alive():
            return

        async def shut_down() -> None:
            for handle in [*self._waiting, *self._running, *self._runs]:
                self._cancel(handle)
            if self.pool is not None:
                await self.pool.close()
            await asyncio.sleep(0.05)
            self._loop.stop()

        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(shut_down()))
        self._thread.join(timeout)

    # -- the engine thread ---------------------------------------------------

    def _pass_failed(self, error: BaseException) -> None:
        if self._on_device_lost is not None and self._http_loop is not None and lost_device(error):
            self._http_loop.call_soon_threadsafe(self._on_device_lost, error)

    def _start_run(self, handle: RequestHandle) -> None:
        if not handle.cancelled:
            self._runs.add(handle)
            handle.task = self._loop.create_task(self._run_inferlet(handle))
            handle.task.add_done_callback(lambda _, handle=handle: self._ran(handle))

    def _ran(self, handle: RequestHandle) -> None:
        """A run's task is done: cancelled before it began too (a ``finally`` of its own would not run then)."""
        self._runs.discard(handle)
        self._schedule_flush()

    async def _run_inferlet(self, handle: RequestHandle) -> None:
        request = handle.request
        assert isinstance(request, RunRequest) and self.pool is not None
        pool = self.pool

        def emitted(value: bytes) -> None:
            self._emit(handle, Emitted(value))
            self._schedule_flush()

        def forwarded(prompt: int, generation: int) -> None:
            self._emit(handle, RunTokens(prompt, generation))  # handed on with the step's other events

        try:
            try:
                worker = await asyncio.wait_for(pool.take(request.path if request.installed else None),
                                                request.limits.wall_seconds)
            except TimeoutError:
                why = f"; the last worker {pool.failures[-1]}" if pool.failures else ""
                self._emit(handle, Failed(NoWorkerReady(
                    f"no inferlet worker was ready within {request.limits.wall_seconds:g} s{why}")))
                return
            try:
                if handle.cancelled:  # before Python 3.12, wait_for keeps the worker if a cancel lands as it comes
                    raise asyncio.CancelledError
                outcome = await serve_run(self.scheduler, worker, request.name, request.path, list(request.args),
                                          request.limits, emitted, source=request.source, on_tokens=forwarded)
            finally:
                await pool.give_back(worker)
            self._emit(handle, RunEnded(outcome))
        except asyncio.CancelledError:
            pass  # cancelled by the HTTP side, which no longer listens; serve_run has cleaned up
        except Exception as exc:  # a fault of the host's: the client still gets an end, never silence
            log.exception("inferlet run %s failed in the server", request.name)
            failure = f"the run failed in the server: {type(exc).__name__}: {exc}"
            self._emit(handle, RunEnded(RunOutcome(error=failure)))

    def _enqueue(self, handle: RequestHandle) -> None:
        if handle.cancelled:
            return
        self._waiting.append(handle)
        self._admit()

    def _cancel(self, handle: RequestHandle) -> None:
        handle.cancelled = True
        if handle in self._waiting:
            self._waiting.remove(handle)
        elif handle.task is not None:
            handle.task.cancel()

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_running:
            handle = self._waiting.popleft()
            self._running.add(handle)
            handle.task = self._loop.create_task(self._serve(handle))
            handle.task.add_done_callback(lambda _, handle=handle: self._served(handle))

    def _served(self, handle: RequestHandle) -> None:
        """A request's task is done, cancelled before it began too: a cancel that landed as it was admitted (its
        client left while it waited) once kept its running slot for good, as ``_serve`` never ran to release it."""
        self._running.discard(handle)
        self._admit()
        self._schedule_flush()

    async def _serve(self, handle: RequestHandle) -> None:
        try:
            await self._generate(handle)
        except asyncio.CancelledError:
            pass  # the HTTP side asked for it and no longer listens
        except BaseException as exc:
            if not (isinstance(exc, Exception) or is_rust_panic(exc)):  # (a Rust library's panic: the tokenizer's)
                raise
            self._emit(handle, Failed(exc))

    async def _generate(self, handle: RequestHandle) -> None:
        request = handle.request
        assert isinstance(request, GenerationRequest)
        core = self.core
        root = self.scheduler.new_sequence(cache_salt=request.cache_salt)
        sequences = [root]
        # Each choice's own matcher, made now: the first masks are computed while the prompt's pass runs.
        constraints = [request.grammar.matcher() if request.grammar is not None else None for _ in range(request.n)]
        try:
            if request.echo is None:
                logits = await self.scheduler.forward(root, request.prompt_ids)
            else:
                logits = await self._echo(handle, root)
            assert logits is not None
            cached = root.cached_tokens
            if request.max_tokens == 0:  # the prompt scored, nothing to generate
                for index in range(request.n):
                    self._emit(handle, Delta(index, "", [], [], "length"))
                counts = [0]
            else:
                sequences += [core.fork(root) for _ in range(request.n - 1)]
                counts = await _all_or_none([
                    self._choice(handle, index, seq, logits, constraint)
                    for index, (seq, constraint) in enumerate(zip(sequences, constraints, strict=True))
                ])
        finally:
            for seq in sequences:
                core.drop(seq)
        self._emit(handle, Done(len(request.prompt_ids), cached, sum(counts)))

    async def _echo(self, handle: RequestHandle, root: Sequence) -> PassResult:
        """The prompt's pass for a request that echoes its prompt: each choice starts with the prompt's text, and with
        its tokens' log-probabilities where the request asks for them. Those need the logits after every prompt
        token, so that pass runs PROMPT_LOGPROB_CHUNK tokens at a time (a whole prompt's would be [prompt, vocabulary]
        floats at once), never from the prefix cache; the logits after its last token are returned."""
        request = handle.request
        assert isinstance(request, GenerationRequest) and request.echo is not None
        ids, top = request.prompt_ids, request.top_logprobs
        scored: list[TokenLogprob] = []
        if top is None:
            logits = await self.scheduler.forward(root, ids)
        else:
            scored.append(TokenLogprob(ids[0], None, []))
            for start in range(0, len(ids), PROMPT_LOGPROB_CHUNK):
                rows = await self.scheduler.forward(root, ids[start : start + PROMPT_LOGPROB_CHUNK], all_logits=True)
                assert isinstance(rows, np.ndarray)
                following = ids[start + 1 : start + 1 + len(rows)]  # one fewer than the rows in the last chunk
                scored += [_logprob(row, token, top) for row, token in zip(rows, following)]
                logits = np.array(rows[-1])  # a copy: the chunk's rows go
        for index in range(request.n):
            self._emit(handle, Delta(index, request.echo, list(ids), scored, echoed=True))
        return logits

    async def _choice(
        self, handle: RequestHandle, index: int, seq: Sequence, logits: np.ndarray | TopTokens, constraint: Matcher | None
    ) -> int:
        """Generate one choice to its end (under ``constraint``, its grammar's end); returns how many tokens it
        produced. Its sequence is dropped as it ends, before the next step: a finished sequence that still held
        its pages would be the first one a preemption copies out to the host."""
        try:
            return await self._tokens_of_choice(handle, index, seq, logits, constraint)
        finally:
            self.core.drop(seq)

    async def _tokens_of_choice(
        self, handle: RequestHandle, index: int, seq: Sequence, logits: np.ndarray | TopTokens, constraint: Matcher | None
    ) -> int:
        request = handle.request
        assert isinstance(request, GenerationRequest)
        params = request.sampling
        if params.seed is not None and index:
            params = SamplingParams(params.temperature, params.top_k, params.top_p, params.min_p, params.seed + index)
        sampler = Sampler(params)
        decoder = self.llm.tokenizer.stream_decoder()
        matcher = StopMatcher(() if request.min_tokens else request.stop)  # the stop strings from min_tokens on
        grammar_ends = constraint.end_token_ids if constraint is not None else frozenset()
        adjust = _LogitAdjustments(request, held_back=request.stop_token_ids - grammar_ends)
        ends = request.stop_token_ids | grammar_ends
        # vLLM shows a stop token of the request's own unless it is special (the decoder skips those).
        shown_ends = request.stop_token_ids - frozenset(self.llm.tokenizer.eos_token_ids)
        # Where nothing but the sampler reads a step's logits, the device picks the candidates it needs.
        whole_row = constraint is not None or adjust.active or request.top_logprobs is not None
        top = 0 if whole_row else sampler.top_tokens_needed(logits.shape[-1])
        produced = 0
        while True:
            raw = logits  # what log-probabilities report: the model's own row, before bias, penalties and grammar
            if isinstance(logits, np.ndarray):
                logits = adjust(logits, produced)
                if constraint is not None:
                    logits = constraint.mask(logits)
            try:
                token = sampler.sample(logits)
            except NonFiniteLogits:
                if produced < request.min_tokens and _samplable(adjust(raw, request.min_tokens), constraint):
                    allowed = "the output constraint allowed" if constraint else "of the vocabulary"
                    raise EverythingHeldBack(
                        f"min_tokens ({request.min_tokens}) holds back the stop tokens (stop_token_ids and the model's "
                        f"end-of-sequence tokens) until a choice has that many, and after {produced} token(s) they "
                        f"were every token {allowed}: ask for fewer min_tokens, or name fewer stop_token_ids"
                    ) from None
                raise
            if token in ends:  # under a grammar, only where the grammar may end
                shown = token in shown_ends
                text = matcher.push(decoder.push(token)) if shown else ""
                logprobs = [_logprob(raw, token, request.top_logprobs)] if shown and request.top_logprobs is not None else []
                tail = matcher.push(decoder.flush()) + matcher.flush()
                self._emit(handle, Delta(index, text + tail, [token] if shown else [], logprobs, "stop",
                                         unshown=0 if shown else 1))
                return produced + 1  # shown or not, generated: counted, as vLLM and llama.cpp count it
            produced += 1
            adjust.saw(token)
            if produced == request.min_tokens:
                matcher = StopMatcher(request.stop)
            if constraint is not None:
                constraint.accept(token)
            logprobs = []
            if request.top_logprobs is not None:
                assert isinstance(raw, np.ndarray)  # whole rows, asked for above
                logprobs = [_logprob(raw, token, request.top_logprobs)]
            text = matcher.push(decoder.push(token))
            if matcher.stopped:
                self._emit(handle, Delta(index, text, [token], logprobs, "stop"))
                return produced
            if constraint is not None and constraint.is_finished:  # complete, and nothing may follow
                tail = matcher.push(decoder.flush()) + matcher.flush()
                self._emit(handle, Delta(index, text + tail, [token], logprobs, "stop"))
                return produced
            if produced == request.max_tokens:
                tail = matcher.push(decoder.flush()) + matcher.flush()
                self._emit(handle, Delta(index, text + tail, [token], logprobs, "stop" if matcher.stopped else "length"))
                return produced
            self._emit(handle, Delta(index, text, [token], logprobs))
            next_logits = await self.scheduler.forward(seq, [token], top=top)
            assert next_logits is not None
            logits = next_logits

    def _emit(self, handle: RequestHandle, event: Event) -> None:
        self._outbox.setdefault(handle, []).append(event)

    def _schedule_flush(self) -> None:
        """Hand events on soon even if no step follows (a request that failed or finished last)."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        """Hand every event produced since the last flush to the HTTP loop, in one call."""
        self._flush_scheduled = False
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, {}
        assert self._http_loop is not None
        self._http_loop.call_soon_threadsafe(_deliver, outbox)


def stall_words(seconds: float, bound: float) -> str:
    """A stall in words: for /health, the refusal of new requests and the log."""
    return f"the engine's step has run for {seconds:.1f} s (bound --stall-seconds {bound:g}): a kernel or the device hangs"


class _StampedScheduler(BatchScheduler):
    """The batch scheduler, stamping when its current step began (by ``time.monotonic``; None between steps): what
    :meth:`Engine.stalled_for` reads from the HTTP side."""

    step_began: float | None = None

    def step(self) -> bool:
        self.step_began = time.monotonic()
        try:
            return super().step()
        finally:
            self.step_began = None


async def _all_or_none(choices: list[Coroutine[None, None, int]]) -> list[int]:
    """Run the choices together; when one fails, stop the others and raise its error."""
    tasks = [asyncio.ensure_future(choice) for choice in choices]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            error = task.exception()
            if error is not None:
                raise error
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _deliver(outbox: Outbox) -> None:
    """On the HTTP loop: each request's events to its receiver."""
    for handle, events in outbox.items():
        if not handle.cancelled:
            handle.deliver(events)


LARGEST_LOGIT = np.finfo(np.float32).max
"""Where a positive logit divided by a repetition penalty near 0 stops: float32's largest number. Past it the logit
would be +inf, from which the sampler can choose no token (the request failed with a 500)."""


class _LogitAdjustments:
    """What one choice does to the model's logits before sampling, in this order: the repetition penalty (vLLM's and
    transformers' definition), ``logit_bias`` and the presence and frequency penalties (OpenAI's definitions), and,
    while the choice is shorter than ``min_tokens``, its stop tokens masked out."""

    def __init__(self, request: GenerationRequest, held_back: frozenset[int]):
        self._bias: tuple[np.ndarray, np.ndarray] | None = None
        if request.logit_bias:
            ids, values = zip(*request.logit_bias, strict=True)
            self._bias = (np.array(ids, np.int64), np.array(values, np.float32))
        self._presence = np.float32(request.presence_penalty)
        self._frequency = np.float32(request.frequency_penalty)
        self._counts: dict[int, int] = {}
        self._repetition = np.float32(request.repetition_penalty)
        self._repeated: set[int] = set(request.prompt_ids) if self._repetition != 1 else set()
        self._repeated_ids = np.fromiter(self._repeated, np.int64, len(self._repeated))
        self._min_tokens = request.min_tokens
        self._held_back = np.fromiter(held_back, np.int64, len(held_back))
        self.active = (self._bias is not None or bool(self._presence) or bool(self._frequency)
                       or self._repetition != 1 or (self._min_tokens > 0 and self._held_back.size > 0))

    def saw(self, token: int) -> None:
        if self._presence or self._frequency:
            self._counts[token] = self._counts.get(token, 0) + 1
        if self._repetition != 1 and token not in self._repeated:
            self._repeated.add(token)
            self._repeated_ids = np.append(self._repeated_ids, token)

    def __call__(self, logits: np.ndarray, produced: int) -> np.ndarray:
        if not self.active:
            return logits
        logits = logits.astype(np.float32, copy=True)
        if self._repeated_ids.size:
            seen = logits[self._repeated_ids]
            with np.errstate(divide="ignore", over="ignore", invalid="ignore"):  # a penalty of 1e-300 is 0 in float32
                raised = seen / self._repetition
            raised[np.isinf(raised) & np.isfinite(seen)] = LARGEST_LOGIT  # a model's own +inf is left to the sampler
            logits[self._repeated_ids] = np.where(seen > 0, raised, seen * self._repetition)
        if self._bias is not None:
            logits[self._bias[0]] += self._bias[1]
        if self._counts:
            ids = np.fromiter(self._counts, np.int64, len(self._counts))
            counts = np.fromiter(self._counts.values(), np.float32, len(self._counts))
            logits[ids] -= self._frequency * counts + self._presence
        if produced < self._min_tokens:
            logits[self._held_back] = -np.inf
        return logits


def _samplable(logits: np.ndarray | TopTokens, constraint: Matcher | None) -> bool:
    """Whether a token could be chosen from ``logits`` (a whole row) under ``constraint``'s mask."""
    if not isinstance(logits, np.ndarray):
        return False
    row = constraint.mask(logits) if constraint is not None else logits
    return bool(np.isfinite(row.max()))


def _logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """The log-softmax of the model's row for ``token`` and the ``top`` most likely tokens: before logit_bias, the
    penalties and the temperature, as vLLM's raw log-probabilities are, and before a grammar's mask too."""
    row = log_softmax(logits)
    best: list[tuple[int, float]] = []
    if top:
        ids = np.argpartition(-row, top - 1)[:top] if top < row.size else np.arange(row.size)
        # A token whose logit is -inf is never listed (JSON has no -inf).
        best = sorted(((int(i), float(row[i])) for i in ids if np.isfinite(row[i])), key=lambda pair: -pair[1])
    return TokenLogprob(token, float(row[token]), best)

