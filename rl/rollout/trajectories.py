"""Prompts in, `Trajectories` out: the batch front of the rollout engine (rl/rollout/engine.py).

  prompt_batch              ragged prompts (or ids + lengths) -> one bucketed [B, P] batch, with
                            the checks every prompt must pass (non-empty, within max_prompt_len)
  generate                  `num_samples` responses per prompt through `engine.run_engine`, rows
                            grouped by prompt, as `Trajectories` (optionally with loop statistics)
  trajectories_from_engine  fresh engine output (context = prompt) wrapped as `Trajectories`

The engine is called through its module (`engine.run_engine`), so a stand-in engine patched onto
rl.rollout.engine serves these functions too.
"""

from __future__ import annotations

import functools
from typing import Sequence

import numpy as np

from models.tokenizer import pad_batch
from rl.core.types import Trajectories
from rl.rollout import engine


def prompt_batch(prompts, cfg: engine.RolloutConfig) -> tuple[np.ndarray, np.ndarray]:
  """Ragged prompts (list of id lists) or (ids [B, P], lens [B]) -> bucketed (ids, lens)."""
  if (isinstance(prompts, tuple) and len(prompts) == 2 and np.ndim(prompts[0]) == 2
      and np.ndim(prompts[1]) == 1):
    ids, lens = np.asarray(prompts[0], np.int32), np.asarray(prompts[1], np.int32)
    sequences = [list(row[:length]) for row, length in zip(ids, lens)]
  else:
    sequences = [list(p) for p in prompts]
  if not sequences:
    raise ValueError("generate needs at least one prompt")
  empty = [i for i, s in enumerate(sequences) if not s]
  if empty:
    raise ValueError(f"prompts {empty[:5]} are empty: every prompt needs at least one token")
  if cfg.max_prompt_len:
    longest = max(len(s) for s in sequences)
    if longest > cfg.max_prompt_len:
      raise ValueError(f"a prompt of {longest} tokens exceeds RolloutConfig.max_prompt_len="
                       f"{cfg.max_prompt_len}")
    return pad_batch(sequences, length=cfg.max_prompt_len, pad_id=cfg.pad_id)
  return pad_batch(sequences, multiple_of=cfg.prompt_bucket, pad_id=cfg.pad_id)


def generate(graphdef, state, prompts: Sequence[Sequence[int]] | tuple[np.ndarray, np.ndarray],
             rng, cfg: engine.RolloutConfig, *, num_samples: int = 1, policy_version: int = 0,
             stop_ids: Sequence[Sequence[int]] | None = None,
             max_new_tokens: Sequence[int] | None = None, mesh=None,
             return_stats: bool = False):
  """Samples `num_samples` responses per prompt and returns them as `Trajectories`.

  Rows are grouped by prompt (the G samples of prompt i are rows i*G .. i*G+G-1, group_id i);
  sequence n draws from the RNG stream fold_in(rng, n), so the result does not depend on
  `cfg.batch_size` (continuous vs static batching). A prompt is prefilled once for its
  `num_samples` rows (`engine.run_engine`'s group_size). Per prompt, `stop_ids[i]` adds stop ids to
  cfg.stop_ids and `max_new_tokens[i]` (<= cfg.max_new_tokens) caps the response length. With
  `return_stats` also returns {"decode_steps", "prefill_calls", "generated_tokens",
  "slot_utilisation"}.
  """
  if num_samples <= 0:
    raise ValueError(f"num_samples={num_samples}: must be positive")
  ids, lens = prompt_batch(prompts, cfg)
  limit = np.full((len(ids),), cfg.max_new_tokens, np.int32)
  if max_new_tokens is not None:
    limit = np.asarray(max_new_tokens, np.int32)
    if limit.shape != (len(ids),) or limit.min() < 1 or limit.max() > cfg.max_new_tokens:
      raise ValueError(f"max_new_tokens needs one value in [1, {cfg.max_new_tokens}] per "
                       f"prompt ({len(ids)}), got {limit.tolist()}")
  if stop_ids is not None and len(stop_ids) != len(ids):
    raise ValueError(f"stop_ids needs one list per prompt ({len(ids)}), got {len(stop_ids)}")
  repeat = functools.partial(np.repeat, repeats=num_samples, axis=0)
  ids, lens, limit = repeat(ids), repeat(lens), repeat(limit)
  row_stop_ids = None if stop_ids is None else [s for s in stop_ids for _ in range(num_samples)]
  out = engine.run_engine(graphdef, state, ids, lens, rng, cfg, max_new=limit,
                          stop_ids=row_stop_ids, mesh=mesh, group_size=num_samples)
  traj = trajectories_from_engine(out, lens, policy_version=policy_version,
                                  group_id=repeat(np.arange(len(ids) // num_samples)),
                                  max_new_tokens=limit)
  if not return_stats:
    return traj
  steps = int(out["decode_steps"])
  generated = int(np.asarray(out["new_count"]).sum())
  return traj, {"decode_steps": steps, "prefill_calls": int(out["prefill_calls"]),
                "generated_tokens": generated,
                "slot_utilisation": generated / max(steps * out["slots"], 1)}


def trajectories_from_engine(out: dict, prompt_lens: np.ndarray, *, policy_version: int,
                             group_id: np.ndarray, max_new_tokens: np.ndarray) -> Trajectories:
  """Wraps fresh engine output (context = prompt) as `Trajectories`; max_new_tokens [N] is
  each row's length cap (a row that reached it without a stop id is truncated)."""
  new_count = np.asarray(out["new_count"])
  stopped = np.asarray(out["stopped"])
  return Trajectories(
      tokens=out["tokens"],
      prompt_lens=np.asarray(prompt_lens, np.int32),
      response_mask=out["response_mask"],
      logp_old=out["logp_old"],
      policy_version=np.full(out["tokens"].shape, policy_version, np.int32),
      group_id=np.asarray(group_id, np.int32),
      finished=stopped,
      truncated=~stopped & (new_count >= max_new_tokens),
      routing=out.get("routing"),
      kept_ids=out.get("kept_ids"),
  )
