"""A context: one KV-cached token sequence that an inferlet fills, generates from, forks and drops.

Filled tokens are held until the next operation that needs logits, so a fill
followed by a generate costs one forward pass. Every forward pass goes through
the shared batch scheduler, batched with those of every other context.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Mapping
from collections.abc import Sequence as Seq
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import numpy as np

from pie.generation import Sampler, SamplingParams, StopMatcher
from pie.generation.constraints import Matcher, OutputIncomplete
from pie.scheduler.core import PassResult, PastContext, Sequence

if TYPE_CHECKING:
    from pie.inferlet.session import Session

LogitProcessor = Callable[[np.ndarray, Seq[int]], np.ndarray]
"""Custom logit processing: ``(next-token logits, the context's tokens) -> new logits``."""


class ContextError(RuntimeError):
    """A context was used in a way it cannot be (dropped, busy, empty)."""


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


class Context:
    """A token sequence with its KV cache. Use one operation at a time per context."""

    def __init__(self, session: Session, seq: Sequence, pending: Seq[int] = (), logits: np.ndarray | None = None):
        self._session = session
        self._seq = seq
        self._pending: list[int] = list(pending)
        self._logits = logits
        self._busy = False

    def __repr__(self) -> str:
        return f"<Context {self._seq.id}: {len(self.tokens)} tokens>"

    # -- state ---------------------------------------------------------------

    @property
    def tokens(self) -> list[int]:
        """Every token of the context, those not yet forwarded included."""
        return self._seq.history + self._pending

    @property
    def text(self) -> str:
        return self._session.detokenize(self.tokens)

    @property
    def dropped(self) -> bool:
        return self._seq.dropped

    def kv_pages(self) -> list[int]:
        """Device KV pages holding this context now (empty while swapped out): to observe sharing."""
        return list(self._seq.device.pages) if self._seq.device is not None else []

    # -- filling -------------------------------------------------------------

    def fill(self, text: str | None = None, *, tokens: Seq[int] | None = None) -> Context:
        """Append text (encoded without special tokens) or token ids; computed lazily."""
        self._check_usable()
        if text is not None and tokens is None:
            new = self._session.tokenize(text, special=False)
        elif tokens is not None and text is None:
            new = self._token_ids(tokens)
        else:
            raise ValueError("fill takes text or tokens, not both")
        if new:
            self._pending.extend(new)
            self._logits = None
        return self

    async def _forward(self, tokens: list[int], all_logits: bool = False) -> PassResult:
        try:
            return await self._session.scheduler.forward(self._seq, tokens, all_logits=all_logits)
        except PastContext as exc:
            raise ContextError(str(exc)) from None

    async def flush(self) -> None:
        """Forward the filled tokens now (keeping the next-token logits)."""
        with self._operation():
            await self._flush()

    async def _flush(self) -> None:
        if not self._pending:
            return
        tokens, self._pending = self._pending, []
        try:
            self._logits = await self._forward(tokens)
        except BaseException:
            self._pending = tokens + self._pending
            raise

    # -- the next token ------------------------------------------------------

    async def next_logits(self) -> np.ndarray:
        """Logits of the next token given everything in the context (float32 ``[vocab]``)."""
        with self._operation():
            return await self._next_logits()

    async def _next_logits(self) -> np.ndarray:
        await self._flush()
        if self._logits is None:
            raise ContextError("the context is empty: fill it before asking for the next token")
        return self._logits

    async def next_distribution(
        self, sampling: SamplingParams | None = None, processors: Seq[LogitProcessor] = ()
    ) -> np.ndarray:
        """The next-token probabilities after ``processors`` and ``sampling``'s filters (float64)."""
        with self._operation():
            logits = self._process(await self._next_logits(), processors)
        return Sampler(sampling or SamplingParams(temperature=1.0)).probabilities(logits)

    async def step(
        self,
        sampler: Sampler | SamplingParams | None = None,
        processors: Seq[LogitProcessor] = (),
        *,
        constraint: Matcher | None = None,
    ) -> int:
        """Pick the next token (greedy by default), append it and return it. With a ``constraint`` (a
        matcher from ``ctx.matcher(...)``), only a token it allows is picked, and the matcher advances past it."""
        if sampler is not None and not isinstance(sampler, (Sampler, SamplingParams)):
            raise TypeError(f"step takes a Sampler, a SamplingParams or None (greedy), not {type(sampler).__name__} "
                            f"{sampler!r}")
        if not isinstance(sampler, Sampler):
            sampler = Sampler(sampler)
        with self._operation():
            return await self._step(sampler, processors, constraint)

    async def _step(self, sampler: Sampler, processors: Seq[LogitProcessor], constraint: Matcher | None = None) -> int:
        logits = self._process(await self._next_logits(), processors)
        if constraint is not None:
            logits = constraint.mask(logits)
        token = sampler.sample(logits)
        if constraint is not None:
            constraint.accept(token)
        self._pending.append(token)
        self._logits = None
        return token

    def _process(self, logits: np.ndarray, processors: Seq[LogitProcessor]) -> np.ndarray:
        for processor in processors:
            processed = np.asarray(processor(logits, self.tokens), dtype=np.float32)
            if processed.shape != logits.shape:  # else a token would be drawn from part of the vocabulary, or none
                raise ValueError(f"a logit processor returned logits of shape {processed.shape}, not {logits.shape}")
            logits = processed
        return logits

    # -- generation ----------------------------------------------------------

    async def generate_tokens(
        self,
        max_tokens: int,
        *,
        sampling: SamplingParams | None = None,
        stop_token_ids: Seq[int] | None = None,
        processors: Seq[LogitProcessor] = (),
        json_schema: Mapping[str, Any] | bool | str | None = None,
        regex: str | None = None,
        grammar: str | None = None,
        constraint: Matcher | None = None,
    ) -> list[int]:
        """Generate up to ``max_tokens`` tokens (greedy by default). A stop token (default: the
        model's end-of-sequence tokens) ends generation: it stays in the context but is not returned.

        Constrained output, at most one of: ``json_schema``, ``regex``, ``grammar`` (as for :meth:`generate`)
        or a ``constraint`` of your own (a matcher, left where the output ended).
        """
        max_tokens = _count("max_tokens", max_tokens)
        stops = set(self._session.eos_token_ids if stop_token_ids is None else stop_token_ids)
        constraint = self._constraint(json_schema, regex, grammar, constraint)
        if constraint is not None:
            stops |= constraint.end_token_ids
        sampler = Sampler(sampling)
        out: list[int] = []
        with self._operation():
            while len(out) < max_tokens:
                token = await self._step(sampler, processors, constraint)
                if token in stops:
                    break
                out.append(token)
                if constraint is not None and constraint.is_finished:
                    break
        if constraint is not None and not constraint.is_accepting:
            raise OutputIncomplete(self._session.detokenize(out), out, max_tokens)
        return out

    async def generate(
        self,
        max_tokens: int,
        *,
        sampling: SamplingParams | None = None,
        stop: Seq[str] = (),
        stop_token_ids: Seq[int] | None = None,
        processors: Seq[LogitProcessor] = (),
        json_schema: Mapping[str, Any] | bool | str | None = None,
        regex: str | None = None,
        grammar: str | None = None,
        constraint: Matcher | None = None,
    ) -> str:
        """Generate text; stops at a stop token or stop string (neither is returned).

        Constrained output, at most one of: ``json_schema`` (a JSON schema as a dict, or as JSON text),
        ``regex`` (matched by the whole output), ``grammar`` (Lark or GBNF), or a ``constraint`` of your own
        from ``ctx.matcher(...)``. Generation then ends where the grammar is complete; when ``max_tokens``
        comes first, :class:`OutputIncomplete` is raised (with the text so far), never an incomplete text
        returned as if whole. A stop string still ends it where it occurs.
        """
        max_tokens = _count("max_tokens", max_tokens)
        stops = set(self._session.eos_token_ids if stop_token_ids is None else stop_token_ids)
        constraint = self._constraint(json_schema, regex, grammar, constraint)
        if constraint is not None:
            stops |= constraint.end_token_ids
        sampler = Sampler(sampling)
        decoder = self._session.tokenizer.stream_decoder()
        matcher = StopMatcher(stop)
        pieces: list[str] = []
        tokens: list[int] = []
        with self._operation():
            for _ in range(max_tokens):
                token = await self._step(sampler, processors, constraint)
                if token in stops:
                    break
                tokens.append(token)
                pieces.append(matcher.push(decoder.push(token)))
                if matcher.stopped:
                    return "".join(pieces)
                if constraint is not None and constraint.is_finished:
                    break
        pieces.append(matcher.push(decoder.flush()) + matcher.flush())
        if constraint is not None and not constraint.is_accepting:
            raise OutputIncomplete("".join(pieces), tokens, max_tokens)
        return "".join(pieces)

    def _constraint(
        self, json_schema: Any, regex: str | None, grammar: str | None, constraint: Matcher | None
    ) -> Matcher | None:
        given = [name for name, value in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar),
                                          ("constraint", constraint)) if value is not None]
        if len(given) > 1:
            raise ValueError(f"give one output constraint, not {' and '.join(given)}")
        if constraint is not None:
            if not isinstance(constraint, Matcher):
                raise TypeError(f"constraint is a matcher from ctx.matcher(...), not {type(constraint).__name__}")
            return constraint
        if not given:
            return None
        return self._session.matcher(json_schema=json_schema, regex=regex, grammar=grammar)

    async def logprobs(self, tokens: Seq[int]) -> np.ndarray:
        """Append ``tokens`` and return the log-probability of each given everything before it."""
        tokens = self._token_ids(tokens)
        if not tokens:
            return np.zeros(0)
        with self._operation():
            first = log_softmax(await self._next_logits())[tokens[0]]
            rows = await self._forward(tokens, all_logits=True)
        assert rows is not None
        self._logits = rows[-1]
        rest = log_softmax(rows[:-1])[np.arange(len(tokens) - 1), tokens[1:]]
        return np.concatenate([[first], rest])

    # -- lifetime ------------------------------------------------------------

    def fork(self) -> Context:
        """A new context with the same tokens, sharing this one's KV pages (copy-on-write).

        Flush first (``await ctx.flush()``) so the children share the filled tokens' pages too;
        tokens still pending are copied and computed by each child on its own.
        """
        self._check_usable()
        if self._busy:
            raise ContextError("cannot fork a context while an operation on it is running")
        child_seq = self._session.scheduler.core.fork(self._seq)
        return self._session._adopt(Context(self._session, child_seq, self._pending, self._logits))

    def drop(self) -> None:
        """Release the KV pages now (also done for every context when the inferlet ends)."""
        self._session.scheduler.core.drop(self._seq)
        self._session._forget(self)

    # -- helpers -------------------------------------------------------------

    def _token_ids(self, tokens: Seq[int]) -> list[int]:
        return self._session.token_ids(tokens)

    def _check_usable(self) -> None:
        if self._seq.dropped:
            raise ContextError("the context was dropped")

    @contextmanager
    def _operation(self) -> Iterator[None]:
        self._check_usable()
        if self._busy:
            raise ContextError("another operation on this context is still running; await it first")
        self._busy = True
        try:
            yield
        finally:
            self._busy = False


def _count(name: str, value: int) -> int:
    """``value`` as an int of at least 0; TypeError or ValueError naming ``name`` otherwise."""
    try:
        count = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} is a whole number, got {value!r}") from None
    if count < 0:
        raise ValueError(f"{name} must be at least 0, not {count}")
    return count
