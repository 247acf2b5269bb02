"""O1-Coder self-play: RL of the policy on the aggregated outcome + process reward, and the
iterate loop (search -> D_process -> PRM -> RL -> search again with the updated policy).

Reward (spec section 9). For a sampled path with steps 1..m, outcome R (the terminal value
v = a * compiled + (1 - a) * pass_rate of its code) and PRM step scores r_1..r_m,

    phi = alpha(t) * R + (1 - alpha(t)) * (1/m) * sum_j gamma^(j-1) r_j,

with alpha(t) moving linearly from `alpha_start` to `alpha_end` over the RL steps (a path with
no steps gets phi = alpha * R). phi is the sequence score of a GRPO group (`rl/core/advantages.py`),
and the update is the trainer's jitted PPO-family step (`rl/core/train_step.py`).

`run(config, workdir)` is the whole small pipeline of configs/o1_coder.py: TCG (SFT, DPO, its
metric); a bootstrap policy fine-tuned on templated paths (the stand-in for a pretrained model
that can already write plan -> refine -> code steps, so the first search finds anything), pass
rates before; then `config.o1.iterations` rounds of MCTS data synthesis, PRM fit and RL, where
the first round also initialises the policy as O1-Coder section 3.3 does, by SFT on the
search's correct paths D+; pass rates after, all written to <workdir>/results.json. Its settings
are config.o1 (fields, defaults and meaning: rl/config/defaults.py base_config; ranges:
rl/config/validation.py).

The run saves its models under <workdir>/models/ (orbax): `tcg`, `prm` (the latest fit) and
`policy` (after the D+ warm start and after each round's RL); `load_model` / `load_prm` read
them back. A run starts over in its workdir: models of an earlier run there are replaced.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from models.tokenizer import load_tokenizer
from models.transformer import Transformer
from rl.config.defaults import base_config
from rl.config.describe import leaves
from rl.core.policy import model_config
from rl.config.validation import validate
from rl.core import advantages as adv_lib
from rl.core import algorithms
from rl.rollout import engine as rollout_lib
from rl.rollout import trajectories
from rl.core import train_step as ts
from rl.jobs.checkpoint import Checkpointer
from rl.rewards import code as code_reward
from rl.rewards.genrm import BradleyTerryRM, split_model
from rl.o1_coder import mcts, prm as prm_lib, reasoning, tcg
from rl.o1_coder.finetune import supervised_finetune
from rl.o1_coder.tasks import (CodingTask, distractor_trace, program_of, reasoning_trace,
                             split_steps, split_tasks)

# ----------------------------------------------------------------------------- Reward


def alpha_schedule(step: int, total_steps: int, *, start: float, end: float) -> float:
  """alpha(t): linear from `start` at step 0 to `end` at the last step (clamped)."""
  if total_steps <= 1:
    return float(start)
  fraction = min(max(step / (total_steps - 1), 0.0), 1.0)
  return float(start + (end - start) * fraction)


def aggregated_reward(outcome_B: jax.Array, step_scores_BM: jax.Array, step_mask_BM: jax.Array,
                      *, alpha: float, gamma: float) -> jax.Array:
  """phi_B = alpha * R + (1 - alpha) * mean_j gamma^(j-1) r_j over each row's real steps."""
  mask = jnp.asarray(step_mask_BM, jnp.float32)
  discount_M = gamma ** jnp.arange(mask.shape[1], dtype=jnp.float32)
  steps_B = jnp.sum(mask, axis=-1)
  process_B = jnp.sum(discount_M * step_scores_BM * mask, axis=-1) / jnp.maximum(steps_B, 1.0)
  return alpha * jnp.asarray(outcome_B, jnp.float32) + (1.0 - alpha) * process_B


def pad_scores(scores: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
  """Ragged per-path step scores -> (scores [B, M], mask [B, M]), M >= 1."""
  width = max([1] + [len(s) for s in scores])
  padded = np.zeros((len(scores), width), np.float32)
  mask = np.zeros((len(scores), width), np.float32)
  for row, s in enumerate(scores):
    padded[row, :len(s)], mask[row, :len(s)] = s, 1.0
  return padded, mask


# ----------------------------------------------------------------------------- Grading


@dataclasses.dataclass
class Grader:
  """Grades reasoning paths of tasks on fixed per-task tests; caches by (task, program)."""

  tests: dict[CodingTask, list[tuple[str, str]]]
  compile_weight: float
  workers: int = 2

  def __post_init__(self):
    self.cache: dict[tuple[CodingTask, str], tuple[float, bool]] = {}

  def problem(self, task: CodingTask) -> code_reward.CodeProblem:
    return code_reward.CodeProblem(tests=tuple(code_reward.StdioTest(i, o)
                                               for i, o in self.tests[task]), timeout_s=2.0)

  def grade(self, tasks: Sequence[CodingTask], paths: Sequence[Sequence[str]]
            ) -> tuple[np.ndarray, np.ndarray]:
    """(terminal value v [B], all tests passed [B]); a path without code gets (0, False)."""
    programs = [program_of(path) for path in paths]
    todo = sorted({(t, p) for t, p in zip(tasks, programs)
                   if p is not None and (t, p) not in self.cache}, key=str)
    if todo:
      results = code_reward.grade_batch([p for _, p in todo], [self.problem(t) for t, _ in todo],
                                        workers=self.workers)
      for key, result in zip(todo, results):
        self.cache[key] = (result.reward(self.compile_weight), result.all_passed)
    graded = [self.cache[(t, p)] if p is not None else (0.0, False)
              for t, p in zip(tasks, programs)]
    return (np.array([v for v, _ in graded], np.float32), np.array([a for _, a in graded]))


# ----------------------------------------------------------------------------- Policy


class SelfPlayPolicy:
  """The policy under RL: its train state, the jitted update and sampling."""

  def __init__(self, model, tokenizer, config: ml_collections.ConfigDict):
    c = config
    self.tokenizer = tokenizer
    self.config = c
    self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
    self.optimizer = ts.make_optimizer(lr=c.optim.lr, warmup_steps=c.optim.warmup_steps,
                                       weight_decay=c.optim.weight_decay,
                                       grad_clip=c.optim.grad_clip, b1=c.optim.b1, b2=c.optim.b2)
    self.state = ts.init_state(params, self.optimizer)
    cfg = model.cfg
    self.update_fn = ts.make_update(
        ts.policy_objective, self.graphdef, self.optimizer, micro_batches=1,
        rl=c.rl.to_dict(), temperature=max(c.rollout.temperature, 1e-6),
        max_len=c.rollout.max_new_tokens, router_aux_loss_coef=cfg.router_aux_loss_coef)
    self.rebalance = (ts.make_rebalance(self.graphdef, cfg.router_bias_rate)
                      if cfg.router_bias_rate else None)
    self.rollout_cfg = rollout_lib.RolloutConfig(
        max_new_tokens=c.rollout.max_new_tokens, temperature=c.rollout.temperature,
        stop_ids=tuple(tokenizer.stop_ids), prompt_bucket=c.rollout.prompt_bucket,
        pad_id=tokenizer.pad_id)

  def model(self) -> nnx.Module:
    return nnx.merge(self.graphdef, self.state.params, self.rest)

  def sample(self, tasks: Sequence[CodingTask], num_samples: int, rng, *, greedy: bool = False):
    """(Trajectories, per-row reasoning paths) of `num_samples` responses per task."""
    cfg = self.rollout_cfg.replace(greedy=greedy)
    prompts = [self.tokenizer.encode(task.prompt) for task in tasks]
    traj = trajectories.generate(self.graphdef, nnx.merge_state(self.state.params, self.rest),
                                 prompts, rng, cfg, num_samples=num_samples)
    tokens = np.asarray(traj.tokens)
    mask = np.asarray(traj.response_mask).astype(bool)
    paths = [split_steps(self.tokenizer.decode(tokens[row][mask[row]]))
             for row in range(len(tokens))]
    return traj, paths

  def pass_rate(self, tasks: Sequence[CodingTask], grader: Grader, *, num_samples: int = 1,
                greedy: bool = True, seed: int = 0) -> float:
    """Fraction of sampled paths whose code passes every test."""
    _, paths = self.sample(tasks, num_samples, jax.random.key(seed), greedy=greedy)
    _, passed = grader.grade([t for t in tasks for _ in range(num_samples)], paths)
    return float(passed.mean())

  def rl_step(self, tasks: Sequence[CodingTask], grader: Grader,
              prm: prm_lib.ProcessRewardModel | None, *, alpha: float, gamma: float,
              rng) -> dict[str, float]:
    """One GRPO step on phi over `samples_per_prompt` paths of each task."""
    group_size = self.config.train.samples_per_prompt
    traj, paths = self.sample(tasks, group_size, rng)
    row_tasks = [t for t in tasks for _ in range(group_size)]
    outcome, passed = grader.grade(row_tasks, paths)
    if prm is None:
      scores, step_mask = pad_scores([np.zeros(0)] * len(paths))
    else:
      scores, step_mask = pad_scores(prm.step_scores([t.prompt for t in row_tasks], paths))
    phi = aggregated_reward(outcome, scores, step_mask, alpha=alpha, gamma=gamma)
    response_mask = np.asarray(traj.response_mask, np.float32)
    advantages = adv_lib.grpo(phi, jnp.asarray(traj.group_id))
    tokens = np.asarray(traj.tokens)
    total_len = np.asarray(traj.prompt_lens) + response_mask.sum(-1)
    batch = {
        "tokens": tokens, "response_mask": response_mask,
        "attention_mask": (np.arange(tokens.shape[1])[None] < total_len[:, None]).astype(
            np.float32),
        "logp_old": np.asarray(traj.logp_old, np.float32),
        "acc": passed.astype(np.float32),
        "advantages": np.asarray(advantages)[:, None] * response_mask,
    }
    self.state, metrics = self.update_fn(self.state, self.rest,
                                         {k: jnp.asarray(v) for k, v in batch.items()})
    metrics = jax.device_get(metrics)
    router_load = metrics.pop("router_load", None)
    if router_load is not None:
      metrics.update(ts.load_metrics(router_load))
      if self.rebalance is not None and not metrics["skipped"]:
        self.rest = self.rebalance(self.state.params, self.rest, router_load)
    metrics = {k: float(v) for k, v in metrics.items()}
    process = (scores * step_mask).sum(-1) / np.maximum(step_mask.sum(-1), 1.0)
    return {**metrics, "outcome": float(outcome.mean()), "pass_rate": float(passed.mean()),
            "process_score": float(process.mean()), "phi": float(np.mean(phi)), "alpha": alpha}


# ----------------------------------------------------------------------------- Loop


def warm_start_pairs(tasks: Sequence[CodingTask], *, size: int, distractor_fraction: float,
                     seed: int) -> list[tuple[str, str]]:
  """SFT data for the policy: templated paths, `distractor_fraction` of them wrong ones."""
  rng = np.random.default_rng(seed)
  pairs = []
  for _ in range(size):
    task = tasks[rng.integers(len(tasks))]
    wrong = rng.random() < distractor_fraction
    pairs.append((task.prompt, distractor_trace(task, rng) if wrong else reasoning_trace(task)))
  return pairs


def tests_from_tcg(tasks: Sequence[CodingTask], generated: Sequence[Sequence[tuple[str, str]]],
                   *, fallback: int, seed: int) -> tuple[dict, float]:
  """Per task, the generated cases its reference solution reproduces (outputs taken from the
  generator, checked in the sandbox); tasks left with none fall back to `fallback` trusted
  generator cases. Returns (tests by task, fraction of tasks that fell back)."""
  tests, fallbacks = {}, 0
  candidates = [(task, cases) for task, cases in zip(tasks, generated) if cases]
  results = code_reward.grade_batch(
      [task.reference_solution for task, _ in candidates],
      [code_reward.CodeProblem(tests=tuple(code_reward.StdioTest(i, o) for i, o in cases),
                               timeout_s=2.0) for _, cases in candidates]) if candidates else []
  valid = {task: [case for case, outcome in zip(cases, result.outcomes) if outcome.passed]
           for (task, cases), result in zip(candidates, results)}
  for task in tasks:
    if valid.get(task):
      tests[task] = valid[task]
    else:
      tests[task] = task.test_cases(fallback, seed)
      fallbacks += 1
  return tests, fallbacks / max(len(tasks), 1)


def dplus_pairs(correct: Sequence[tuple[CodingTask, str]]) -> list[tuple[str, str]]:
  """O1-Coder's D+ as SFT data: (task prompt, a correct reasoning path the search found)."""
  return [(task.prompt, path) for task, path in correct]


def _model(config: ml_collections.ConfigDict, *, head: str, seed: int) -> Transformer:
  cfg = model_config(config)
  if head == "scalar":
    cfg = cfg.replace(head="scalar", tie_embeddings=False)
  return Transformer(cfg, rngs=nnx.Rngs(params=seed))


# ----------------------------------------------------------------------------- Saved models

MODEL_HEADS = {"tcg": "lm", "prm": "scalar", "policy": "lm"}


def save_model(workdir: str, name: str, model, *, step: int = 0) -> None:
  """Writes <workdir>/models/<name> (one of MODEL_HEADS): the parameters and the other state
  of an nnx model or a (graphdef, params, rest) split; the latest `step` is kept."""
  if name not in MODEL_HEADS:
    raise ValueError(f"saved model {name!r}: must be one of {sorted(MODEL_HEADS)}")
  _, params, rest = split_model(model)
  ckpt = Checkpointer(os.path.join(workdir, "models", name), keep=1)
  ckpt.save(step, {"params": params, "rest": rest}, {"name": name, "step": step}, force=True)
  ckpt.close()


def load_model(config: ml_collections.ConfigDict, workdir: str, name: str) -> nnx.Module:
  """The model `save_model` wrote under <workdir>/models/<name> in a run of `config`."""
  if name not in MODEL_HEADS:
    raise ValueError(f"saved model {name!r}: must be one of {sorted(MODEL_HEADS)}")
  graphdef, params, rest = nnx.split(_model(config, head=MODEL_HEADS[name], seed=0),
                                     nnx.Param, ...)
  ckpt = Checkpointer(os.path.join(workdir, "models", name), keep=1)
  step = ckpt.latest_step()
  if step is None:
    ckpt.close()
    raise FileNotFoundError(f"no saved {name} model in {ckpt.directory}")
  state, _ = ckpt.restore(step, {"params": params, "rest": rest})
  ckpt.close()
  return nnx.merge(graphdef, state["params"], state["rest"])


def load_prm(config: ml_collections.ConfigDict, workdir: str,
             tokenizer) -> prm_lib.ProcessRewardModel:
  """The run's saved PRM, scoring steps as it did in the run."""
  return prm_lib.ProcessRewardModel(BradleyTerryRM(load_model(config, workdir, "prm"), tokenizer,
                                                   batch_size=2 * config.o1.batch_size))


def warm_start_on_dplus(policy: SelfPlayPolicy, correct: Sequence[tuple[CodingTask, str]],
                        config: ml_collections.ConfigDict) -> tuple[SelfPlayPolicy, dict]:
  """O1-Coder section 3.3's policy initialisation: `config.o1.dplus_sft_steps` of SFT of the
  policy on the search's correct paths D+ (`correct`), then a fresh RL optimiser. Returns the
  policy and metrics (`dplus_paths`, and the SFT losses); an empty D+ leaves the policy as it
  is (warned)."""
  c = config
  if not correct:
    logging.warning("the first search found no correct path: the policy starts RL from the "
                    "bootstrap (D+ is empty)")
    return policy, {"dplus_paths": 0}
  model, metrics = supervised_finetune(policy.model(), policy.tokenizer, dplus_pairs(correct),
                                       steps=c.o1.dplus_sft_steps, batch_size=c.o1.batch_size,
                                       lr=c.sft.lr, seed=c.seed + 1)
  return SelfPlayPolicy(model, policy.tokenizer, c), {"dplus_paths": len(correct), **metrics}


# What self-play reads of a config; every other field must keep its neutral value (the `rl`
# section: rl/core/algorithms.BASE, every RL feature off; the others: base_config's), so a
# setting self-play would ignore (dynamic sampling, a reference model's KL, a critic, a mesh,
# prompt files, ...) is refused rather than silently not run.
SELF_PLAY_READS = (
    "job", "seed", "tokenizer", "kernel_backend", "model.", "o1.",
    "optim.lr", "optim.warmup_steps", "optim.weight_decay", "optim.grad_clip", "optim.b1",
    "optim.b2", "rollout.max_new_tokens", "rollout.temperature", "rollout.prompt_bucket",
    "train.steps", "train.prompts_per_step", "train.samples_per_prompt", "train.log_every",
    "sft.lr", "rl.clip_low", "rl.clip_high", "rl.clip_c", "rl.loss_agg_mode",
    "rl.entropy_coef", "rl.nll_coef", "rl.offpolicy_mask_delta", "rl.indexer_coef")


def refuse_unread(c: ml_collections.ConfigDict) -> None:
  """ValueError naming every field self-play would ignore that is not at its neutral value."""
  neutral = leaves(base_config())
  neutral.update({f"rl.{k}": v for k, v in algorithms.BASE.items()})
  unread = [f"config.{field}={value!r} (self-play: {neutral[field]!r})"
            for field, value in leaves(c).items()
            if not any(field == r or (r.endswith(".") and field.startswith(r))
                       for r in SELF_PLAY_READS) and value != neutral[field]]
  if unread:
    raise ValueError(f"O1-Coder self-play (config.job='o1_coder') does not read "
                     f"{', '.join(unread)}: set them to self-play's values or use the RL trainer")


def tcg_tests(c: ml_collections.ConfigDict, tokenizer, train_tasks: Sequence[CodingTask],
              heldout_tasks: Sequence[CodingTask]):
  """(test-case generator, its metrics, the tests of every task): the TCG trained (SFT, DPO)
  writes the training tasks' tests (a task without a valid generated case falls back to its
  own); held-out tasks are graded on their own cases."""
  o = c.o1
  generator, metrics = tcg.train_tcg(
      _model(c, head="lm", seed=c.seed + 10), tokenizer, train_tasks, heldout_tasks,
      cases=o.tcg_cases, sft_steps=o.tcg_sft_steps, dpo_steps=o.tcg_dpo_steps,
      dpo_lr=o.tcg_dpo_lr, batch_size=o.batch_size, seed=c.seed)
  train_tests, fallback = tests_from_tcg(
      train_tasks, tcg.generate_cases(generator, tokenizer, train_tasks, seed=c.seed),
      fallback=o.tests_per_task, seed=c.seed)
  metrics["train_tasks_without_valid_cases"] = fallback
  tests = dict(train_tests)
  tests.update({task: task.test_cases(o.tests_per_task, c.seed) for task in heldout_tasks})
  return generator, metrics, tests


def search(c: ml_collections.ConfigDict, policy: SelfPlayPolicy, tokenizer, iteration: int,
           tasks: Sequence[CodingTask], grader: Grader) -> list:
  """One iteration's MCTS trees of `tasks`, expanded by the current policy's samples."""
  o = c.o1
  sampler = reasoning.PolicySampler(policy.model(), tokenizer, max_prompt_len=o.search_prompt_len,
                                    max_new_tokens=c.rollout.max_new_tokens,
                                    seed=c.seed + iteration)
  search_config = mcts.SearchConfig(simulations=o.simulations, exploration=o.exploration,
                                    seed=c.seed + 100 * iteration)
  return reasoning.synthesise(tasks, sampler, search_config, cases=grader.tests,
                              branching=o.branching, compile_weight=o.compile_weight,
                              max_refines=o.max_refines)


def fit_prm(c: ml_collections.ConfigDict, tokenizer, iteration: int,
            process_rows: Sequence[reasoning.TaskProcessRecord]):
  """(PRM, its metrics): a fresh process reward model fit on the process rows of every search
  so far, whole trees held out (config.o1.prm_heldout_fraction)."""
  o = c.o1
  train, heldout = prm_lib.split_by_tree(process_rows, o.prm_heldout_fraction,
                                         c.seed + iteration)
  return prm_lib.train_prm(_model(c, head="scalar", seed=c.seed + 20 + iteration), tokenizer,
                           train, heldout, mode=o.prm_mode, steps=o.prm_steps,
                           batch_size=o.batch_size, seed=c.seed + iteration)


def rl_steps(c: ml_collections.ConfigDict, policy: SelfPlayPolicy, iteration: int,
             train_tasks: Sequence[CodingTask], grader: Grader, prm,
             rng: np.random.Generator) -> list[dict]:
  """One iteration's config.train.steps RL steps of `policy` on random training tasks, rewarded
  by the outcome and the iteration's PRM; each step's metrics."""
  o, history = c.o1, []
  for step in range(c.train.steps):
    tasks_now = [train_tasks[i] for i in rng.choice(len(train_tasks),
                                                    c.train.prompts_per_step, replace=False)]
    alpha = alpha_schedule(step, c.train.steps, start=o.alpha_start, end=o.alpha_end)
    history.append(policy.rl_step(tasks_now, grader, prm, alpha=alpha, gamma=o.process_gamma,
                                  rng=jax.random.key(c.seed * 7919 + 1000 * iteration + step)))
    if (step + 1) % c.train.log_every == 0:
      logging.info("iteration %d rl step %d/%d: %s", iteration, step + 1, c.train.steps,
                   {k: round(v, 3) for k, v in history[-1].items()})
  return history


def summary(results: dict, iterations: int) -> dict:
  """The headline numbers of a run's `results`: TCG pass rate, the last PRM's held-out pair
  accuracy, pass rates before and after self-play, wall time."""
  last = iterations - 1
  rate_keys = ("heldout_greedy", "train_sampled")
  return {
      "tcg_pass_rate": results["tcg"]["dpo/tcg_pass_rate"],
      "prm_heldout_pair_accuracy": results[f"iteration_{last}/search_and_prm"][
          "heldout_pair_accuracy"] if iterations else None,
      "pass_rate_before": {k: results["policy_before"][k] for k in rate_keys},
      "pass_rate_after": {k: results[f"iteration_{last}/rl"][k] for k in rate_keys}
                         if iterations else None,
      "wall_s": results["wall_s"]}


def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """The O1-Coder pipeline on generated tasks (module docstring); returns the results."""
  c = config
  o = c.o1
  validate(c)
  refuse_unread(c)
  os.makedirs(workdir, exist_ok=True)
  shutil.rmtree(os.path.join(workdir, "models"), ignore_errors=True)
  t_start = time.perf_counter()
  tokenizer = load_tokenizer(c.tokenizer)
  train_tasks, heldout_tasks = split_tasks(c.seed, o.heldout_fraction)
  if o.search_tasks > len(train_tasks):  # validate checked it is positive
    raise ValueError(f"config.o1.search_tasks={o.search_tasks}: must be in [1, "
                     f"{len(train_tasks)}] (the training tasks, heldout_fraction="
                     f"{o.heldout_fraction})")
  results: dict = {"train_tasks": len(train_tasks), "heldout_tasks": len(heldout_tasks)}

  def log_stage(name: str, metrics: dict) -> None:
    results[name] = metrics
    logging.info("%s (%.0fs): %s", name, time.perf_counter() - t_start, metrics)
    with open(os.path.join(workdir, "results.json"), "w") as f:
      json.dump(results, f, indent=1)

  # ------------------------------------------------------------------ Test-case generator
  generator, tcg_metrics, tests = tcg_tests(c, tokenizer, train_tasks, heldout_tasks)
  save_model(workdir, "tcg", generator)
  log_stage("tcg", tcg_metrics)
  grader = Grader(tests, o.compile_weight)

  # ------------------------------------------------------------------ Bootstrap policy
  policy_model, sft_metrics = supervised_finetune(
      _model(c, head="lm", seed=c.seed), tokenizer,
      warm_start_pairs(train_tasks, size=o.sft_examples,
                       distractor_fraction=o.distractor_fraction, seed=c.seed),
      steps=o.sft_steps, batch_size=o.batch_size, lr=c.sft.lr, seed=c.seed)
  policy = SelfPlayPolicy(policy_model, tokenizer, c)

  def pass_rates() -> dict[str, float]:
    return {"heldout_greedy": policy.pass_rate(heldout_tasks, grader),
            "train_sampled": policy.pass_rate(train_tasks, grader,
                                              num_samples=o.eval_samples, greedy=False,
                                              seed=c.seed + 1)}

  log_stage("policy_before", {**sft_metrics, **pass_rates()})

  # ------------------------------------------------------------------ Self-play iterations
  process_rows: list[reasoning.TaskProcessRecord] = []
  rng = np.random.default_rng(c.seed)
  for iteration in range(o.iterations):
    search_tasks = [train_tasks[i] for i in rng.choice(len(train_tasks), o.search_tasks,
                                                       replace=False)]
    trees = search(c, policy, tokenizer, iteration, search_tasks, grader)
    new_rows = reasoning.process_dataset(search_tasks, trees)
    offset = 1 + max([r.sibling_group[0] for r in process_rows], default=-1)
    process_rows += [dataclasses.replace(r, sibling_group=(r.sibling_group[0] + offset,
                                                           r.sibling_group[1]))
                     for r in new_rows]
    correct = reasoning.correct_paths(search_tasks, trees)
    if iteration == 0:
      policy, warm = warm_start_on_dplus(policy, correct, c)
      save_model(workdir, "policy", policy.model(), step=0)
      log_stage("iteration_0/warm_start_on_dplus", {**warm, **pass_rates()})
    prm, prm_metrics = fit_prm(c, tokenizer, iteration, process_rows)
    rm = prm.reward_model
    save_model(workdir, "prm", (rm.graphdef, rm.params, rm.rest), step=iteration)
    log_stage(f"iteration_{iteration}/search_and_prm", {
        **prm_metrics, "process_steps": len(new_rows), "correct_paths": len(correct),
        "trees_with_correct_path": sum(bool(t.correct_paths()) for t in trees) / len(trees)})
    history = rl_steps(c, policy, iteration, train_tasks, grader, prm, rng)
    save_model(workdir, "policy", policy.model(), step=iteration + 1)
    log_stage(f"iteration_{iteration}/rl", {
        "first_step": history[0], "last_step": history[-1], **pass_rates()})
  results["wall_s"] = time.perf_counter() - t_start
  log_stage("summary", summary(results, o.iterations))
  return results
