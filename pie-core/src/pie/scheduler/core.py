"""Iteration-level (continuous) batching over one ModelRunner.

A *pass* asks for tokens to be appended to a sequence's KV cache and, usually,
for the logits after its last token. Every step gathers work from all live
sequences in rank order (higher priority first, then earlier arrival): the one
token of a decoding sequence or a chunk of a longer pass (chunked prefill),
within a token budget and the free KV pages, and runs it all as ONE ragged
forward pass. Each finished pass gets its logits through its callback, or only the most likely
tokens of its last one when it asked for those (``top``) and every pass of the step did: those are
read on the device, and a step where any pass needs logits reads logits for all (see ``_top_of``).

When pages run out, sequences ranked below the one that needs them (and idle
sequences) are preempted: their pages go to the host page pool, or, when that
is full, are dropped and recomputed later from the sequence's token history.
Nothing is preempted where preempting every candidate would still not make room.
A sequence without KV (new, or preempted to recompute) whose whole pass would not fit
beside the pages of the better-ranked sequences waits, rather than take the part of it
that the free pages hold: that part would be preempted as they grow, again and again.
No pass is ever dropped. A pass that could not fit even alone in the whole pool
fails with :class:`RequestTooLarge`; the others go on.

With prefix caching on, every full page a pass computes is published under the
hash chain of its tokens (see :mod:`pie.runtime.kv_cache`), and a sequence that
starts (or restarts after a recompute-preemption) takes the longest run of
published pages that matches its tokens instead of computing them again.
"""

from __future__ import annotations

import itertools
import logging
from collections import Counter, deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np

from pie.generation.sampling import TopTokens
from pie.runtime.kv_cache import SequencePages, cache_root, chain_keys
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.scheduler.offload import HostPagePool

log = logging.getLogger("pie.scheduler")

PassResult = np.ndarray | TopTokens | None
PassCallback = Callable[[PassResult, BaseException | None], None]
"""Called once per pass: (logits, TopTokens or None; None) on success, (None, error) on failure."""


class SchedulerError(RuntimeError):
    """A pass could not be served."""


class RequestTooLarge(SchedulerError):
    """A sequence would need more KV pages than the whole pool has."""

    def __init__(self, tokens: int, pages: int, pool_pages: int, page_size: int):
        super().__init__(
            f"a sequence of {tokens} tokens needs {pages} KV pages of {page_size} tokens, "
            f"but the whole pool has {pool_pages} pages ({pool_pages * page_size} tokens): it can never fit"
        )
        self.tokens = tokens
        self.pages = pages
        self.pool_pages = pool_pages


class PastContext(ValueError):
    """A pass would take its sequence past the model's context (positions it has no embedding for)."""


class SequenceDropped(SchedulerError):
    """The sequence was dropped while a pass was waiting on it."""


@dataclass
class SchedulerConfig:
    max_batch_tokens: int = 512
    """Most tokens in one forward pass (decode tokens plus prefill chunks)."""
    max_batch_sequences: int = 256
    prefill_chunk: int = 512
    """Most tokens of one sequence per step, so long prompts never stall decodes."""
    short_prefill_tokens: int = 128
    """A prefill of at most this many tokens is short: while one waits, a longer prefill takes at most this many
    tokens a step, so a short prompt's first token waits a step for a long prompt, not its whole prefill. Prefills
    that are all long (a burst of long prompts) keep whole chunks, first come first served. 0: no prefill is short."""
    prefix_caching: bool = True
    """Publish computed full pages and start sequences from the published pages that match their tokens."""

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_batch_sequences", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.short_prefill_tokens < 0:
            raise ValueError("short_prefill_tokens must be at least 0")


@dataclass
class SchedulerStats:
    steps: int = 0
    forwarded_tokens: int = 0
    recomputed_tokens: int = 0
    preemptions: int = 0
    swap_outs: int = 0
    swap_ins: int = 0
    recomputes: int = 0
    """Preemptions that dropped pages (host pool full or absent, or a swap that failed) to recompute them later."""
    swap_failures: int = 0
    """Copies between the device and host pools that raised; each such sequence was recomputed instead."""
    pages_swapped_out: int = 0
    pages_swapped_in: int = 0
    too_large: int = 0
    largest_batch: int = 0
    prefix_queried_tokens: int = 0
    """Tokens of first passes looked up in the prefix cache."""
    prefix_cached_tokens: int = 0
    """Of those, tokens whose KV came from published pages instead of being computed."""
    replay_cached_tokens: int = 0
    """Tokens of a recompute-preempted sequence's history whose pages were still cached."""


@dataclass(eq=False)
class Pass:
    tokens: list[int]
    logits: bool
    all_logits: bool
    on_done: PassCallback
    top: int = 0
    """Most likely tokens of the last row that will do instead of its logits (0: the logits)."""
    done: int = 0
    base: int | None = None
    """History length when the first chunk ran (to roll a failed or cancelled pass back)."""
    queried: bool = False
    """Whether its tokens were counted in ``prefix_queried_tokens`` (a first pass is looked up each step it waits)."""
    rows: list[np.ndarray] = field(default_factory=list)


class Sequence:
    """One sequence as the scheduler sees it: where its KV lives, its history, its queued passes.

    ``history`` lists every token whose KV exists or must exist. The KV of its
    first ``kv_length`` tokens is in ``device`` pages, or in ``host`` pages when
    swapped out; tokens past that (after a recompute-preemption) are replayed
    before the next pass.
    """

    def __init__(self, sid: int, priority: int, arrival: int, device: SequencePages | None):
        self.id = sid
        self.priority = priority
        self.arrival = arrival
        self.device = device
        self.host: SequencePages | None = None
        self.history: list[int] = []
        self.queue: deque[Pass] = deque()
        self.dropped = False
        self.page_keys: list[bytes] = []
        """Content keys of the full pages of ``history`` known so far (see ``chain_keys``)."""
        self.cache_root = b""
        """The key its first page's key chains from: a salt's (:func:`cache_root`), or none. Sequences find each
        other's pages in the prefix cache only where their roots agree."""
        self.published = 0
        """How many of the current device table's first pages were offered for publishing."""
        self.cached_tokens = 0
        """Tokens of its first pass that came from the prefix cache."""

    def __repr__(self) -> str:
        return f"<Sequence {self.id} {self.residence} kv={self.kv_length}/{len(self.history)} queued={len(self.queue)}>"

    @property
    def residence(self) -> str:
        if self.device is not None:
            return "device"
        return "host" if self.host is not None else "none"

    @property
    def kv_length(self) -> int:
        if self.device is not None:
            return self.device.length
        return self.host.length if self.host is not None else 0

    @property
    def replay(self) -> int:
        return len(self.history) - self.kv_length

    def rank(self) -> tuple[int, int, int]:
        return (-self.priority, self.arrival, self.id)

    def next_chunk_limit(self) -> int:
        """Most tokens the next work item of this sequence could take."""
        if self.replay:
            return self.replay
        head = self.queue[0]
        return len(head.tokens) - head.done

    def final_length(self) -> int:
        """KV length once the head pass completes."""
        head = self.queue[0]
        return len(self.history) + len(head.tokens) - head.done


@dataclass
class _Item:
    seq: Sequence
    tokens: list[int]
    pass_: Pass | None
    """None for replayed history."""
    last: bool = False
    rows: int = 0
    length_before: int | None = None
    """The device table's length before this step; None until the sequence's pages are on the device."""


class BatchScheduler:
    """Continuous batching of every live sequence's passes over one model runner."""

    def __init__(self, runner: ModelRunner, host: HostPagePool | None = None, config: SchedulerConfig | None = None):
        self.runner = runner
        self.host = host
        self.config = config or SchedulerConfig()
        self.stats = SchedulerStats()
        self.submissions = 0
        self._sequences: dict[int, Sequence] = {}
        self._ids = itertools.count()
        self._deliveries: list[tuple[Pass, PassResult, BaseException | None]] = []
        self.on_failure: Callable[[BaseException], None] | None = None
        """Called with the exception of each forward pass that fails, once its batch is rolled back (its passes
        get the exception): a server watches here for a device lost, whoever's pass found it."""

    # -- sequences -----------------------------------------------------------

    @property
    def pool_pages(self) -> int:
        return self.runner.pages.num_pages

    @property
    def page_size(self) -> int:
        return self.runner.page_size

    def sequences(self) -> list[Sequence]:
        return list(self._sequences.values())

    def new_sequence(self, priority: int = 0, cache_salt: str | None = None) -> Sequence:
        """A sequence; with ``cache_salt`` its pages are found in the prefix cache only by sequences of the same
        salt (vLLM's ``cache_salt``: a tenant's prompts cannot be probed by another's cached-token counts)."""
        sid = next(self._ids)
        seq = Sequence(sid, priority, sid, self.runner.new_sequence())
        seq.cache_root = cache_root(cache_salt)
        self._sequences[sid] = seq
        return seq

    def fork(self, parent: Sequence, priority: int | None = None) -> Sequence:
        """A sequence sharing ``parent``'s KV pages (copy-on-write); it keeps the parent's place in line."""
        self._check_live(parent)
        if parent.queue:
            raise SchedulerError("cannot fork a sequence while a pass on it is pending")
        sid = next(self._ids)
        child = Sequence(sid, parent.priority if priority is None else priority, parent.arrival, None)
        if parent.device is not None:
            child.device = parent.device.fork()
        elif parent.host is not None:
            child.host = parent.host.fork()
        child.history = list(parent.history)
        child.page_keys = list(parent.page_keys)
        child.cache_root = parent.cache_root
        child.published = parent.published
        self._sequences[sid] = child
        return child

    def truncate(self, seq: Sequence, length: int) -> None:
        """Forget the tokens past ``length``."""
        self._check_live(seq)
        if seq.queue:
            raise SchedulerError("cannot truncate a sequence while a pass on it is pending")
        if not 0 <= length <= len(seq.history):
            raise ValueError(f"cannot truncate a sequence of {len(seq.history)} tokens to {length}")
        self._cut(seq, length)

    def drop(self, seq: Sequence) -> None:
        """Release the sequence's pages (device and host); its pending passes fail with SequenceDropped."""
        if seq.dropped:
            return
        seq.dropped = True
        for pending in seq.queue:
            self._deliveries.append((pending, None, SequenceDropped(f"sequence {seq.id} was dropped")))
        seq.queue.clear()
        if seq.device is not None:
            seq.device.free()
            seq.device = None
        if seq.host is not None:
            seq.host.free()
            seq.host = None
        del self._sequences[seq.id]
        self._flush_deliveries()

    # -- passes --------------------------------------------------------------

    def submit(
        self,
        seq: Sequence,
        tokens: Seq[int],
        on_done: PassCallback,
        *,
        logits: bool = True,
        all_logits: bool = False,
        top: int = 0,
    ) -> Pass:
        """Queue tokens for ``seq``; ``on_done`` gets the logits of the last token (of every token
        with ``all_logits``: ``[len(tokens), vocab]``), or None when ``logits`` is False.

        With ``top`` it may get the last token's :class:`TopTokens` instead (at least ``top`` of them),
        when the whole step can read those on the device; a caller handles both (``Sampler.sample`` does).
        """
        self._check_live(seq)
        if not tokens:
            raise ValueError("a pass needs at least one token")
        if top < 0 or (top and (all_logits or not logits)):
            raise ValueError(f"top={top} needs a pass that returns its last token's logits")
        ids = [int(t) for t in tokens]
        vocab = self.runner.config.vocab_size
        if not 0 <= min(ids) <= max(ids) < vocab:  # else the batch it joins would fail, every sequence of it
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise ValueError(f"token id {bad} is outside the vocabulary (0 to {vocab - 1})")
        length = len(seq.history) + sum(len(queued.tokens) - queued.done for queued in seq.queue) + len(ids)
        context = self.runner.config.max_position_embeddings
        if length > context:  # positions the model has no embedding for: they never reach the engine
            raise PastContext(f"the pass would take its context to {length} tokens, past the model's context of "
                              f"{context}")
        pending = Pass(ids, logits or all_logits, all_logits, on_done, top)
        seq.queue.append(pending)
        self.submissions += 1
        return pending

    def cancel(self, seq: Sequence, pending: Pass) -> None:
        """Withdraw a pass nobody waits for; tokens it already appended are rolled back. So are those of a pass
        that completed, while nothing has come after them: a cancel that lands just after the pass's delivery
        leaves the sequence as a cancel that came before it would."""
        if seq.dropped:
            return
        if pending in seq.queue:
            seq.queue.remove(pending)
            if pending.base is not None:
                self._cut(seq, pending.base)
        elif (not seq.queue and pending.base is not None
              and pending.done == len(pending.tokens) == len(seq.history) - pending.base):
            self._cut(seq, pending.base)

    def has_work(self) -> bool:
        return any(seq.queue for seq in self._sequences.values())

    def step(self) -> bool:
        """Run one batched forward pass over the ready work. False when nothing was ready."""
        items = self._schedule()
        if not items:
            progressed = bool(self._deliveries)
            self._flush_deliveries()
            if not progressed and self.has_work():
                raise SchedulerError(f"no pass can be scheduled: {self.sequences()}")
            return progressed
        items = [item for item in items if self._swap_in(item.seq)]
        if not items:  # each swap-in failed: those sequences replay their history in a later step
            self._flush_deliveries()
            return True
        top = _top_of(items)
        try:
            batch = self.runner.prepare([self._materialize(item) for item in items])
            logits = self.runner.forward_top(batch, top) if top else self.runner.forward(batch)
        except Exception as exc:
            self._roll_back(items, exc)
            if self.on_failure is not None:
                self.on_failure(exc)
        else:
            self._complete(items, logits)
        self.stats.steps += 1
        self.stats.largest_batch = max(self.stats.largest_batch, len(items))
        self._flush_deliveries()
        return True

    def fail_all(self, error: BaseException) -> None:
        """Fail every pending pass (used when the step loop itself breaks)."""
        for seq in self.sequences():
            while seq.queue:
                pending = seq.queue.popleft()
                if pending.base is not None:
                    self._cut(seq, pending.base)
                self._deliveries.append((pending, None, error))
        self._flush_deliveries()

    # -- scheduling ----------------------------------------------------------

    def _schedule(self) -> list[_Item]:
        ready = sorted((s for s in self._sequences.values() if s.queue), key=Sequence.rank)
        if not ready:
            return []
        config = self.config
        limits = [s.next_chunk_limit() for s in ready]
        decodes = limits.count(1)
        short = config.short_prefill_tokens
        longest_chunk = short if any(1 < limit <= short for limit in limits) else config.prefill_chunk
        tokens_left = config.max_batch_tokens
        prefill_left = max(config.max_batch_tokens - decodes, 1)
        kv = self.runner.pages
        reserved = 0
        items: list[_Item] = []
        in_batch: set[int] = set()
        victims_left = True
        starved = False
        for seq in ready:
            if tokens_left == 0 or len(items) == config.max_batch_sequences:
                break
            if self._too_large(seq):
                continue
            if self.config.prefix_caching and seq.kv_length == 0 and seq.host is None:
                self._reuse_cached(seq, kv.free_count - reserved)
            limit = seq.next_chunk_limit()
            count = 1 if limit == 1 else min(limit, config.prefill_chunk, longest_chunk, prefill_left, tokens_left)
            if count == 0:
                continue
            need = self._pages_for(seq, count)
            if need and starved:
                continue  # pages go to the better-ranked sequence that is waiting for them
            if need > kv.free_count - reserved and victims_left:
                victims_left = self._make_room(seq, count, reserved, in_batch)
                need = self._pages_for(seq, count)  # preemption may have ended copy-on-write sharing
            if need > kv.free_count - reserved and self._unpublish_last_page(seq):
                need = self._pages_for(seq, count)
            free = kv.free_count - reserved
            if need > free and count > 1 and (seq.kv_length or self._pass_fits_beside_better(seq, reserved)):
                count = self._largest_fitting(seq, count, free)
                need = self._pages_for(seq, count) if count else need
            if count == 0 or need > free:
                starved = True
                continue
            reserved += need
            in_batch.add(seq.id)
            items.append(self._take(seq, count))
            tokens_left -= count
            if limit > 1:
                prefill_left = max(prefill_left - count, 0)
        return items

    def _too_large(self, seq: Sequence) -> bool:
        tokens = seq.final_length()
        pages = -(-tokens // self.page_size)
        if pages <= self.pool_pages:
            return False
        head = seq.queue.popleft()
        if head.base is not None:
            self._cut(seq, head.base)
        self.stats.too_large += 1
        self._deliveries.append((head, None, RequestTooLarge(tokens, pages, self.pool_pages, self.page_size)))
        return True

    def _reuse_cached(self, seq: Sequence, spare: int) -> None:
        """Start ``seq`` from the published pages that match the start of its tokens.

        A fresh sequence looks up its first pass (all but its last token, whose logits must be
        computed); one preempted by recompute looks up its whole history. Cached pages nobody holds
        count as free, so at most ``spare`` of them are taken (the rest of the free pages are
        reserved for sequences already in this step).
        """
        if seq.history:
            tokens, usable = seq.history, len(seq.history) // self.page_size
        else:
            head = seq.queue[0]
            if head.done or head.all_logits:
                return
            tokens, usable = head.tokens, (len(head.tokens) - 1) // self.page_size
            if not head.queried:
                head.queried = True
                self.stats.prefix_queried_tokens += len(tokens)
        kv = self.runner.pages
        keys: list[bytes] = []
        pages: list[int] = []
        for key in chain_keys(tokens[: usable * self.page_size], self.page_size, seq.cache_root):
            page = kv.lookup(key)
            if page is None:
                break
            if kv.refcount(page) == 0:
                if spare == 0:
                    break
                spare -= 1
            keys.append(key)
            pages.append(page)
        if not pages:
            return
        kv.retain(pages)
        if seq.device is not None:
            seq.device.free()
        length = len(pages) * self.page_size
        seq.device = kv.sequence(pages, length)
        seq.page_keys = keys
        seq.published = len(pages)
        if seq.history:
            self.stats.replay_cached_tokens += length
        else:
            head.base = 0
            head.done = length
            seq.history.extend(tokens[:length])
            seq.cached_tokens = length
            self.stats.prefix_cached_tokens += length

    def _publish(self, seq: Sequence) -> None:
        """Offer ``seq``'s full, computed pages for publishing under their content keys."""
        pages = seq.device
        assert pages is not None
        full = pages.length // self.page_size
        if seq.published >= full:
            return
        keys = seq.page_keys
        if len(keys) < full:
            parent = keys[-1] if keys else seq.cache_root
            keys.extend(chain_keys(seq.history[: full * self.page_size], self.page_size, parent, len(keys)))
        kv = self.runner.pages
        for index in range(seq.published, full):
            kv.publish(pages.pages[index], keys[index])
        seq.published = full

    def _pages_for(self, seq: Sequence, count: int) -> int:
        """Device pages ``seq`` must get to take ``count`` more tokens (swap-in included)."""
        if seq.device is not None:
            return seq.device.pages_needed(count)
        return -(-(seq.kv_length + count) // self.page_size)

    def _pass_fits_beside_better(self, seq: Sequence, reserved: int) -> bool:
        """Whether ``seq``'s whole head pass (its history replayed first) fits in the pool beside the pages of the
        better-ranked sequences with work (which it cannot preempt) and the ``reserved`` pages of this step."""
        rank = seq.rank()
        held = {page for other in self._sequences.values()
                if other.device is not None and other.queue and other.rank() < rank for page in other.device.pages}
        return -(-seq.final_length() // self.page_size) + len(held) + reserved <= self.pool_pages

    def _largest_fitting(self, seq: Sequence, count: int, free: int) -> int:
        low, high = 0, count
        while low < high:
            middle = (low + high + 1) // 2
            if self._pages_for(seq, middle) <= free:
                low = middle
            else:
                high = middle - 1
        return low

    def _make_room(self, requester: Sequence, count: int, reserved: int, protected: set[int]) -> bool:
        """Preempt until ``count`` more tokens of ``requester`` fit beside ``reserved`` pages; False when they
        cannot be made to fit (having preempted none, where preempting every candidate would not do)."""
        kv = self.runner.pages

        def fits() -> bool:
            return self._pages_for(requester, count) + reserved <= kv.free_count

        if fits():
            return True
        rank = requester.rank()
        candidates = [
            s
            for s in self._sequences.values()
            if s.device is not None
            and s.device.pages
            and s is not requester
            and s.id not in protected
            and (not s.queue or s.rank() > rank)
        ]
        candidates.sort(key=_victim_order)
        # A page is freed once every sequence holding it is preempted: a candidate whose pages are all also held by
        # sequences that stay would free nothing, and come back the next step to be preempted again. The partly
        # filled page the requester writes into next is the exception: once the requester alone holds it, it needs
        # no copy, which is as good as a free page.
        holders = Counter(page for s in candidates if s.device is not None for page in s.device.pages)
        pages = requester.device
        if pages is not None and pages.length % self.page_size:
            holders[pages.pages[-1]] += 1
        # Preempting them all would not make room (even if the requester's shared last page needed no copy then):
        # preempt none, rather than lose their work for nothing.
        freeable = sum(1 for page, holding in holders.items() if holding >= kv.refcount(page))
        if self._pages_for(requester, count) - 1 + reserved > kv.free_count + freeable:
            return False
        for victim in candidates:
            assert victim.device is not None
            if all(holders[page] < kv.refcount(page) for page in victim.device.pages):
                continue
            self._preempt(victim)
            if fits():
                return True
        return False

    def _unpublish_last_page(self, seq: Sequence) -> bool:
        """Let ``seq`` write in place into a published page that it alone holds and keeps in part (a truncate or a
        roll back cut into it): it copies such a page, to keep it cached, only while the pool has a page free."""
        pages = seq.device
        if pages is None or not pages.length % self.page_size:
            return False
        kv = self.runner.pages
        last = pages.pages[-1]
        if kv.refcount(last) > 1 or not kv.is_published(last):
            return False
        kv.unpublish(last)
        return True

    def _preempt(self, victim: Sequence) -> None:
        pages = victim.device
        assert pages is not None
        stored = None
        if self.host is not None:
            try:
                stored = self.host.store(self.runner.pages, pages)
            except Exception as exc:  # the sequence is recomputed instead: no pass need fail for it
                self._swap_failed("out", victim, exc)
        self.stats.preemptions += 1
        if stored is not None:
            victim.host = stored
            self.stats.swap_outs += 1
            self.stats.pages_swapped_out += len(stored.pages)
        else:
            self.stats.recomputes += 1
        pages.free()
        victim.device = None

    def _swap_in(self, seq: Sequence) -> bool:
        """Bring a swapped-out ``seq``'s pages back to the device (its pages were reserved when it was scheduled).
        False when the copy failed: its host pages are dropped, and it replays its history from a later step."""
        if seq.host is None:
            return True
        assert self.host is not None
        try:
            seq.device = self.host.load(self.runner.pages, seq.host)
        except Exception as exc:
            self._swap_failed("in", seq, exc)
            seq.host.free()
            seq.host = None
            self.stats.recomputes += 1
            return False
        seq.host = None
        seq.published = 0
        self.stats.swap_ins += 1
        self.stats.pages_swapped_in += len(seq.device.pages)
        return True

    def _swap_failed(self, direction: str, seq: Sequence, error: Exception) -> None:
        self.stats.swap_failures += 1
        log.warning("swapping sequence %d %s failed (%s: %s); it is recomputed instead", seq.id, direction,
                    type(error).__name__, error)

    def _take(self, seq: Sequence, count: int) -> _Item:
        if seq.replay:
            start = seq.kv_length
            return _Item(seq, seq.history[start : start + count], None)
        head = seq.queue[0]
        if head.done == 0:
            head.base = len(seq.history)
        tokens = head.tokens[head.done : head.done + count]
        last = head.done + count == len(head.tokens)
        rows = count if head.all_logits else int(last and head.logits)
        return _Item(seq, tokens, head, last, rows)

    def _materialize(self, item: _Item) -> SequenceWork:
        seq = item.seq
        if seq.device is None:
            seq.device = self.runner.new_sequence()
            seq.published = 0
        item.length_before = seq.device.length
        head = item.pass_
        if head is None:
            self.stats.recomputed_tokens += len(item.tokens)
            return SequenceWork(seq.device, item.tokens, logits=False)
        return SequenceWork(seq.device, item.tokens, logits=item.last and head.logits, all_logits=head.all_logits)

    def _complete(self, items: list[_Item], logits: np.ndarray | TopTokens) -> None:
        offset = 0
        for item in items:
            rows = logits[offset : offset + item.rows]
            offset += item.rows
            self.stats.forwarded_tokens += len(item.tokens)
            head = item.pass_
            if head is not None:
                item.seq.history.extend(item.tokens)
            if self.config.prefix_caching:
                self._publish(item.seq)
            if head is None:
                continue
            head.done += len(item.tokens)
            if head.all_logits:
                head.rows.append(rows)
            if item.last:
                item.seq.queue.popleft()
                if head.all_logits:
                    result: PassResult = np.concatenate(head.rows)
                else:
                    result = rows[0] if head.logits else None
                self._deliveries.append((head, result, None))

    def _roll_back(self, items: list[_Item], error: Exception) -> None:
        """Preparing or running the forward pass failed: forget its slots and fail each sequence's head pass."""
        for item in items:
            seq = item.seq
            if item.length_before is not None:
                assert seq.device is not None
                seq.device.truncate(item.length_before)
            head = seq.queue.popleft()
            if head.base is not None:
                self._cut(seq, head.base)
            self._deliveries.append((head, None, error))

    # -- helpers -------------------------------------------------------------

    def _cut(self, seq: Sequence, length: int) -> None:
        del seq.history[length:]
        full = length // self.page_size
        del seq.page_keys[full:]
        seq.published = min(seq.published, full)
        for pages in (seq.device, seq.host):
            if pages is not None and pages.length > length:
                pages.truncate(length)

    def _check_live(self, seq: Sequence) -> None:
        if seq.dropped:
            raise SequenceDropped(f"sequence {seq.id} was dropped")

    def _flush_deliveries(self) -> None:
        deliveries, self._deliveries = self._deliveries, []
        for pending, result, error in deliveries:
            pending.on_done(result, error)


def _top_of(items: list[_Item]) -> int:
    """How many most likely tokens the step reads instead of logits: the most any sampled pass asks
    for, or 0 (logits for all) when one of them needs its logits."""
    top = 0
    for item in items:
        if item.rows:
            assert item.pass_ is not None
            if not item.pass_.top:
                return 0
            top = max(top, item.pass_.top)
    return top


def _victim_order(seq: Sequence) -> tuple[bool, bool, int, int, int]:
    """Preempt first: sequences that free pages (all-shared ones free nothing by themselves), idle
    before busy, lowest priority, latest arrival."""
    assert seq.device is not None
    return (seq.device.exclusive_page_count() == 0, bool(seq.queue), seq.priority, -seq.arrival, -seq.id)
