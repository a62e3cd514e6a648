"""Choosing a replica for a request: the one most likely to hold its prompt's prefix, else the least loaded.

The router remembers which replica it sent every full page of every prompt to, keyed by
the prefix cache's own page-hash chain (:func:`pie.runtime.kv_cache.chain_keys`): the key
of a page names every token up to its end, so a key the router knows means that replica
computed (and, with its prefix cache on, kept) the whole prefix up to that page. A prompt
whose known prefix covers at least ``min_match`` of it goes to that replica, unless the
replica already has ``balance_slack`` more requests in flight than the least loaded one:
past that, waiting for it costs more than computing the prefix again elsewhere, and the
prefix then has two holders: the less loaded of them takes the next request.

Everything else (short prompts, new prefixes, text the router cannot tokenize) goes to the
least loaded replica, ties broken by fewer requests routed so far. The router holds no
model and no Ray: it is plain bookkeeping, used on the ingress's event loop only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Literal

from pie.runtime.kv_cache import chain_keys

Reason = Literal["prefix", "least_loaded"]


@dataclass(frozen=True)
class Route:
    replica: int
    reason: Reason
    matched_tokens: int
    """Prompt tokens the chosen replica is known to hold (0 when routed by load)."""


class PrefixRouter:
    """Prefix affinity over ``replicas`` replicas whose prefix caches use pages of ``page_size`` tokens."""

    def __init__(
        self,
        replicas: int,
        page_size: int = 16,
        *,
        min_match: float = 0.5,
        balance_slack: int = 8,
        max_keys: int = 1 << 20,
    ):
        if replicas < 1:
            raise ValueError(f"a router needs at least one replica, not {replicas}")
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1, not {page_size}")
        if not 0 < min_match <= 1:
            raise ValueError(f"min_match must be in (0, 1], not {min_match}")
        self.page_size = page_size
        self.min_match = min_match
        self.balance_slack = balance_slack
        self.max_keys = max_keys
        self.load = [0] * replicas
        """Requests in flight on each replica (as this router sent them)."""
        self.routed = [0] * replicas
        self._replicas = replicas
        self._holders: OrderedDict[bytes, int] = OrderedDict()
        """Page key -> the replicas sent that prefix (a bit each, the low ``replicas`` bits) and, above them, the
        stamp of its last record (:attr:`_stamp` then); least recently used first."""
        self._stamp = 0
        """Counts records and forgets: what orders a key's last record against a replica's last forget."""
        self._forgotten = [0] * replicas
        """Each replica's last forget's stamp: its bit in a key recorded no later is stale."""
        self._last_forget = 0

    @property
    def known_pages(self) -> int:
        return len(self._holders)

    def choose(self, tokens: Sequence[int] | None, available: Collection[int], root: bytes = b"") -> Route | None:
        """The replica for a prompt of ``tokens`` (None: unknown) among ``available``; None when none is. ``root``
        is its key chain's root (:func:`pie.runtime.kv_cache.cache_root` of its ``cache_salt``): a salted prompt's
        pages are another's only under the same salt, in the router as in the replicas' caches.

        Records the prompt's pages as the chosen replica's and counts the request in flight on it:
        call :meth:`finished` when it ends, whatever the outcome.
        """
        if not available:
            return None
        by_load = lambda r: (self.load[r], self.routed[r], r)  # noqa: E731
        least = min(available, key=by_load)
        keys = list(chain_keys(tokens, self.page_size, root)) if tokens else []
        holders, matched = self._longest_known(keys, available)
        chosen: int = least
        reason: Reason = "least_loaded"
        if holders and matched * self.page_size >= self.min_match * len(tokens or ()):
            holder = min(holders, key=by_load)
            if self.load[holder] <= self.load[least] + self.balance_slack:
                chosen, reason = holder, "prefix"
        self._stamp += 1
        recorded = self._stamp << self._replicas | 1 << chosen
        for key in keys:
            self._holders[key] = recorded | self._holding(self._holders.get(key, 0))
            self._holders.move_to_end(key)
        while len(self._holders) > self.max_keys:
            self._holders.popitem(last=False)
        self.load[chosen] += 1
        self.routed[chosen] += 1
        return Route(chosen, reason, matched * self.page_size if reason == "prefix" else 0)

    def finished(self, replica: int) -> None:
        self.load[replica] = max(self.load[replica] - 1, 0)

    def forget(self, replica: int) -> None:
        """``replica`` restarted: its prefix cache is empty, so nothing routes to it by prefix any more (until it is
        sent a prefix again). Its bits in the keys are left, stale, for the reads and records of those keys to drop:
        going through a million keys here held the ingress's event loop for seconds, as a replica failed."""
        self._stamp += 1
        self._forgotten[replica] = self._last_forget = self._stamp

    def _holding(self, entry: int) -> int:
        """The replicas a key's ``entry`` names that still hold its prefix: those not forgotten since its record."""
        mask = entry & ((1 << self._replicas) - 1)
        stamp = entry >> self._replicas
        if stamp > self._last_forget:
            return mask
        return mask & sum(1 << r for r, forgotten in enumerate(self._forgotten) if forgotten < stamp)

    def _longest_known(self, keys: list[bytes], available: Collection[int]) -> tuple[list[int], int]:
        """The available replicas that hold the longest known prefix of these page keys, and its length in pages."""
        wanted = sum(1 << r for r in available)
        holders, matched = 0, 0
        for depth, key in enumerate(keys, 1):
            mask = self._holding(self._holders.get(key, 0)) & wanted
            if not mask:
                break
            holders, matched = mask, depth
        return [r for r in available if holders >> r & 1], matched
