"""The RL training loop, read top to bottom: prompts -> rollout -> rewards -> dynamic sampling ->
advantages -> PPO epochs over shuffled mini-batches -> metrics -> checkpoint.

Everything it calls is a pure function (rl/core/advantages.py, losses.py, train_step.py;
rl/jobs/batch.py) or a small object with one job: the rollout source (rl/rollout/sources.py:
engine, streaming or tool episodes, picked once from the config), the grader, the checkpointer.
Its set-up is rl/jobs/rl_setup.py. A new recipe is a config (rl/core/algorithms.py); a new
project is a fork of this file.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from models.sharding import to_host
from models.tokenizer import load_tokenizer
from rl.config.validation import check_paths, validate
from rl.core import advantages as adv_lib
from rl.core import algorithms
from rl.core import losses
from rl.core import train_step as ts
from rl.core.policy import model_config
from rl.core.sampling import cut_tokens
from rl.jobs import batch as batch_lib
from rl.jobs import rl_setup
from rl.jobs.batch import concat_trajectories, score_trajectories, take_rows
from rl.jobs.checkpoint import Checkpointer, MetricsWriter, PreemptionGuard
from rl.jobs.checkpoint import save_run_config, workdir_path
from rl.jobs.progress import Progress
from rl.rewards.shaping import place_on_last_token
from rl.rollout import fp8
from rl.rollout.sources import Rollout


def _on_mesh(method):
  """Runs a Trainer method under the run's ambient mesh (rl/parallel/placement.py)."""
  @functools.wraps(method)
  def wrapped(self, *args, **kwargs):
    with self.placement.scope():
      return method(self, *args, **kwargs)
  return wrapped


@dataclasses.dataclass
class Leg:
  """Where the run stands in this process (one leg of a run that may be preempted and resumed):
  the step the leg started at, the consecutive steps with non-finite loss or gradients, the
  wall time of the earlier legs (from the checkpoint) and this leg's start (perf_counter)."""
  started: float
  start_step: int = 0
  bad_steps: int = 0
  wall_s_before: float = 0.0


class Trainer:
  """Holds the run's state between steps; `run()` is the loop. `job_stage` ("stage 2/2") opens
  the progress lines when RL is one stage of a longer job."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str, *,
               allow_config_change: bool = False, job_stage: str = ""):
    self.leg = Leg(started=time.perf_counter())  # this process's share of the run's wall time
    validate(config)
    check_paths(config)
    self.config = c = config
    self.job_stage = job_stage
    workdir = workdir_path(workdir)
    self.checkpointer = Checkpointer(workdir / "checkpoints", keep=c.train.keep_checkpoints,
                                     save_every=c.train.checkpoint_every)
    latest = self.checkpointer.latest_step()
    # A resume under another config is refused unless allowed (checkpoint.save_run_config).
    save_run_config(workdir, c, step=latest, allow_change=allow_config_change)
    tokenizer = load_tokenizer(c.tokenizer)
    # The mesh (config.mesh) every parameter, optimiser state and batch is laid out on.
    self.placement = rl_setup.placement(c)
    # What the run trains on: prompts, grader (its reward models on the run's mesh),
    # curriculum (rl/jobs/rl_setup.py: task).
    self.task, episodes = rl_setup.task(c, tokenizer, self.placement.rollout_mesh)
    # Where trajectories come from (rl/rollout/sources.py), for training and held-out evals,
    # and the sampler's FP8 weights (config.rollout.weight_dtype; None: the trainer's own).
    self.sources = rl_setup.Sources(
        *rl_setup.rollout_sources(c, tokenizer, self.placement, episodes,
                                  resuming=latest is not None),
        rl_setup.sampler_weights(c))
    self._models()
    self.writer = MetricsWriter(workdir, resume_step=self.leg.start_step)
    self.heldout_by_domain: dict[str, float] = {}  # set by evaluate()

  def _models(self) -> None:
    """The policy, the critic and the KL reference, resumed or warm-started, and their jitted
    updates and forwards."""
    c, model_cfg = self.config, model_config(self.config)
    self.policy = rl_setup.policy(c, self.placement)
    # The critic, when the estimator reads its values (config.rl.critic_init: it may start from
    # the weights the policy starts from).
    self.critic = (rl_setup.critic(c, model_cfg, self.placement, self.policy.state.params,
                                   self.policy.rest)
                   if algorithms.needs_critic(c.rl) else None)
    # The KL reference (params, rest) is the policy the run starts from (config.init_checkpoint,
    # init_hf_dir or the random init, with its router biases), also after a resume and before
    # any tool warm start. A copy: the update donates (and so invalidates) the state's buffers.
    self.reference = (jax.tree.map(jnp.copy, (self.policy.state.params, self.policy.rest))
                      if algorithms.kl_on(c.rl) else None)
    self._maybe_resume()
    if self.task.warm_start and not self.leg.start_step and not c.init_checkpoint:
      with self.placement.scope():  # cold start on expert tool-use transcripts (deterministic)
        p = self.policy
        p.state = rl_setup.train_state(c, self.placement, self.task.warm_start(
            p.graphdef, p.state.params, p.rest, self.task.train_entries,
            self.task.train_prompts), p.optimizer)

    temperature = max(c.rollout.temperature, 1e-6)
    self.policy.update = rl_setup.update_fn(
        ts.policy_objective, c, self.placement, self.policy.graphdef, self.policy.optimizer,
        self.policy.state, temperature=temperature,
        router_aux_loss_coef=model_cfg.router_aux_loss_coef)
    if self.critic is not None:
      self.critic.update = rl_setup.update_fn(ts.critic_objective, c, self.placement,
                                              self.critic.graphdef, self.critic.optimizer,
                                              self.critic.state)
    # MoE: one aux-loss-free bias step per RL step, after its updates, from the load they saw
    # (the bias is constant within a step: rollout and update route alike).
    self.rebalance = (ts.make_rebalance(self.policy.graphdef, model_cfg.router_bias_rate)
                      if model_cfg.router_bias_rate else None)
    # Token log-probs of the policy's architecture: the reference model's (KL) and, with a
    # quantised sampler, the trainer's own (the sampler gap). One jitted function for both.
    self.logprobs = rl_setup.token_logprobs_fn(self.policy.graphdef, temperature)

  # ---------------------------------------------------------------------- Checkpoint
  def _checkpoint_state(self) -> dict:
    state = {"policy": self.policy.state, "rest": self.policy.rest}
    if self.critic is not None:
      state["critic"] = self.critic.state
    return state

  def _maybe_resume(self) -> None:
    latest = self.checkpointer.restore_latest(self._checkpoint_state())
    if latest is None:
      return
    _, restored, record = latest
    self.policy.state, self.policy.rest = restored["policy"], restored["rest"]
    if self.critic is not None:
      self.critic.state = restored.get("critic", self.critic.state)
    self.leg.start_step, self.leg.bad_steps = record["step"], record["bad_steps"]
    self.leg.wall_s_before = record.get("wall_s", 0.0)
    self.task.curriculum.load_state_dict(record.get("curriculum", {"mode": ""}))  # older: uniform
    self.task.follow_curriculum()
    logging.info("resumed from %s at step %d", self.checkpointer.directory, self.leg.start_step)

  def wall_s(self) -> float:
    """Wall time of the whole run so far: earlier legs (up to their last checkpoint) + this."""
    return self.leg.wall_s_before + time.perf_counter() - self.leg.started

  def save(self, step: int, *, force: bool = False) -> None:
    self.checkpointer.save(step, self._checkpoint_state(),
                           {"step": step, "bad_steps": self.leg.bad_steps,
                            "curriculum": self.task.curriculum.state_dict(),
                            "wall_s": self.wall_s()}, force=force)

  # ---------------------------------------------------------------------- Rollout
  def _rollout(self, step: int, batch_index: int, entries_idx: np.ndarray) -> Rollout:
    """One generation batch of the training prompts `entries_idx` from the run's source."""
    rng = jax.random.fold_in(jax.random.fold_in(jax.random.key(self.config.seed), step),
                             batch_index)
    task = self.task
    return self.sources.train.generate(self.policy.graphdef, self._policy_state(),
                                       [task.train_prompts[i] for i in entries_idx],
                                       [task.train_entries[i] for i in entries_idx], rng,
                                       policy_version=step)

  def _policy_state(self):
    """The full model state (parameters + router biases) the rollout engine merges; with
    config.rollout.weight_dtype set, its big matmul weights quantised (rl/rollout/fp8.py), once
    per weight update."""
    if self.sources.weights is not None:
      return self.sources.weights(self.policy.state.params, self.policy.rest)
    return nnx.merge_state(self.policy.state.params, self.policy.rest)

  @_on_mesh
  def collect(self, step: int) -> tuple[Any, dict, dict]:
    """Rollout + reward with DAPO dynamic sampling: keep groups whose accuracy varies, draw
    further generation batches until the batch is full, drop the surplus."""
    c = self.config
    want = c.train.prompts_per_step
    stats = {"gen_batches": 0, "groups_seen": 0, "groups_kept": 0, "filled_groups": 0}
    kept = []  # (trajectories, rewards) of the groups the step keeps
    spare = []  # (trajectories, rewards) of uniform groups dynamic sampling dropped
    t_rollout = t_reward = 0.0
    while (room := want - sum(len(np.unique(np.asarray(t.group_id))) for t, _ in kept)) > 0:
      if stats["gen_batches"] >= c.rl.max_num_gen_batches and c.rl.fill_at_cap:
        for traj, rewards in spare:  # top up with uniform groups (config.rl.fill_at_cap)
          groups = np.unique(np.asarray(traj.group_id))[:room]
          kept.append(take_rows(traj, rewards, np.isin(np.asarray(traj.group_id), groups)))
          stats["filled_groups"] += len(groups)
          room -= len(groups)
          if not room:
            break
        break
      if stats["gen_batches"] >= c.rl.max_num_gen_batches:
        raise RuntimeError(
            f"dynamic sampling kept {stats['groups_kept']} of the {want} groups a step needs "
            f"after config.rl.max_num_gen_batches={c.rl.max_num_gen_batches} generation "
            f"batches ({stats['groups_seen']} groups seen): most groups are all-correct or "
            "all-wrong. Raise max_num_gen_batches, change the data difficulty, set "
            "config.rl.fill_at_cap=True, or set config.rl.dynamic_sampling=False.")
      idx = self.task.curriculum.draw(step, stats["gen_batches"],
                                      self.sources.train.prompts_wanted(want))
      t0 = time.perf_counter()
      traj, entries, source_stats = self._rollout(step, stats["gen_batches"], idx)
      jax.block_until_ready(traj.tokens)
      t1 = time.perf_counter()
      rewards = score_trajectories(traj, entries, self.task.grader, c)
      t_rollout += t1 - t0
      t_reward += time.perf_counter() - t1
      stats["gen_batches"] += 1
      group = np.asarray(traj.group_id) + 1_000_000 * stats["gen_batches"]
      traj = traj.replace(group_id=group)
      groups = np.unique(group)
      stats["groups_seen"] += len(groups)
      if c.rl.dynamic_sampling:
        keep_groups = [g for g in groups if np.std(rewards["acc"][group == g]) > 0]
        uniform = np.isin(group, keep_groups, invert=True)
        if c.rl.fill_at_cap and uniform.any():
          spare.append(take_rows(traj, rewards, uniform))
      else:
        keep_groups = list(groups)
      keep_groups = keep_groups[:room]
      stats["groups_kept"] += len(keep_groups)
      rows = np.isin(group, keep_groups)
      if rows.any():
        kept.append(take_rows(traj, rewards, rows))
      if not stats.get("first"):
        stats["first"], first_entries = rewards, entries
    traj = concat_trajectories([t for t, _ in kept])
    rewards = {k: np.concatenate([r[k] for _, r in kept]) for k in kept[0][1]}
    first = stats.pop("first")
    stats.update(t_rollout=t_rollout, t_reward=t_reward, raw_acc=float(first["acc"].mean()),
                 raw_len_mean=float(first["lengths"].mean()),
                 domain_acc=batch_lib.accuracy_by_domain(first_entries, first["acc"]))
    # The first generation batch is the step's unfiltered sample (dynamic sampling would bias).
    stats["curriculum"] = self.task.curriculum.observe(step, first_entries, first["acc"])
    self.task.follow_curriculum()
    # The grader's metrics of the first batch (tool episodes: per-environment success, turns,
    # tool errors) and the source's of the last (streaming: pool and staleness).
    stats["source"] = {**self.task.grader.metrics(first), **source_stats}
    return traj, rewards, stats

  # ---------------------------------------------------------------------- Advantages
  @_on_mesh
  def advantages(self, traj, rewards) -> dict[str, np.ndarray]:
    """The estimator config.rl.estimator names (rl/core/advantages.py registry), on rewards
    placed on each response's last token; the critic runs only for an estimator that needs
    its values."""
    mask = jnp.asarray(traj.response_mask, jnp.float32)
    scores = jnp.asarray(rewards["scores"])
    out = adv_lib.estimate(self.config.rl, scores, jnp.asarray(traj.group_id),
                           place_on_last_token(scores, mask), mask,
                           values=lambda: self._values(traj))
    return {k: np.asarray(v, np.float32) for k, v in out.items()}

  @functools.cached_property
  def _values_fn(self):
    """The critic's jitted forward (built on first use: runs without a critic never build it)."""
    graphdef, rest = self.critic.graphdef, self.critic.rest

    @jax.jit
    def values_fn(params, tokens):
      v = nnx.merge(graphdef, params, rest).forward(tokens).values
      return jnp.pad(v[:, :-1], ((0, 0), (1, 0)))
    return values_fn

  def _values(self, traj) -> jax.Array:
    """Critic value of the state before token t, placed at t (0 where not a response)."""
    values = to_host(self._values_fn(self.critic.state.params, jnp.asarray(traj.tokens)))
    return values * jnp.asarray(traj.response_mask, jnp.float32)

  # ---------------------------------------------------------------------- Update
  def build_batch(self, traj, rewards, advs) -> dict[str, np.ndarray]:
    """The update's fields (rl/jobs/batch.py) and, with a KL term, the reference log-probs and
    each row's KL weight."""
    batch = batch_lib.build_batch(traj, rewards, advs, self.config.rl)
    if algorithms.kl_on(self.config.rl):
      with self.placement.scope():
        batch["logp_ref"] = np.asarray(to_host(self.logprobs(
            *self.reference, jnp.asarray(batch["tokens"]), batch.get("routing"),
            batch.get("kept_ids"))))
      batch["kl_coef"] = rewards["kl_coef"]
    return batch

  def _sampler_logp_gap(self, batch: dict) -> dict[str, float]:
    """|trainer - sampler| log-prob of the sampled response tokens, before the update: how far
    a quantised sampler's logp_old is from the trainer's own."""
    logp = self.logprobs(self.policy.state.params, self.policy.rest,
                         jnp.asarray(batch["tokens"]), batch.get("routing"), batch.get("kept_ids"))
    return fp8.logp_gap(to_host(logp), batch["logp_old"], batch["response_mask"])

  @_on_mesh
  def update(self, step: int, batch: dict) -> dict[str, float]:
    c = self.config
    n = len(batch["tokens"])
    rng = np.random.default_rng([c.seed, step, 7])
    actor_on = step >= c.rl.critic_warmup_steps or self.critic is None
    gap = self._sampler_logp_gap(batch) if self.sources.weights is not None else {}
    policy, critic = self.policy, self.critic
    device_metrics = []  # fetched once, after the step's last update
    for _ in range(c.rl.ppo_epochs):
      order = rng.permutation(n)
      for mb in np.array_split(order, c.train.mini_batches):
        minibatch = self.placement.put_batch({k: v[mb] for k, v in batch.items()})
        if actor_on:
          policy.state, metrics = policy.update(policy.state, policy.rest, minibatch)
        else:
          metrics = {}
        if critic is not None:
          critic.state, critic_metrics = critic.update(critic.state, critic.rest, minibatch)
          metrics = {**metrics, **{f"critic/{k}": v for k, v in critic_metrics.items()}}
        device_metrics.append(metrics)
    out, router_load = _step_metrics(jax.device_get(device_metrics))
    out.update(gap)
    out["skipped"] = out.get("skipped", 0.0) + out.get("critic/skipped", 0.0)
    if router_load is not None:
      out.update(ts.load_metrics(router_load))
      if self.rebalance is not None and not out["skipped"]:
        policy.rest = jax.device_put(self.rebalance(policy.state.params, policy.rest,
                                                    router_load), self.placement.replicated)
    return out

  # ---------------------------------------------------------------------- Evaluate
  @_on_mesh
  def evaluate(self, entries=None, prompts=None) -> float:
    """Held-out accuracy of the current policy (config.rollout.eval_temperature; 0: greedy).
    Its accuracy per domain (`acc/<domain>`, batch.accuracy_by_domain: e.g. a mixed run's
    addition accuracy and planted property rate) is left in `self.heldout_by_domain`."""
    entries = entries if entries is not None else self.task.heldout_entries
    prompts = prompts if prompts is not None else self.task.heldout_prompts
    traj, row_entries, _ = self.sources.heldout.generate(
        self.policy.graphdef, self._policy_state(), prompts, entries, jax.random.key(0),
        policy_version=0)
    rewards = score_trajectories(traj, row_entries, self.task.grader, self.config)
    self.heldout_by_domain = batch_lib.accuracy_by_domain(row_entries, rewards["acc"])
    return float(rewards["acc"].mean())

  # ---------------------------------------------------------------------- Loop
  def run(self) -> dict[str, float]:
    """Trains to config.train.steps. SIGTERM / SIGINT: the step in progress finishes, is
    saved, and Preempted is raised (rl/jobs/checkpoint.py)."""
    with PreemptionGuard() as preemption:
      return self._run(preemption)

  def _run(self, preemption: PreemptionGuard) -> dict[str, float]:
    c, leg = self.config, self.leg
    last: dict[str, float] = {}
    evaluated = False
    progress = Progress(c.train.steps, start=leg.start_step, stage=self.job_stage)
    for step in range(leg.start_step, c.train.steps):
      # The first step of a run compiles the rollout and the update (minutes for a big model):
      # said before each, so a silent console is not mistaken for a hang.
      first = step == leg.start_step
      if first:
        logging.info("compiling the rollout (first step)...")
      t0 = time.perf_counter()
      traj, rewards, stats = self.collect(step)
      t1 = time.perf_counter()
      advs = self.advantages(traj, rewards)
      batch = self.build_batch(traj, rewards, advs)
      if first:
        logging.info("compiling the policy update%s (first step)...",
                     " and the critic update" if self.critic is not None else "")
      metrics = self.update(step, batch)
      if "returns" in advs:  # how much of the return variance the critic explained
        metrics["explained_variance"] = float(losses.explained_variance(
            advs["values"], advs["returns"], batch["response_mask"]))
      t2 = time.perf_counter()
      if metrics["skipped"]:
        leg.bad_steps += 1
        if leg.bad_steps >= c.train.max_bad_steps:
          self.save(step, force=True)
          self.checkpointer.close()
          raise RuntimeError(
              f"{leg.bad_steps} consecutive steps with non-finite loss or gradients (last at "
              f"step {step}); state saved to {self.checkpointer.directory}. Lower "
              "config.optim.lr or check the data.")
      else:
        leg.bad_steps = 0
      lengths = np.asarray(traj.response_mask).sum(-1)
      generated = stats["gen_batches"] * c.train.prompts_per_step * c.train.samples_per_prompt
      last = {
          "reward": float(rewards["scores"].mean()), "acc": stats["raw_acc"],
          **stats["domain_acc"], "kept_acc": float(rewards["acc"].mean()),
          "response_len_mean": stats["raw_len_mean"], "response_len_max": float(lengths.max()),
          "truncation_rate": float(np.asarray(traj.truncated).mean()),
          "kept_group_fraction": stats["groups_kept"] / max(stats["groups_seen"], 1),
          # Keep-sampling-mask with top-p alone: sampled tokens whose nucleus was cut.
          "kept_cut_tokens": 0 if traj.kept_ids is None else cut_tokens(traj.kept_ids),
          "filled_groups": stats["filled_groups"],
          "gen_batches": stats["gen_batches"], "bad_steps": leg.bad_steps,
          "time/rollout": stats["t_rollout"], "time/reward": stats["t_reward"],
          "time/update": t2 - t1, "time/step": t2 - t0,
          "tokens_per_s": generated * stats["raw_len_mean"] / max(stats["t_rollout"], 1e-9),
          **metrics, **stats["source"], **stats["curriculum"],
      }
      if c.train.eval_every and (step + 1) % c.train.eval_every == 0:
        if not evaluated:
          logging.info("compiling the held-out evaluation (first evaluation)...")
          evaluated = True
        last["heldout_acc"] = self.evaluate()
        last.update({f"heldout_{k}": v for k, v in self.heldout_by_domain.items()})
      last["wall_s"] = self.wall_s()  # the whole run's, earlier legs included
      self.writer.write(step + 1, last)
      if (step + 1) % c.train.log_every == 0:
        critic = ("" if "explained_variance" not in last else
                  f" value_loss {last['critic/value_loss']:.4f} explained_variance "
                  f"{last['explained_variance']:.3f}" + ("" if "pg_loss" in last else
                                                         " (value pretraining)"))
        logging.info("%sstep %d/%d reward %.3f acc %.3f len %.1f tok/s %.0f%s %s",
                     progress.prefix, step + 1, c.train.steps, last["reward"],
                     last["acc"], last["response_len_mean"],
                     last["tokens_per_s"], critic, progress.suffix(step + 1))
      self.save(step + 1)
      if step + 1 < c.train.steps:
        preemption.stop_if_requested("", step + 1, c.train.steps, self.save, self.checkpointer,
                                     self.writer)
    self.save(c.train.steps, force=True)
    self.checkpointer.close()
    self.writer.close()
    self.sources.train.close()
    return last


def run(config: ml_collections.ConfigDict, workdir: str, *,
        allow_config_change: bool = False) -> dict[str, float]:
  return Trainer(config, workdir, allow_config_change=allow_config_change).run()


def _step_metrics(per_update: list[dict]) -> tuple[dict[str, float], np.ndarray | None]:
  """One RL step's metrics from its updates' (host values): the mean over the updates, but the
  max of `*_max`, the min of `*_min` and the count of `skipped` ones; and the summed expert
  load `router_load` [n_moe_layers, E] (None for dense models)."""
  out: dict[str, float] = {}
  loads = [m.pop("router_load") for m in per_update if "router_load" in m]
  for key in dict.fromkeys(k for m in per_update for k in m):
    values = [float(m[key]) for m in per_update if key in m]
    if key.endswith("_max"):
      out[key] = max(values)
    elif key.endswith("_min"):
      out[key] = min(values)
    elif key.endswith("skipped"):
      out[key] = sum(values)
    else:
      out[key] = sum(values) / len(per_update)
  return out, (sum(loads) if loads else None)
