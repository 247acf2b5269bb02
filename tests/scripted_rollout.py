"""Scripted sampler output for trainer tests: responses are a training entry's gold solution
(correct) or a wrong answer, so the trainer's real verifier, advantages and update see known
outcomes."""

import numpy as np

from models.tokenizer import load_tokenizer
from rl.core.types import Trajectories

WRONG = "0 Answer: -999"


def scripted_trajectories(trainer, picks, truncated=None):
  """(Trajectories, entries): one row per (entry index, correct, group id) of `picks`, prompt
  from `trainer.task.train_prompts`, response the entry's solution or WRONG, then EOS; `truncated`
  (default none) marks rows cut at the length limit."""
  task, tok = trainer.task, load_tokenizer(trainer.config.tokenizer)
  rows = [(task.train_prompts[i], tok.encode(task.train_entries[i]["solution"] if ok
                                             else WRONG) + [tok.eos_id])
          for i, ok, _ in picks]
  width = max(len(p) + len(r) for p, r in rows)
  tokens = np.zeros((len(rows), width), np.int32)
  mask = np.zeros((len(rows), width), np.float32)
  for n, (p, r) in enumerate(rows):
    tokens[n, :len(p) + len(r)] = p + r
    mask[n, len(p):len(p) + len(r)] = 1
  trunc = np.zeros(len(rows), bool) if truncated is None else np.asarray(truncated)
  traj = Trajectories(tokens=tokens, prompt_lens=np.array([len(p) for p, _ in rows]),
                      response_mask=mask, logp_old=np.zeros_like(mask),
                      policy_version=np.zeros_like(tokens),
                      group_id=np.array([g for _, _, g in picks]), finished=~trunc,
                      truncated=trunc)
  return traj, [task.train_entries[i] for i, _, _ in picks]
