"""The ingress's router: prefix affinity by the prefix cache's page keys, else the least loaded replica."""

from __future__ import annotations

from collections import OrderedDict
from typing import NoReturn

import pytest

from pie.runtime.kv_cache import cache_root
from pie.serve.router import PrefixRouter

PAGE = 16
SHARED = list(range(1000, 1000 + 6 * PAGE))  # six full pages every prompt below starts with


def prompt(tail: int) -> list[int]:
    return SHARED + [tail, tail + 1, tail + 2]


def test_a_shared_prefix_follows_the_replica_that_computed_it() -> None:
    router = PrefixRouter(2, PAGE)
    first = router.choose(prompt(1), {0, 1})
    assert first is not None and first.reason == "least_loaded"
    for tail in range(2, 10):
        route = router.choose(prompt(tail), {0, 1})
        assert route is not None
        assert (route.replica, route.reason, route.matched_tokens) == (first.replica, "prefix", len(SHARED))


def test_a_salted_prefix_routes_only_requests_of_the_same_salt() -> None:
    """The router keyed every prompt unsalted: a tenant's salted request went to the replica of another's unsalted
    prefix, where its salt kept it from the cache (and the salted prompt then marked that replica as holding the
    unsalted prefix too)."""
    router = PrefixRouter(2, PAGE)
    unsalted = router.choose(prompt(1), {0, 1})
    assert unsalted is not None
    salted = router.choose(prompt(2), {0, 1}, cache_root("tenant-a"))
    assert salted is not None and salted.reason == "least_loaded" and salted.replica != unsalted.replica
    router.finished(unsalted.replica)  # the unsalted holder is now the less loaded
    again = router.choose(prompt(3), {0, 1}, cache_root("tenant-a"))
    assert again is not None and (again.replica, again.reason) == (salted.replica, "prefix")
    other = router.choose(prompt(4), {0, 1}, cache_root("tenant-b"))
    assert other is not None and other.reason == "least_loaded"


def test_prompts_without_a_known_prefix_spread_by_load() -> None:
    router = PrefixRouter(3, PAGE)
    chosen = [router.choose([t] * 40, {0, 1, 2}) for t in range(6)]
    assert [r.replica for r in chosen if r] == [0, 1, 2, 0, 1, 2]
    router.finished(0)
    router.finished(0)
    assert router.load == [0, 2, 2]
    assert router.choose(None, {0, 1, 2}).replica == 0  # nothing to match: the least loaded


def test_a_short_match_is_not_worth_a_busier_replica() -> None:
    router = PrefixRouter(2, PAGE, min_match=0.5)
    router.choose(SHARED[:PAGE] + [1] * 200, {0, 1})  # replica 0 holds one page of it
    route = router.choose(SHARED[:PAGE] + [2] * 200, {0, 1})
    assert route is not None and (route.replica, route.reason) == (1, "least_loaded")


def test_an_overloaded_holder_gives_way_past_the_slack() -> None:
    router = PrefixRouter(2, PAGE, balance_slack=2)
    home = router.choose(prompt(0), {0, 1}).replica
    routes = [router.choose(prompt(t), {0, 1}) for t in range(1, 6)]
    # home takes two more (3 in flight, 2 over the other); then the other computes it too, and as the
    # less loaded of the two holders takes what follows.
    assert [(r.replica == home, r.reason) for r in routes] == [
        (True, "prefix"), (True, "prefix"), (False, "least_loaded"), (False, "prefix"), (False, "prefix")]


def test_an_unavailable_or_restarted_holder_is_not_chosen_by_prefix() -> None:
    router = PrefixRouter(2, PAGE)
    home = router.choose(prompt(0), {0, 1}).replica
    other = 1 - home
    assert router.choose(prompt(1), {other}).replica == other
    router.finished(home)
    router.finished(other)
    router.forget(other)  # restarted: what it held is gone; replica `home` still holds the prefix
    assert router.choose(prompt(2), {0, 1}).reason == "prefix"
    assert router.choose(prompt(3), set()) is None


def test_the_key_memory_is_bounded() -> None:
    router = PrefixRouter(1, PAGE, max_keys=10)
    for t in range(20):
        router.choose([t] * (4 * PAGE), {0})
    assert router.known_pages == 10


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="at least one replica"):
        PrefixRouter(0)
    with pytest.raises(ValueError, match="min_match"):
        PrefixRouter(1, min_match=0)


def test_a_forgotten_replica_is_routed_to_by_the_prefixes_it_is_sent_afterwards_only() -> None:
    router = PrefixRouter(2, PAGE)
    assert router.choose(prompt(0), {0}).replica == 0  # replica 0 holds SHARED
    router.forget(0)
    again = router.choose(prompt(1), {1})  # replica 1 computes SHARED: 0's stale bit must not come back with it
    assert again.reason == "least_loaded"
    router.finished(0)
    router.finished(1)
    assert [router.choose(prompt(t), {0}).reason for t in (2, 3)] == ["least_loaded", "prefix"]
    router.finished(0)
    router.finished(0)
    both = router.choose(prompt(4), {0, 1})
    assert both.reason == "prefix" and both.matched_tokens == len(SHARED)


class UntouchableKeys(OrderedDict):
    """A router's keys that fail any read or write: what forget() may not do."""

    def _touched(self, *args: object, **kwargs: object) -> NoReturn:
        raise AssertionError("forget() went through the router's keys")

    __iter__ = __getitem__ = __setitem__ = __delitem__ = __contains__ = get = keys = items = values = _touched
    pop = popitem = move_to_end = update = setdefault = clear = _touched


def test_forgetting_a_replica_does_not_go_through_every_key() -> None:
    """forget() went through every key the router knew (a million at its bound): 2.2 s of the ingress's event loop,
    every stream and /health stalled, each time a replica restarted or was taken out of routing. Checked here by keys
    that fail any read or write while it runs, not in time."""
    router = PrefixRouter(2, PAGE)
    for t in range(100):
        router.choose([t] * (100 * PAGE), {0, 1})
    assert router.known_pages == 10_000
    keys = router._holders
    router._holders = UntouchableKeys()
    try:
        router.forget(1)
    finally:
        router._holders = keys
    assert router.choose([1] * (100 * PAGE), {0, 1}).reason == "least_loaded"  # replica 1 held it: forgotten
    assert router.choose([0] * (100 * PAGE), {0, 1}).reason == "prefix"  # replica 0 holds it still
