"""A decision previewed without consequence (``/debug/route``).

A policy may change its own state while deciding: every random tie-break draws from its
``random.Random``, a round robin moves its cursor. A preview that left those changes behind would
make the next live request go elsewhere than the preview said (and previews interleaved with
traffic would change routing itself). ``unchanged(policy)`` records, across the policy's object
graph, every ``random.Random`` state and every object's plain attributes, and puts them back when
the preview ends.

Reach: objects are followed through attributes, lists and tuples (a pipeline's scorers, a
wrapper's inner policy), not through dicts or objects with ``__slots__`` only, so a policy's
learned structures (``cache_aware``'s per-model trees, which ``decide`` only reads) are never
walked; a plugin whose ``decide`` grows such a structure is not undone (``decide`` should not:
learning belongs in ``on_routed``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_MAX_DEPTH = 6  # policy -> wrapper -> pipeline -> scorer list -> scorer -> its RNG


@contextmanager
def unchanged(policy: object) -> Iterator[None]:
    rngs: list[tuple[random.Random, Any]] = []
    attrs: list[tuple[object, dict[str, Any]]] = []
    _record(policy, 0, set(), rngs, attrs)
    try:
        yield
    finally:
        for rng, state in rngs:
            rng.setstate(state)
        for obj, saved in attrs:
            now = vars(obj)
            for name in [n for n in now if n not in saved]:
                del now[name]
            for name, value in saved.items():
                if now.get(name, _MISSING) is not value:
                    now[name] = value


_MISSING = object()


def _record(obj: object, depth: int, seen: set[int], rngs: list[tuple[random.Random, Any]],
            attrs: list[tuple[object, dict[str, Any]]]) -> None:
    if depth > _MAX_DEPTH or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, random.Random):
        rngs.append((obj, obj.getstate()))
        return
    if isinstance(obj, (list, tuple)):
        for item in obj:
            _record(item, depth + 1, seen, rngs, attrs)
        return
    state = getattr(obj, "__dict__", None)
    if not isinstance(state, dict) or type(obj).__module__ == "builtins":
        return
    attrs.append((obj, dict(state)))
    for value in state.values():
        _record(value, depth + 1, seen, rngs, attrs)
