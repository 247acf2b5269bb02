"""The rollout engine's batching arithmetic (rl/core/batching.py), hand-computed."""

import pytest

from rl.core.batching import batching


def test_static_batching_prefills_each_prompt_once():
  """No slot count: one slot per sequence, one refill of every row, and with groups of 16 that
  refill prefills 2048 / 16 = 128 prompts."""
  assert batching(0, 0, 2048, group_size=16) == dict(
      slots=2048, padded=2048, refill_rows=2048, refill_contexts=128)
  assert batching(0, 0, 2048)["refill_contexts"] == 2048


def test_a_continuous_refill_may_straddle_one_more_group():
  """512 slots refilled 128 rows at a time: rows [q, q + 128) cover 8 groups of 16 when q is a
  multiple of 16 and 9 otherwise; the engine sizes its prefill for 9. A refill of 3 rows in
  groups of 4 touches at most 2 prompts; slots round up to the row shards."""
  assert batching(512, 128, 2048, group_size=16) == dict(
      slots=512, padded=2048, refill_rows=128, refill_contexts=9)
  assert batching(3, 3, 20, group_size=4)["refill_contexts"] == 2
  assert batching(3, 0, 20, group_size=4)["refill_contexts"] == 1
  assert batching(510, 0, 2048, row_shards=4)["slots"] == 512


def test_groups_must_divide_the_sequences():
  with pytest.raises(ValueError, match="group_size=3: must divide the 20 sequences"):
    batching(0, 0, 20, group_size=3)
