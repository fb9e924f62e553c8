"""Lazily computed, memoised values over a graph's producers, without recursion."""

from __future__ import annotations


def memoised(name: str, cache: dict, step):
    """The value of ``name`` in ``cache``, computed over producers without recursion (graphs
    are deep): ``step(t)`` either names a tensor whose value must be computed first, or stores
    what it can into ``cache`` and returns None (t itself then defaults to None)."""
    stack = [name]
    while stack:
        t = stack[-1]
        if t in cache:
            stack.pop()
            continue
        need = step(t)
        if need:
            stack.append(need)
        else:
            stack.pop()
            cache.setdefault(t, None)
    return cache[name]
