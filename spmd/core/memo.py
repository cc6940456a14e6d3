"""Answers about objects worked out once per object, keyed by its identity.

Planning asks the same questions of the same strategy lists and cost rows many times (nodes of tied layers
share theirs, and every step of a search asks again), and hashing them by value (placements are torch's
Python-hashed objects) costs more than the answer. Keyed by `id`, an answer would go stale if its object
died and another took its id: each answer is kept beside its object, which stays alive with it.
"""
from __future__ import annotations

from typing import Callable, Hashable, TypeVar

T = TypeVar("T")


class ByIdentity:
    """`get(obj, extra, make)`: `make()` the first time it is asked for (this object, `extra`), the same
    answer after that."""

    __slots__ = ("_answers",)

    def __init__(self):
        self._answers: dict[tuple[int, Hashable], tuple[object, object]] = {}

    def get(self, obj: object, extra: Hashable, make: Callable[[], T]) -> T:
        got = self._answers.get((id(obj), extra))
        if got is None:
            got = self._answers[(id(obj), extra)] = (obj, make())
        return got[1]
