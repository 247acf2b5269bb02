"""Rewards and metrics of tool-use episodes, per environment.

The reward of an episode is its environment's verifier applied to the final answer (the last
`Answer:` line of its last assistant turn, read by `rl.rewards.extract.answer_line`), optionally
mixed with a rubric-based generative judge: reward = (1 - w) * verified + w * P(YES | rubric,
task, transcript), where the judge is a `rl.rewards.genrm.GenerativeRM` asked whether the
transcript meets the environment's rubric.
`acc` stays the verifier's 0/1 result (dynamic sampling and success rates read it).

Metrics per environment: success (verifier), turns, tool calls and tool errors per episode, the
share of episodes ended by the turn limit or the token budget, and the judge's mean score.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rl.rewards import extract
from rl.tool_use import environments

RUBRIC_QUESTION = "Does the transcript satisfy the rubric? Answer YES or NO."


def last_turn_text(tokens: np.ndarray, response_mask: np.ndarray, tokenizer) -> str:
  """Text of the last run of policy tokens in a row (the final assistant turn)."""
  positions = np.flatnonzero(response_mask)
  if positions.size == 0:
    return ""
  gaps = np.flatnonzero(np.diff(positions) > 1)
  start = positions[gaps[-1] + 1] if gaps.size else positions[0]
  return tokenizer.decode(tokens[start:positions[-1] + 1])


def rubric_prompt(rubric: str, task_prompt: str, transcript: str) -> str:
  """The judge's prompt; its next token is YES or NO (rl/rewards/genrm.py)."""
  return (f"[Rubric]\n{rubric}\n\n[Task]\n{task_prompt}\n\n[Transcript]\n{transcript}\n\n"
          f"{RUBRIC_QUESTION}\n")


@functools.cache
def load_judge(hf_dir: str):
  """A generative judge from a local HF checkpoint (loaded once per process)."""
  from models import hf
  from models.tokenizer import load_tokenizer
  from rl.rewards.genrm import GenerativeRM
  return GenerativeRM(hf.load_pretrained(hf_dir), load_tokenizer(hf_dir))


def score_episodes(traj, entries: Sequence[Mapping[str, Any]], tokenizer, *, judge=None,
                   judge_weight: float = 0.0) -> dict[str, np.ndarray]:
  """Per row: acc (verifier), reward (mixed), judge, env, turns, tool_calls, tool_errors, end.

  `entries[i]` is row i's environment entry with its rollout info under "episode".
  """
  tokens = np.asarray(traj.tokens)
  mask = np.asarray(traj.response_mask).astype(bool)
  acc = np.zeros(len(entries), np.float32)
  for i, entry in enumerate(entries):
    answer = extract.answer_line(last_turn_text(tokens[i], mask[i], tokenizer))
    if answer is not None:
      acc[i] = environments.get(entry["env"]).verify(entry["env_task"], answer)
  judged = np.zeros(len(entries), np.float32)
  if judge is not None and judge_weight:
    prompt_lens = np.asarray(traj.prompt_lens)
    transcripts = [tokenizer.decode(tokens[i, prompt_lens[i]:]) for i in range(len(entries))]
    judged = judge.p_yes([rubric_prompt(environments.get(e["env"]).rubric, e["prompt"], t)
                          for e, t in zip(entries, transcripts)]).astype(np.float32)
  info = [e["episode"] for e in entries]
  return {
      "acc": acc,
      "reward": ((1.0 - judge_weight) * acc + judge_weight * judged).astype(np.float32),
      "judge": judged,
      "env": np.array([e["env"] for e in entries]),
      "turns": np.array([x["turns"] for x in info], np.float32),
      "tool_calls": np.array([x["tool_calls"] for x in info], np.float32),
      "tool_errors": np.array([x["tool_errors"] for x in info], np.float32),
      "end": np.array([x["end"] for x in info]),
  }


def episode_metrics(scored: Mapping[str, np.ndarray]) -> dict[str, float]:
  """`tools/<env>/<metric>` means over the rows of each environment."""
  metrics = {}
  for env in sorted(set(scored["env"].tolist())):
    rows = scored["env"] == env
    prefix = f"tools/{env}/"
    metrics[prefix + "success"] = float(scored["acc"][rows].mean())
    for key in ("turns", "tool_calls", "tool_errors", "judge"):
      metrics[prefix + key] = float(scored[key][rows].mean())
    for end in ("turn_limit", "length"):
      metrics[prefix + f"{end}_rate"] = float((scored["end"][rows] == end).mean())
  return metrics
