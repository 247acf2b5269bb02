"""Karmarkar-Karp sequence balancing (rl/balance.py) and the FLOPs cost model it uses."""

import numpy as np
import pytest

from models import flops
from models.config import get_config
from rl import balance


def _skewed_lengths(n=512, seed=0):
  """Response lengths with a heavy tail (lognormal, median ~400, max ~8.7k tokens)."""
  rng = np.random.default_rng(seed)
  return np.clip(rng.lognormal(6.0, 1.0, n), 16, 16384).astype(np.int64)


@pytest.mark.parametrize("b", [0.0, 1 / 2048], ids=["tokens", "quadratic"])
def test_karmarkar_karp_beats_round_robin_on_skewed_lengths(b, record_property):
  """On a heavy-tailed length distribution over 8 shards (equal counts), the max/min shard
  cost ratio of KK is within 1% of perfect and far below round-robin's."""
  lengths = _skewed_lengths()
  costs = balance.sequence_costs(lengths, a=1.0, b=b)
  kk = balance.imbalance(costs, balance.karmarkar_karp(costs, 8, equal_size=True))
  rr = balance.imbalance(costs, balance.round_robin(len(costs), 8))
  record_property("kk_max_min_ratio", kk)
  record_property("round_robin_max_min_ratio", rr)
  print(f"b={b}: max/min shard cost  KK {kk:.5f}  round-robin {rr:.3f}")
  assert kk < 1.01
  assert kk < rr


def test_every_sequence_is_assigned_exactly_once():
  """Plans with a fixed micro-batch count and with a token budget, on several random batches,
  hold every index once, give every shard the same number of sequences and of micro-batches,
  and keep each micro-batch within the token budget."""
  for seed in range(5):
    lengths = _skewed_lengths(n=96, seed=seed)
    fixed = balance.plan_batch(lengths, 4, micro_batches=3, b=1e-3)
    budgeted = balance.plan_batch(lengths, 4, token_budget=int(lengths.max()) + 500)
    for plan in (fixed, budgeted):
      flat = [i for shard in plan.shards for mb in shard for i in mb]
      assert sorted(flat) == list(range(len(lengths)))
      assert {sum(len(mb) for mb in shard) for shard in plan.shards} == {24}
      assert {len(shard) for shard in plan.shards} == {plan.num_micro_batches}
    assert {len(mb) for shard in fixed.shards for mb in shard} == {8}
    for shard in budgeted.shards:
      for mb in shard:
        assert lengths[mb].sum() <= lengths.max() + 500
    for layout in balance.LAYOUTS:
      order = fixed.order(layout)
      assert sorted(order.tolist()) == list(range(len(lengths)))


def test_micro_major_order_matches_train_step_split():
  """Permuting a batch by order("micro_major") and splitting it the way rl/train_step.py does
  ([B] -> [m, B/m], each micro-batch then split evenly over k data shards) puts exactly the
  plan's sequences on each (micro-batch, shard); shard_major puts shard s in rows
  [s*B/k, (s+1)*B/k)."""
  lengths = _skewed_lengths(n=48, seed=3)
  plan = balance.plan_batch(lengths, 4, micro_batches=2, b=1e-3)
  rows = np.arange(len(lengths))[plan.order("micro_major")].reshape(2, 4, 6)
  for m in range(2):
    for s in range(4):
      assert sorted(rows[m, s].tolist()) == sorted(plan.shards[s][m])
  rows = np.arange(len(lengths))[plan.order("shard_major")].reshape(4, 12)
  for s in range(4):
    assert sorted(rows[s].tolist()) == sorted(i for mb in plan.shards[s] for i in mb)


def test_token_budget_uses_few_micro_batches_and_balances_them():
  """A token budget gives the fewest micro-batches that fit (within one of the lower bound
  ceil(shard tokens / budget)), and no micro-batch holds more than 2% over the larger of
  its shard's mean micro-batch and its shard's longest sequence."""
  lengths = _skewed_lengths(n=256, seed=1)
  budget = 8192
  plan = balance.plan_batch(lengths, 8, token_budget=budget)
  lower = max(-(-int(lengths[sum(shard, [])].sum()) // budget) for shard in plan.shards)
  assert lower <= plan.num_micro_batches <= lower + 1
  for shard in plan.shards:
    tokens = [int(lengths[mb].sum()) for mb in shard]
    assert max(tokens) <= budget
    floor = max(np.mean(tokens), lengths[sum(shard, [])].max())
    assert max(tokens) <= 1.02 * floor


def test_bad_inputs_fail_with_a_message():
  """A sequence longer than the budget is named; counts that cannot split equally, negative
  lengths, both or neither of micro_batches / token_budget, and a micro_major order of
  unequal micro-batches are refused."""
  with pytest.raises(ValueError, match="sequence 2 has 900 tokens"):
    balance.plan_batch(np.array([10, 20, 900, 30]), 2, token_budget=500)
  with pytest.raises(ValueError, match="do not split into 4 equal"):
    balance.karmarkar_karp([1.0, 2.0, 3.0], 4, equal_size=True)
  with pytest.raises(ValueError, match="non-negative"):
    balance.sequence_costs([3, -1])
  with pytest.raises(ValueError, match="exactly one"):
    balance.plan_batch([1, 2], 2, micro_batches=1, token_budget=4)
  plan = balance.BalancePlan([[[0], [1, 2]], [[3, 4], [5]]])
  with pytest.raises(ValueError, match="equal size"):
    plan.order("micro_major")


def test_cost_coefficients_match_train_flops():
  """For dense causal attention a*L + b*L^2 equals the FLOPs model exactly; under DSA it is
  within 2% once L is well past index_topk."""
  dense = get_config("tiny_dense")
  a, b = flops.cost_coefficients(dense)
  for length in (1, 37, 256):
    want = flops.train_flops(dense, [length])["total"]
    assert a * length + b * length**2 == pytest.approx(want, rel=1e-12)
  dsa = get_config("tiny_moe_mla_dsa")
  a, b = flops.cost_coefficients(dsa)
  want = flops.train_flops(dsa, [200])["total"]
  assert a * 200 + b * 200**2 == pytest.approx(want, rel=0.02)
