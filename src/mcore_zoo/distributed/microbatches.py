"""The micro-batch planner: which sequences go into which micro-batch, for the forward and the
training step alike (:func:`plan_microbatches`).

One contract for both: at least ``count`` groups (a multiple of ``multiple_of`` where there are
enough sequences, never more groups than sequences), each within ``max_tokens`` tokens unless it
is one sequence longer than that, and no more groups than that needs. The two ways of filling them:

* ``keep_order=True`` (:func:`mcore_zoo.distributed.forward.generic_forward`): contiguous runs of
  indices, in input order. A run ends where its running token sum reaches the next equal share of
  the total for ``count`` groups, where the sequences left are only enough for one per remaining
  group, or before a sequence that would take it past ``max_tokens`` (so under a budget alone the
  runs are as long as the budget allows: the fewest contiguous groups).
* ``keep_order=False`` (:func:`mcore_zoo.distributed.train.train_step`, and spreading a batch over
  data-parallel ranks with ``count=dp``): balanced. The longest sequence goes first, each into the
  lightest group; the number of groups starts at what the budget needs and grows until every
  group fits. Each group lists its indices in ascending order; groups are ordered by their first
  index.

Pure: no process group, no tensor.
"""

from __future__ import annotations

from typing import Optional, Sequence


def _group_count(n: int, k: int, multiple_of: int) -> int:
    """``k`` rounded up to a multiple of ``multiple_of`` when there are at least that many
    sequences, and at most ``n``."""
    return min(n, -(-k // multiple_of) * multiple_of) if n >= multiple_of else min(n, k)


def _in_order(lengths: Sequence[int], k: int, max_tokens: Optional[int]) -> list[list[int]]:
    """Contiguous runs of indices: cut at each equal share of the total for ``k`` groups, where
    the sequences left are one per remaining group, and before a sequence that would take the run
    past ``max_tokens``."""
    n, total = len(lengths), sum(lengths)
    groups: list[list[int]] = []
    current: list[int] = []
    used = done = 0
    for i, length in enumerate(lengths):
        if current and max_tokens is not None and used + length > max_tokens:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += length
        done += length
        remaining_groups = k - len(groups) - 1
        if remaining_groups > 0 and (done >= total * (len(groups) + 1) / k or n - i - 1 == remaining_groups):
            groups.append(current)
            current, used = [], 0
    if current:
        groups.append(current)
    return groups


def _balanced(lengths: Sequence[int], k: int) -> list[list[int]]:
    """``k`` groups filled longest sequence first into the lightest group (ties: the lower index),
    each group's indices ascending, the groups ordered by their first index."""
    groups: list[list[int]] = [[] for _ in range(k)]
    load = [0] * k
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        g = min(range(k), key=lambda g: (load[g], g))
        groups[g].append(i)
        load[g] += lengths[i]
    return sorted((sorted(g) for g in groups if g), key=lambda g: g[0])


def plan_microbatches(lengths: Sequence[int], *, count: Optional[int] = None, max_tokens: Optional[int] = None,
                      multiple_of: int = 1, keep_order: bool = False) -> list[list[int]]:  # fmt: skip
    """Groups of indices into ``lengths`` (tokens per sequence), one group per micro-batch, in
    input order (``keep_order``) or balanced; see the module docstring for the contract. ``[]``
    for no sequences."""
    n = len(lengths)
    if n == 0:
        return []
    if keep_order:
        return _in_order(lengths, _group_count(n, count or 1, multiple_of), max_tokens)
    k = max(1, count or 1, -(-sum(lengths) // max_tokens) if max_tokens else 1)
    while True:
        k = _group_count(n, k, multiple_of)
        groups = _balanced(lengths, k)
        if max_tokens is None or k >= n or all(len(g) == 1 or sum(lengths[i] for i in g) <= max_tokens for g in groups):
            return groups
        k += 1


__all__ = ["plan_microbatches"]
