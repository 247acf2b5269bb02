"""Load balancing of variable-length sequences across data-parallel shards and into
token-budgeted micro-batches.

Every device of a data-parallel step waits for the slowest one, and a sequence's cost grows
faster than its length (attention), so how responses of very different lengths are dealt out
matters. The cost of a sequence of length L is `a * L + b * L^2` (`models.flops.
cost_coefficients(cfg)` gives the training-FLOPs values; the default a=1, b=0 counts tokens).

Partitioning uses the Karmarkar-Karp largest differencing method (k-way): every item starts
as a partial k-way partition (the item alone in one subset); the two partial partitions with
the largest spread (max - min subset cost) are merged by pairing the costliest subset of one
with the cheapest of the other, until one partition is left. With `equal_size` the items are
first sorted and dealt in rounds of k, one per subset, so every subset holds n / k items
(fixed per-device shapes), and merging keeps the counts equal; a swap pass between the
costliest and cheapest subsets then repairs what the count constraint costs.

`plan_batch` does both levels: sequences to shards (equal counts), then each shard's
sequences into micro-batches, either a fixed number of equal-size ones, or as few as fit a
token budget (the same number on every shard, so all devices run their micro-steps in step).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
from typing import Sequence

import numpy as np

LAYOUTS = ("micro_major", "shard_major")


def sequence_costs(lengths, a: float = 1.0, b: float = 0.0) -> np.ndarray:
  """Cost a * L + b * L^2 of each sequence (float64)."""
  length = np.asarray(lengths, np.float64)
  if length.ndim != 1 or np.any(length < 0):
    raise ValueError(f"lengths must be a 1-D array of non-negative values, got {lengths!r}")
  return a * length + b * length * length


def karmarkar_karp(costs, k: int, *, equal_size: bool = False) -> list[list[int]]:
  """Indices of `costs` split into k subsets of near-equal total cost (largest differencing).

  Subsets come back sorted by decreasing total cost, each subset's indices ascending. With
  `equal_size`, len(costs) must be divisible by k and every subset gets len(costs) / k items.
  """
  costs = np.asarray(costs, np.float64)
  n = len(costs)
  if k < 1:
    raise ValueError(f"k={k}: need at least one subset")
  if equal_size and n % k:
    raise ValueError(f"equal_size: {n} items do not split into {k} equal subsets")
  tie = itertools.count()  # heap tie-breaker (partitions themselves are not comparable)
  heap = []

  def push(subsets):
    subsets.sort(key=lambda s: s[0], reverse=True)
    heapq.heappush(heap, (-(subsets[0][0] - subsets[-1][0]), next(tie), subsets))

  if equal_size:
    order = np.argsort(costs, kind="stable")
    for start in range(0, n, k):
      push([(costs[i], [int(i)]) for i in order[start:start + k]])
  else:
    for i in range(n):
      push([(costs[i], [i])] + [(0.0, []) for _ in range(k - 1)])
  if not heap:
    return [[] for _ in range(k)]
  while len(heap) > 1:
    _, _, first = heapq.heappop(heap)
    _, _, second = heapq.heappop(heap)
    # first: decreasing cost; second reversed: increasing, so big meets small.
    push([(c1 + c2, s1 + s2) for (c1, s1), (c2, s2) in zip(first, reversed(second))])
  parts = [items for _, items in heap[0][2]]
  if equal_size:
    parts = _refine_by_swaps(costs, parts)
  return [sorted(p) for p in sorted(parts, key=lambda p: -costs[p].sum())]


def _refine_by_swaps(costs: np.ndarray, parts: list[list[int]],
                     max_rounds: int = 1000) -> list[list[int]]:
  """Equal counts constrain KK (the heaviest items each drag n/k - 1 others along); swapping
  one item of the costliest subset for one of the cheapest, the pair that best evens those
  two, repairs most of it while keeping every count."""
  parts = [list(p) for p in parts]
  for _ in range(max_rounds):
    totals = np.array([costs[p].sum() for p in parts])
    high, low = int(np.argmax(totals)), int(np.argmin(totals))
    gap = totals[high] - totals[low]
    if gap <= 0 or not parts[high] or not parts[low]:
      break
    delta = costs[parts[high]][:, None] - costs[parts[low]][None, :]
    after = np.abs(gap - 2 * delta)  # the pair's new gap after swapping
    i, j = np.unravel_index(np.argmin(after), after.shape)
    if after[i, j] >= gap - 1e-12 * gap:
      break
    parts[high][i], parts[low][j] = parts[low][j], parts[high][i]
  return parts


def round_robin(n: int, k: int) -> list[list[int]]:
  """The naive baseline: item i to subset i mod k."""
  return [list(range(s, n, k)) for s in range(k)]


def imbalance(costs, parts: Sequence[Sequence[int]]) -> float:
  """max / min subset cost (inf when a subset costs nothing while another does)."""
  costs = np.asarray(costs, np.float64)
  totals = [float(costs[list(p)].sum()) for p in parts]
  high, low = max(totals), min(totals)
  if low <= 0:
    return 1.0 if high <= 0 else float("inf")
  return high / low


@dataclasses.dataclass(frozen=True)
class BalancePlan:
  """Sequence indices per shard and micro-batch: `shards[s][i]` is micro-batch i of shard s."""
  shards: list[list[list[int]]]

  @property
  def num_micro_batches(self) -> int:
    return len(self.shards[0])

  def order(self, layout: str = "micro_major") -> np.ndarray:
    """A permutation p such that batch[p] puts the plan into a flat batch.

    "micro_major" (micro-batch i = rows [i*B/m, (i+1)*B/m), split evenly over the k data
    shards: what rl/train_step.py's micro-batch split of a data-sharded batch gives) needs
    micro-batches of equal size; "shard_major" (shard s = rows [s*B/k, (s+1)*B/k), its
    micro-batches in order) needs shards of equal size.
    """
    if layout not in LAYOUTS:
      raise ValueError(f"layout={layout!r}: must be one of {LAYOUTS}")
    if layout == "shard_major":
      if len({sum(len(mb) for mb in shard) for shard in self.shards}) > 1:
        raise ValueError("shard_major layout needs shards of equal size")
      return np.array([i for shard in self.shards for mb in shard for i in mb], np.int64)
    if len({len(mb) for shard in self.shards for mb in shard}) > 1:
      raise ValueError("micro_major layout needs micro-batches of equal size "
                       "(plan with micro_batches=, not token_budget=)")
    return np.array([i for m in range(self.num_micro_batches) for shard in self.shards
                     for i in shard[m]], np.int64)


def split_micro_batches(lengths, indices: Sequence[int], *, micro_batches: int | None = None,
                        token_budget: int | None = None, a: float = 1.0,
                        b: float = 0.0) -> list[list[int]]:
  """`indices` (into `lengths`) split into balanced micro-batches: exactly `micro_batches`
  equal-size ones, or the fewest whose token sums each fit `token_budget`."""
  if (micro_batches is None) == (token_budget is None):
    raise ValueError("give exactly one of micro_batches and token_budget")
  lengths = np.asarray(lengths)
  indices = list(indices)
  costs = sequence_costs(lengths[indices], a, b)

  def split(m, equal):
    parts = karmarkar_karp(costs, m, equal_size=equal)
    return [[indices[j] for j in part] for part in parts]

  if micro_batches is not None:
    return split(micro_batches, True)
  if not indices:
    return [[]]
  longest = int(np.argmax(lengths[indices]))
  if lengths[indices[longest]] > token_budget:
    raise ValueError(f"sequence {indices[longest]} has {int(lengths[indices[longest]])} "
                     f"tokens, more than token_budget={token_budget}")
  # Fewest parts first; one sequence per part always fits, so this stops.
  m = max(1, -(-int(lengths[indices].sum()) // token_budget))
  while True:
    parts = split(m, False)
    if all(lengths[p].sum() <= token_budget for p in parts):
      return parts
    m += 1


def plan_batch(lengths, n_shards: int, *, micro_batches: int | None = None,
               token_budget: int | None = None, a: float = 1.0,
               b: float = 0.0) -> BalancePlan:
  """Balances sequences over `n_shards` data-parallel shards (equal counts), then each shard
  into micro-batches (see `split_micro_batches`); with a token budget every shard gets the
  same number of micro-batches (the most any shard needs)."""
  if (micro_batches is None) == (token_budget is None):
    raise ValueError("give exactly one of micro_batches and token_budget")
  lengths = np.asarray(lengths)
  shards = karmarkar_karp(sequence_costs(lengths, a, b), n_shards, equal_size=True)
  if micro_batches is not None:
    return BalancePlan([split_micro_batches(lengths, s, micro_batches=micro_batches, a=a, b=b)
                        for s in shards])

  def fits(parts):
    return all(lengths[p].sum() <= token_budget for p in parts)

  # Start from the most micro-batches any shard needs on its own; KK with that many parts
  # can (rarely) overfill one on another shard, so grow until every shard fits. One
  # sequence per micro-batch always fits, so this stops.
  m = max(len(split_micro_batches(lengths, s, token_budget=token_budget, a=a, b=b))
          for s in shards)
  while True:
    planned = [[[s[j] for j in part]
                for part in karmarkar_karp(sequence_costs(lengths[s], a, b), m)]
               for s in shards]
    if all(fits(parts) for parts in planned):
      return BalancePlan(planned)
    m += 1
