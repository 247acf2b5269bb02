"""How the rollout engine (rl/rollout/engine.py) batches one call's sequences: its decode slots,
and the rows and distinct prompts one refill prefills. The engine, the dry run and the planner
(through rl/parallel/placement.py) read it from here."""

from __future__ import annotations

from models.padding import round_up


def batching(batch_size: int, prefill_batch: int, sequences: int, *, group_size: int = 1,
             row_shards: int = 1, rows: int | None = None) -> dict[str, int]:
  """One engine call over `sequences` rows in groups of `group_size` sharing a context, with
  slots and rows split over `row_shards`: `slots` (rollout.batch_size, 0: one per sequence),
  the `padded` row count, the `refill_rows` one refill takes (rollout.prefill_batch, 0: a
  quarter of the slots) and the distinct contexts it prefills (`refill_contexts`)."""
  if group_size < 1 or sequences % group_size:
    raise ValueError(f"group_size={group_size}: must divide the {sequences} sequences")
  slots = round_up(batch_size or sequences, row_shards)
  padded = round_up(max(sequences, slots, rows or 0), slots)
  # Static batching prefills every prompt in one call; continuous batching refills a few
  # slots at a time (the first fill then takes slots / R calls of the same compiled prefill).
  refill_rows = slots if padded <= slots else min(slots, prefill_batch or max(1, slots // 4))
  # One refill takes sequences [q, q + R): ceil(R / G) contexts when q = 0 (static batching's
  # single refill), at most one more when q falls inside a group.
  contexts = -(-refill_rows // group_size) if refill_rows >= padded else (
      (refill_rows + group_size - 2) // group_size + 1)
  return dict(slots=slots, padded=padded, refill_rows=refill_rows,
              refill_contexts=min(refill_rows, contexts))
