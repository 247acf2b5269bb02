"""The test-case generator (TCG): a policy that reads a question and its reference solution and
writes input/output test cases, trained by SFT then DPO, and measured in the sandbox.

Format. Prompt: "Question: ...", "Solution:" and the code, then "Test cases:"; response: one
case a line, `in: <stdin> | out: <expected stdout>` (`format_cases` / `parse_cases`).

Training (O1-Coder's two stages):
  1. SFT on cases made by the task's trusted generator (random inputs, correct outputs);
  2. DPO (rl/jobs/preference.py `train_dpo`) on pairs whose chosen response is matched cases and
     whose rejected response has the same inputs with the outputs shuffled among them, so every
     rejected case pairs an input with another input's output.

Metric. Greedy generation on held-out tasks; every parsed case is validated by running the
reference solution on its input in the sandbox; the TCG metric is the fraction of generated
cases whose output the reference reproduces (`tcg_metric`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from rl.rollout import engine as rollout_lib
from rl.rollout import trajectories
from rl.jobs.preference import PreferencePair, train_dpo
from rl.rewards import code as code_reward
from rl.o1_coder.finetune import supervised_finetune
from rl.o1_coder.tasks import CodingTask

_CASE = re.compile(r"^in: (.*?) \| out: (.*)$")


def tcg_prompt(task: CodingTask) -> str:
  return f"Question: {task.question}\nSolution:\n{task.reference_solution}\nTest cases:\n"


def format_cases(cases: Sequence[tuple[str, str]]) -> str:
  return "\n".join(f"in: {stdin} | out: {stdout}" for stdin, stdout in cases)


def parse_cases(text: str) -> list[tuple[str, str]]:
  """The well-formed `in: ... | out: ...` lines of a response, in order."""
  return [match.groups() for line in text.split("\n") if (match := _CASE.match(line.strip()))]


def sft_pairs(tasks: Sequence[CodingTask], *, per_task: int, cases: int, seed: int
              ) -> list[tuple[str, str]]:
  """(prompt, response) pairs: `per_task` sets of `cases` generated cases per task."""
  return [(tcg_prompt(task), format_cases(task.test_cases(cases, seed=seed + 1000 * draw)))
          for task in tasks for draw in range(per_task)]


def shuffled_outputs(cases: Sequence[tuple[str, str]], rng: np.random.Generator
                     ) -> list[tuple[str, str]] | None:
  """The same inputs with the outputs permuted so that no case keeps a matching output;
  None when the outputs cannot all be moved (fewer than two distinct outputs)."""
  outputs = [stdout for _, stdout in cases]
  if len(set(outputs)) < 2:
    return None
  for _ in range(100):
    permuted = [outputs[i] for i in rng.permutation(len(outputs))]
    if all(new != old for new, old in zip(permuted, outputs)):
      return [(stdin, stdout) for (stdin, _), stdout in zip(cases, permuted)]
  return None


def preference_pairs(tasks: Sequence[CodingTask], *, per_task: int, cases: int, seed: int
                     ) -> list[PreferencePair]:
  """DPO pairs: matched cases chosen, the same cases with shuffled outputs rejected."""
  rng = np.random.default_rng(seed)
  pairs = []
  for task in tasks:
    for draw in range(per_task):
      matched = task.test_cases(cases, seed=seed + 1000 * draw)
      rejected = shuffled_outputs(matched, rng)
      if rejected is not None:
        pairs.append(PreferencePair(tcg_prompt(task), format_cases(matched),
                                    format_cases(rejected)))
  return pairs


def generate_cases(model, tokenizer, tasks: Sequence[CodingTask], *, max_new_tokens: int = 96,
                   seed: int = 0) -> list[list[tuple[str, str]]]:
  """Greedy test cases for each task, parsed."""
  graphdef, state = nnx.split(model)
  config = rollout_lib.RolloutConfig(max_new_tokens=max_new_tokens, greedy=True,
                                     stop_ids=tuple(tokenizer.stop_ids), prompt_bucket=16,
                                     pad_id=tokenizer.pad_id)
  prompts = [tokenizer.encode(tcg_prompt(task)) for task in tasks]
  traj = trajectories.generate(graphdef, state, prompts, jax.random.key(seed), config)
  tokens = np.asarray(traj.tokens)
  mask = np.asarray(traj.response_mask).astype(bool)
  return [parse_cases(tokenizer.decode(tokens[row][mask[row]])) for row in range(len(tasks))]


def tcg_metric(tasks: Sequence[CodingTask], generated: Sequence[Sequence[tuple[str, str]]], *,
               workers: int = 2, timeout_s: float = 5.0) -> dict[str, float]:
  """Runs each task's reference solution on its generated inputs in the sandbox, each case
  under a `timeout_s` wall-clock limit (sandbox start and Python start-up included).

  Returns `tcg_pass_rate` (generated cases whose output the reference reproduces / generated
  cases), `cases_per_task` (parsed cases per task) and `tasks_all_valid` (tasks with at least
  one case, all valid).
  """
  with_cases = [(task, cases) for task, cases in zip(tasks, generated) if cases]
  total = sum(len(cases) for _, cases in with_cases)
  results = code_reward.grade_batch(
      [task.reference_solution for task, _ in with_cases],
      [code_reward.CodeProblem(tests=tuple(code_reward.StdioTest(stdin, stdout)
                                           for stdin, stdout in cases), timeout_s=timeout_s)
       for _, cases in with_cases], workers=workers) if with_cases else []
  passed = sum(result.num_passed for result in results)
  return {"tcg_pass_rate": passed / total if total else 0.0,
          "cases_per_task": total / max(len(tasks), 1),
          "tasks_all_valid": sum(result.all_passed for result in results) / max(len(tasks), 1)}


def train_tcg(model, tokenizer, train_tasks: Sequence[CodingTask],
              heldout_tasks: Sequence[CodingTask], *, cases: int = 3, sft_per_task: int = 8,
              sft_steps: int = 300, dpo_per_task: int = 4, dpo_steps: int = 100,
              batch_size: int = 16, lr: float = 2e-3, dpo_lr: float = 1e-4,
              beta: float = 0.1, seed: int = 0) -> tuple[nnx.Module, dict[str, float]]:
  """SFT then DPO; returns the generator and metrics: SFT losses, DPO held-out pair accuracy,
  and the TCG metric on held-out tasks after SFT (`sft/...`) and after DPO (`dpo/...`)."""
  generator, sft_metrics = supervised_finetune(
      model, tokenizer, sft_pairs(train_tasks, per_task=sft_per_task, cases=cases, seed=seed),
      steps=sft_steps, batch_size=batch_size, lr=lr, seed=seed)
  metrics = {"sft/train_loss_start": sft_metrics["train_loss_start"],
             "sft/train_loss_end": sft_metrics["train_loss_end"]}
  metrics.update({f"sft/{k}": v for k, v in tcg_metric(
      heldout_tasks, generate_cases(generator, tokenizer, heldout_tasks, seed=seed)).items()})
  generator, dpo_metrics = train_dpo(
      generator, tokenizer,
      preference_pairs(train_tasks, per_task=dpo_per_task, cases=cases, seed=seed + 1),
      preference_pairs(heldout_tasks, per_task=1, cases=cases, seed=seed + 2),
      beta=beta, steps=dpo_steps, batch_size=batch_size, lr=dpo_lr, seed=seed)
  metrics.update({"dpo/heldout_accuracy_start": dpo_metrics["heldout_accuracy_start"],
                  "dpo/heldout_accuracy": dpo_metrics["heldout_accuracy"]})
  metrics.update({f"dpo/{k}": v for k, v in tcg_metric(
      heldout_tasks, generate_cases(generator, tokenizer, heldout_tasks, seed=seed)).items()})
  return generator, metrics
