"""Rejection sampling with the rollout engine: N samples per training prompt from one of our
checkpoints, graded by the run's verifiers (rl/rewards/manager.py), the correct ones written as
an SFT prompt-record file (the rule itself is rl/data/selection.py::rejection_sample).
`launch/rejection_sample.py` is the command line."""

from __future__ import annotations

import time

import jax
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from configs import common
from models.tokenizer import load_tokenizer
from rl import evaluation
from rl import rollout as rollout_lib
from rl.data import selection
from rl.data.entries import encode_prompts, load_entries, prompt_of
from rl.rewards import manager


def sample_and_keep(config: ml_collections.ConfigDict, checkpoint: str, *, n: int, out_path: str,
                    limit: int = 0, batch_prompts: int = 64, seed: int = 0) -> dict[str, int]:
  """Rejection-samples the config's training prompts from an orbax checkpoint of ours (SFT or
  RL); returns rl.data.selection.rejection_sample's counts."""
  common.validate(config)
  model, step = evaluation.load_policy_checkpoint(config, checkpoint)
  graphdef, state = nnx.split(model)
  tokenizer = load_tokenizer(config.tokenizer)
  entries, _ = load_entries(config)
  if limit:
    entries = entries[:limit]
  records = [{"prompt": prompt_of(e), **e} for e in entries]
  index_of = {id(r): i for i, r in enumerate(records)}
  prompt_ids = encode_prompts(entries, tokenizer, config.data.prompt_template)
  cfg = rollout_lib.RolloutConfig(
      max_new_tokens=config.rollout.max_new_tokens, temperature=config.rollout.temperature,
      top_p=config.rollout.top_p, top_k=config.rollout.top_k, greedy=False,
      stop_ids=tuple(tokenizer.stop_ids), prompt_bucket=config.rollout.prompt_bucket,
      pad_id=tokenizer.pad_id)
  calls = [0]
  t0 = time.perf_counter()

  def generate_fn(batch, num):
    rng = jax.random.fold_in(jax.random.key(seed), calls[0])
    calls[0] += 1
    traj = rollout_lib.generate(graphdef, state, [prompt_ids[index_of[id(r)]] for r in batch],
                                rng, cfg, num_samples=num)
    tokens, mask = np.asarray(traj.tokens), np.asarray(traj.response_mask).astype(bool)
    texts = [tokenizer.decode(tokens[i][mask[i]]) for i in range(len(tokens))]
    logging.info("rejection sampling: %d/%d prompts sampled (%.0f s)",
                 min(calls[0] * batch_prompts, len(records)), len(records),
                 time.perf_counter() - t0)
    return [texts[i * num:(i + 1) * num] for i in range(len(batch))]

  def verify_fn(batch_records, responses):
    return manager.score_responses(batch_records, responses)

  logging.info("rejection sampling %d prompts x %d samples from %s (step %d)", len(records), n,
               checkpoint, step)
  return selection.rejection_sample(records, generate_fn, verify_fn, n=n, out_path=out_path,
                                    batch_size=batch_prompts)
