"""One cache for the costs a search asks for again and again.

A search costs the same block under the same configuration fields many times (every
schedule, virtual-stage count and partition of an outer configuration shares its blocks'
costs). Whoever runs such a search owns a `CostCache` and passes it to the cost functions
(`cache=`); without one they compute afresh, so they stay pure functions of their
arguments. Each value is kept under exactly what it depends on: the key holds the
configuration fields its function reads (tests/cost/test_cost_cache.py checks that) and the
traced graph, cluster or GPU it reads, by identity (id()). A graph, a cluster and a GPU are
not changed once built, and the cache holds each one it has keyed, so an identity is never
reused for another object while the cache lives.
"""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


class CostCache:
    """Values of cost functions by key; one per search (or per sweep over one graph)."""

    def __init__(self) -> None:
        self._values: dict[tuple, object] = {}
        self._held: dict[int, object] = {}

    def get(self, key: tuple, compute: Callable[[], T], *held: object) -> T:
        """The value under `key`, computed by `compute()` the first time it is asked for.
        `held`: the objects whose id() is part of `key`. The cache keeps them while it lives,
        so no other object can take one of their ids and be mistaken for them."""
        try:
            return self._values[key]  # type: ignore[return-value]
        except KeyError:
            value = self._values[key] = compute()
            for obj in held:
                self._held[id(obj)] = obj
            return value


class _NoCache(CostCache):
    """Computes every value afresh: what a cost function uses when it is given no cache."""

    def get(self, key: tuple, compute: Callable[[], T], *held: object) -> T:
        return compute()


NO_CACHE = _NoCache()


def or_no_cache(cache: CostCache | None) -> CostCache:
    return NO_CACHE if cache is None else cache
