"""The RL training loop, read top to bottom: prompts -> rollout -> rewards -> dynamic sampling ->
advantages -> PPO epochs over shuffled mini-batches -> metrics -> checkpoint.

Everything it calls is a pure function (rl/core/advantages.py, rl/core/losses.py, rl/core/train_step.py) or a
small object with one job (rollout engine, verifier, checkpointer). A new recipe is a config
(rl/core/algorithms.py); a new project is a fork of this file.
"""

from __future__ import annotations

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
from models.transformer import Transformer
from rl.core.policy import build_policy, model_config
from rl.config.validation import check_paths, validate
from rl.core import advantages as adv_lib
from rl.core import algorithms
from rl.core import losses
from rl.rollout import fp8
from rl.parallel.placement import Placement
from rl.rollout import engine as rollout_lib
from rl.core import train_step as ts
from rl.data.curriculum import PromptCurriculum, domain_of
from rl.data.entries import encode_prompts, load_entries, prompt_of
from rl.jobs.checkpoint import Checkpointer, MetricsWriter, PreemptionGuard, Preempted
from rl.jobs.checkpoint import save_run_config, workdir_path
from rl.rewards import manager
from rl.rewards.shaping import overlong_penalty, place_on_last_token
from rl.core.sampling import next_token_logprobs, unpack_sample_mask
from rl.rollout.streaming import StreamingConfig, StreamingRollout
from rl.tool_use import reward as tool_reward
from rl.tool_use.episodes import ToolUse


# ======================================================================== Reward

def score_trajectories(traj, entries, tokenizer, cfg, tool_use=None) -> dict[str, np.ndarray]:
  """Decodes responses, grades them (rl/rewards/manager.py: model output is never evaluated in
  this process) and shapes the reward. Tool-use episodes (`tool_use`, rl/tool_use/episodes.py) are
  graded by their environment's verifier, optionally mixed with a judge, and keep their
  per-row episode statistics (turns, tool calls and errors) in the result."""
  tokens = np.asarray(traj.tokens)
  resp_mask = np.asarray(traj.response_mask).astype(bool)
  lengths = resp_mask.sum(-1)
  episode_stats = {}
  if tool_use is not None:
    episode_stats = tool_use.score(traj, entries)
    acc, reward = episode_stats.pop("acc"), episode_stats.pop("reward")
  else:
    responses = [tokenizer.decode(tokens[n][resp_mask[n]]) for n in range(len(tokens))]
    acc = reward = manager.score_responses(entries, responses)
  rl = cfg.rl
  scores = 2.0 * reward - 1.0 if rl.reward_mode == "dapo" else reward.copy()
  if rl.overlong_buffer:
    scores = scores + np.asarray(overlong_penalty(
        jnp.asarray(lengths), max_len=cfg.rollout.max_new_tokens, buffer=rl.overlong_buffer,
        factor=rl.overlong_factor))
  return {"acc": acc, "scores": scores.astype(np.float32), "lengths": lengths,
          "kl_coef": kl_coefs(entries, rl), **episode_stats}


def kl_coefs(entries, rl) -> np.ndarray:
  """Each row's KL weight: its domain's beta in config.rl.kl_coef_per_domain (a generated
  puzzle's task, else the record's domain: rl.data.curriculum.domain_of), else
  config.rl.kl_coef."""
  betas = algorithms.kl_coefs_by_domain(rl.kl_coef_per_domain)
  return np.array([betas.get(domain_of(e), rl.kl_coef) for e in entries], np.float32)


def concat_trajectories(parts):
  width = max(p.tokens.shape[1] for p in parts)

  def pad(x):
    if x is None or x.ndim < 2 or x.shape[1] == width:
      return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, width - x.shape[1])
    return np.pad(np.asarray(x), widths)

  def cat(*xs):
    if xs[0] is None:
      return None
    return np.concatenate([np.asarray(pad(x)) for x in xs])
  return jax.tree.map(cat, *parts, is_leaf=lambda x: x is None)


# ======================================================================== Loop

def _on_mesh(method):
  """Runs a Trainer method under the run's ambient mesh (rl/parallel/placement.py)."""
  @functools.wraps(method)
  def wrapped(self, *args, **kwargs):
    with self.placement.scope():
      return method(self, *args, **kwargs)
  return wrapped


class Trainer:
  """Holds the run's state between steps; `run()` is the loop."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str):
    self.t_leg = time.perf_counter()  # this process's share of the run's wall time
    validate(config)
    check_paths(config)
    self.config = c = config
    self.workdir = workdir_path(workdir)
    self.checkpointer = Checkpointer(self.workdir / "checkpoints",
                                     keep=c.train.keep_checkpoints,
                                     save_every=c.train.checkpoint_every)
    save_run_config(self.workdir, c, resuming=self.checkpointer.latest_step() is not None)
    self.tokenizer = load_tokenizer(c.tokenizer)
    self.model_cfg = model_config(c)

    # -------------------------------------------------------------- Data
    self.tools = ToolUse(c, self.tokenizer) if c.tools.enabled else None
    # Tool environments' tasks (under their chat prompt), or config.data's entries.
    self.train_entries, self.heldout_entries = (
        self.tools.entries() if self.tools is not None else load_entries(c, self.tokenizer))
    self.train_prompts = self._encode(self.train_entries)
    self.heldout_prompts = self._encode(self.heldout_entries)
    # Which prompts each step draws (deterministic in seed and step; config.data.curriculum).
    self.curriculum = PromptCurriculum(c.data, self.train_entries, seed=c.seed,
                                       exclude=[prompt_of(e) for e in self.heldout_entries])

    # -------------------------------------------------------------- Model and optimiser
    if c.rollout.streaming.enabled and self.tools is not None:
      raise ValueError("config.rollout.streaming.enabled=True with config.tools.enabled=True: "
                       "multi-turn tool episodes are not streamed; turn one of them off")
    # The mesh (config.mesh) every parameter, optimiser state and batch is laid out on.
    self.placement = Placement.from_config(c)
    self.placement.warn_unsplit_rows(
        c.train.prompts_per_step * c.train.samples_per_prompt // c.train.mini_batches
        // c.train.micro_batches,
        "a micro-batch (prompts_per_step x samples_per_prompt / mini_batches / micro_batches)")
    policy = build_policy(c, self.placement.mesh)
    self.graphdef, params, self.rest = nnx.split(policy, nnx.Param, ...)
    self.rest = jax.device_put(self.rest, self.placement.replicated)
    # Policy and critic share config.optim but for the learning rate.
    make_optimizer = functools.partial(
        ts.make_optimizer, warmup_steps=c.optim.warmup_steps, weight_decay=c.optim.weight_decay,
        grad_clip=c.optim.grad_clip, b1=c.optim.b1, b2=c.optim.b2)
    self.optimizer = make_optimizer(lr=c.optim.lr)
    self.state = self._train_state(params)
    self.critic = None
    if c.rl.use_critic:
      critic = Transformer(self.model_cfg.replace(head="scalar", tie_embeddings=False),
                           rngs=nnx.Rngs(params=c.seed + 1))
      self.critic_graphdef, critic_params, self.critic_rest = nnx.split(critic, nnx.Param, ...)
      self.critic_rest = jax.device_put(self.critic_rest, self.placement.replicated)
      self.critic_optimizer = make_optimizer(lr=c.optim.critic_lr)
      self.critic = self.placement.train_state(critic_params, self.critic_optimizer,
                                               offload=c.optim.offload_state)
    self.start_step = 0
    self.bad_steps = 0
    self.wall_s_before = 0.0  # wall time of the run's earlier legs (from the checkpoint)
    if c.init_checkpoint:
      self._load_init(c.init_checkpoint)
    # The KL reference is the policy the run starts from (config.init_checkpoint, init_hf_dir
    # or the random init, with its router biases), also after a resume and before any tool
    # warm start. A copy: the update donates (and so invalidates) the state's buffers.
    self.ref_params = self.ref_rest = None
    if self._kl_on():
      self.ref_params, self.ref_rest = jax.tree.map(jnp.copy, (self.state.params, self.rest))
    self._maybe_resume()
    if self.tools is not None and c.tools.warm_start_steps and not self.start_step and (
        not c.init_checkpoint):  # cold start on expert tool-use transcripts (deterministic)
      with self.placement.scope():
        self.state = self._train_state(self.tools.warm_start(
            self.graphdef, self.state.params, self.rest, self.train_entries,
            self.train_prompts))

    rl = c.rl.to_dict()
    max_len = c.rollout.max_new_tokens
    temperature = max(c.rollout.temperature, 1e-6)
    # Layouts pinned: the update keeps the state where placement put it (the batch comes
    # placed by Placement.put_batch, its rows over the mesh's batch axes).
    offload = bool(c.optim.offload_state)
    self.policy_update = ts.make_update(
        ts.policy_objective, self.graphdef, self.optimizer,
        micro_batches=c.train.micro_batches, rl=rl, temperature=temperature, max_len=max_len,
        router_aux_loss_coef=self.model_cfg.router_aux_loss_coef,
        state_sharding=self.placement.state_sharding(self.state), offload_optimizer=offload)
    # MoE: one aux-loss-free bias step per RL step, after its updates, from the load they saw
    # (the bias is constant within a step: rollout and update route alike).
    self.rebalance = (ts.make_rebalance(self.graphdef, self.model_cfg.router_bias_rate)
                      if self.model_cfg.router_bias_rate else None)
    if self.critic is not None:
      self.critic_update = ts.make_update(
          ts.critic_objective, self.critic_graphdef, self.critic_optimizer,
          micro_batches=c.train.micro_batches, rl=rl, max_len=max_len,
          state_sharding=self.placement.state_sharding(self.critic), offload_optimizer=offload)
    self.rollout_cfg = rollout_lib.run_rollout_config(
        c, stop_ids=self.tokenizer.stop_ids, pad_id=self.tokenizer.pad_id)
    self.eval_cfg = self.rollout_cfg.replace(greedy=c.rollout.eval_temperature == 0,
                                             temperature=c.rollout.eval_temperature or 1.0,
                                             keep_sampling_mask=False, keep_routing=False)
    # Streaming rollouts (rl/rollout/streaming.py): partial generations carry over between steps,
    # each token keeping the log-prob and version of the policy that sampled it. Every
    # generation batch submits its prompts and takes prompts_per_step complete groups; an
    # empty pool is filled with twice that, so unfinished groups carry over to the next step.
    self.stream = None
    if c.rollout.streaming.enabled:
      s = c.rollout.streaming
      self.stream = StreamingRollout(
          self.rollout_cfg, StreamingConfig(on_policy_fraction=s.on_policy_fraction,
                                            max_staleness=s.max_staleness,
                                            round_tokens=s.round_tokens),
          num_samples=c.train.samples_per_prompt, seed=c.seed,
          mesh=self.placement.rollout_mesh)
      if self.start_step:
        logging.warning("streaming rollouts: the pool of partial generations is not in the "
                        "checkpoint; the resumed run starts with an empty pool")
    self.sampler_weights = (fp8.SamplerWeights(c.rollout.weight_dtype,
                                                 block_size=c.rollout.weight_block_size)
                            if c.rollout.weight_dtype else None)
    self.writer = MetricsWriter(self.workdir, resume_step=self.start_step)

  def _train_state(self, params) -> ts.TrainState:
    """A fresh policy TrainState on the run's mesh."""
    return self.placement.train_state(params, self.optimizer,
                                      offload=self.config.optim.offload_state)

  def _kl_on(self) -> bool:
    return bool(self.config.rl.kl_coef or self.config.rl.kl_coef_per_domain)

  # ---------------------------------------------------------------------- Checkpoint
  def _checkpoint_state(self) -> dict:
    state = {"policy": self.state, "rest": self.rest}
    if self.critic is not None:
      state["critic"] = self.critic
    return state

  def _maybe_resume(self) -> None:
    latest = self.checkpointer.restore_latest(self._checkpoint_state())
    if latest is None:
      return
    _, restored, record = latest
    self.state, self.rest = restored["policy"], restored["rest"]
    self.critic = restored.get("critic", self.critic)
    self.start_step, self.bad_steps = record["step"], record["bad_steps"]
    self.wall_s_before = record.get("wall_s", 0.0)
    self.curriculum.load_state_dict(record.get("curriculum", {"mode": ""}))  # older: uniform
    self._follow_curriculum()
    logging.info("resumed from %s at step %d", self.checkpointer.directory, self.start_step)

  def _load_init(self, directory: str) -> None:
    """Starts from the policy parameters (and MoE router biases) of an earlier stage's
    checkpoint (e.g. SFT)."""
    init = Checkpointer(directory)
    step = init.latest_step()
    if step is None:
      raise FileNotFoundError(f"config.init_checkpoint={directory!r} holds no checkpoint")
    try:
      restored, _ = init.restore(step, {"params": self.state.params, "rest": self.rest},
                                 partial=True)
      self.rest = jax.device_put(restored["rest"], self.placement.replicated)
    except ValueError:  # a checkpoint of parameters only (an older SFT stage)
      restored, _ = init.restore(step, {"params": self.state.params}, partial=True)
      logging.warning("%s step %d holds parameters only: the MoE router biases start from "
                      "their initial values", directory, step)
    self.state = self._train_state(restored["params"])
    init.close()

  def wall_s(self) -> float:
    """Wall time of the whole run so far: earlier legs (up to their last checkpoint) + this."""
    return self.wall_s_before + time.perf_counter() - self.t_leg

  def save(self, step: int, *, force: bool = False) -> None:
    self.checkpointer.save(step, self._checkpoint_state(),
                           {"step": step, "bad_steps": self.bad_steps,
                            "curriculum": self.curriculum.state_dict(),
                            "wall_s": self.wall_s()}, force=force)

  def _follow_curriculum(self) -> None:
    """Takes up the curriculum's training entries when it regenerated them (a new level)."""
    if self.curriculum.entries is self.train_entries:
      return
    self.train_entries = self.curriculum.entries
    self.train_prompts = self._encode(self.train_entries)

  def _encode(self, entries) -> list[list[int]]:
    """Prompt ids: the tool environments' chat prompt, or config.data.prompt_template."""
    if self.tools is not None:
      return self.tools.encode(entries)
    return encode_prompts(entries, self.tokenizer, self.config.data.prompt_template)

  # ---------------------------------------------------------------------- Rollout
  def _rollout(self, step: int, batch_index: int, entries_idx: np.ndarray):
    c = self.config
    rng = jax.random.fold_in(jax.random.fold_in(jax.random.key(c.seed), step), batch_index)
    prompts = [self.train_prompts[i] for i in entries_idx]
    if self.stream is not None:  # the step's prompts join the pool; complete groups come out
      self.stream.submit(prompts, payloads=[self.train_entries[i] for i in entries_idx])
      traj, payloads, self.stream_stats = self.stream.collect(
          self.graphdef, self._policy_state(), policy_version=step,
          num_groups=c.train.prompts_per_step)
      return traj, [payloads[g] for g in np.asarray(traj.group_id)]
    if self.tools is not None:
      return self.tools.generate(self.graphdef, self._policy_state(), prompts,
                                 [self.train_entries[i] for i in entries_idx], rng,
                                 self.rollout_cfg, num_samples=c.train.samples_per_prompt,
                                 policy_version=step)
    traj = rollout_lib.generate(self.graphdef, self._policy_state(), prompts, rng,
                                self.rollout_cfg, num_samples=c.train.samples_per_prompt,
                                policy_version=step, mesh=self.placement.rollout_mesh)
    group_entries = [self.train_entries[entries_idx[g]] for g in np.asarray(traj.group_id)]
    return traj, group_entries

  def _policy_state(self):
    """The full model state (parameters + router biases) the rollout engine merges; with
    config.rollout.weight_dtype set, its big matmul weights quantised (rl/rollout/fp8.py), once per
    weight update."""
    if self.sampler_weights is not None:
      return self.sampler_weights(self.state.params, self.rest)
    return nnx.merge_state(self.state.params, self.rest)

  @_on_mesh
  def collect(self, step: int) -> tuple[Any, dict, dict]:
    """Rollout + reward with DAPO dynamic sampling: keep groups whose accuracy varies, draw
    further generation batches until the batch is full, drop the surplus."""
    c = self.config
    want = c.train.prompts_per_step
    kept, kept_rewards, stats = [], [], {"gen_batches": 0, "groups_seen": 0, "groups_kept": 0,
                                         "filled_groups": 0}
    spare = []  # (trajectories, rewards) of uniform groups dynamic sampling dropped
    t_rollout = t_reward = 0.0
    while (room := want - sum(len(np.unique(np.asarray(t.group_id))) for t in kept)) > 0:
      if stats["gen_batches"] >= c.rl.max_num_gen_batches and c.rl.fill_at_cap:
        for traj, rewards in spare:  # top up with uniform groups (config.rl.fill_at_cap)
          groups = np.unique(np.asarray(traj.group_id))[:room]
          rows = np.isin(np.asarray(traj.group_id), groups)
          kept.append(jax.tree.map(lambda x: np.asarray(x)[rows], traj))
          kept_rewards.append({k: v[rows] for k, v in rewards.items()})
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
      size = want
      if self.stream is not None and not self.stream.num_in_flight + self.stream.num_ready:
        size = 2 * want  # an empty pool starts with a surplus: later steps take what it has
      idx = self.curriculum.draw(step, stats["gen_batches"], size)
      t0 = time.perf_counter()
      traj, entries = self._rollout(step, stats["gen_batches"], idx)
      jax.block_until_ready(traj.tokens)
      t1 = time.perf_counter()
      rewards = score_trajectories(traj, entries, self.tokenizer, c, self.tools)
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
          spare.append((jax.tree.map(lambda x: np.asarray(x)[uniform], traj),
                        {k: v[uniform] for k, v in rewards.items()}))
      else:
        keep_groups = list(groups)
      keep_groups = keep_groups[:room]
      stats["groups_kept"] += len(keep_groups)
      rows = np.isin(group, keep_groups)
      if rows.any():
        kept.append(jax.tree.map(lambda x: np.asarray(x)[rows], traj))
        kept_rewards.append({k: v[rows] for k, v in rewards.items()})
      if not stats.get("first"):
        stats["first"], first_entries = rewards, entries
    traj = concat_trajectories(kept)
    rewards = {k: np.concatenate([r[k] for r in kept_rewards]) for k in kept_rewards[0]}
    first = stats.pop("first")
    stats.update(t_rollout=t_rollout, t_reward=t_reward, raw_acc=float(first["acc"].mean()),
                 raw_len_mean=float(first["lengths"].mean()))
    # The first generation batch is the step's unfiltered sample (dynamic sampling would bias).
    stats["curriculum"] = self.curriculum.observe(step, first_entries, first["acc"])
    self._follow_curriculum()
    if self.tools is not None:  # per-environment success, turns, tool errors (first batch)
      stats.update(tool_reward.episode_metrics(first))
    if self.stream is not None:  # pool and staleness after the step's last collection
      stats.update({f"stream/{k}": float(v) for k, v in self.stream_stats.items()})
    return traj, rewards, stats

  # ---------------------------------------------------------------------- Advantages
  def _forward_fn(self, graphdef):
    c = self.config

    @jax.jit
    def logprobs(params, rest, tokens, routing, sample_mask):
      model = nnx.merge(graphdef, params, rest)
      out = model.forward(tokens, routing=routing)
      kept = None
      if sample_mask is not None:
        kept = unpack_sample_mask(sample_mask[:, 1:], out.logits.shape[-1])
      logp = next_token_logprobs(out.logits, tokens, temperature=max(c.rollout.temperature, 1e-6),
                                 kept_mask=kept)
      return jnp.pad(logp, ((0, 0), (1, 0)))
    return logprobs

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

  def _values(self, traj) -> jax.Array:
    """Critic value of the state before token t, placed at t (0 where not a response)."""
    if not hasattr(self, "_values_fn"):
      graphdef, rest = self.critic_graphdef, self.critic_rest

      @jax.jit
      def values_fn(params, tokens):
        v = nnx.merge(graphdef, params, rest).forward(tokens).values
        return jnp.pad(v[:, :-1], ((0, 0), (1, 0)))
      self._values_fn = values_fn
    values = to_host(self._values_fn(self.critic.params, jnp.asarray(traj.tokens)))
    return values * jnp.asarray(traj.response_mask, jnp.float32)

  # ---------------------------------------------------------------------- Update
  def build_batch(self, traj, rewards, advs) -> dict[str, np.ndarray]:
    c = self.config
    tokens = np.asarray(traj.tokens)
    width = tokens.shape[1]
    # Attend up to each row's last policy token: tool results inside the response (mask 0)
    # make prompt_len + sum(mask) too short, and tokens after it carry no loss.
    resp = np.asarray(traj.response_mask).astype(bool)
    last_policy = np.where(resp.any(-1), width - np.argmax(resp[:, ::-1], -1), 0)
    total_len = np.maximum(np.asarray(traj.prompt_lens), last_policy)
    batch = {
        "tokens": tokens,
        "response_mask": np.asarray(traj.response_mask, np.float32),
        "attention_mask": (np.arange(width)[None, :] < total_len[:, None]).astype(np.float32),
        "logp_old": np.asarray(traj.logp_old, np.float32),
        "acc": rewards["acc"],
        **advs,
    }
    if c.rl.overlong_filter:
      batch["response_mask"] = batch["response_mask"] * (~np.asarray(traj.truncated))[:, None]
    if c.rl.keep_routing and traj.routing is not None:
      batch["routing"] = np.asarray(traj.routing)
    if c.rl.keep_sampling_mask and traj.sample_mask is not None:
      batch["sample_mask"] = np.asarray(traj.sample_mask)
    if self._kl_on():
      if not hasattr(self, "_ref_logprobs"):
        self._ref_logprobs = self._forward_fn(self.graphdef)
      with self.placement.scope():
        batch["logp_ref"] = np.asarray(to_host(self._ref_logprobs(
            self.ref_params, self.ref_rest, jnp.asarray(tokens), batch.get("routing"),
            batch.get("sample_mask"))))
      batch["kl_coef"] = rewards["kl_coef"]
    return batch

  def _sampler_logp_gap(self, batch: dict) -> dict[str, float]:
    """|trainer - sampler| log-prob of the sampled response tokens, before the update: how far
    a quantised sampler's logp_old is from the trainer's own."""
    if not hasattr(self, "_trainer_logprobs"):
      self._trainer_logprobs = self._forward_fn(self.graphdef)
    logp = self._trainer_logprobs(self.state.params, self.rest, jnp.asarray(batch["tokens"]),
                                  batch.get("routing"), batch.get("sample_mask"))
    return fp8.logp_gap(to_host(logp), batch["logp_old"], batch["response_mask"])

  @_on_mesh
  def update(self, step: int, batch: dict) -> dict[str, float]:
    c = self.config
    n = len(batch["tokens"])
    rng = np.random.default_rng([c.seed, step, 7])
    actor_on = step >= c.rl.critic_warmup_steps or self.critic is None
    sums: dict[str, float] = {}
    gap = self._sampler_logp_gap(batch) if self.sampler_weights is not None else {}
    count = 0
    router_load = None  # [n_moe_layers, E] tokens per expert over the step's updates
    for _ in range(c.rl.ppo_epochs):
      order = rng.permutation(n)
      for mb in np.array_split(order, c.train.mini_batches):
        minibatch = self.placement.put_batch({k: v[mb] for k, v in batch.items()})
        if actor_on:
          self.state, metrics = self.policy_update(self.state, self.rest, minibatch)
        else:
          metrics = {}
        if self.critic is not None:
          self.critic, critic_metrics = self.critic_update(self.critic, self.critic_rest,
                                                           minibatch)
          metrics = {**metrics, **{f"critic/{k}": v for k, v in critic_metrics.items()}}
        metrics = jax.device_get(metrics)
        if "router_load" in metrics:
          load = metrics.pop("router_load")
          router_load = load if router_load is None else router_load + load
        for k, v in metrics.items():
          sums[k] = sums.get(k, 0.0) + float(v)
        count += 1
    out = {**{k: v / count for k, v in sums.items()}, **gap}
    out["skipped"] = sums.get("skipped", 0.0) + sums.get("critic/skipped", 0.0)
    if router_load is not None:
      out.update(ts.load_metrics(router_load))
      if self.rebalance is not None and not out["skipped"]:
        self.rest = jax.device_put(self.rebalance(self.state.params, self.rest, router_load),
                                   self.placement.replicated)
    return out

  # ---------------------------------------------------------------------- Evaluate
  @_on_mesh
  def evaluate(self, entries=None, prompts=None) -> float:
    """Greedy held-out accuracy of the current policy."""
    entries = entries if entries is not None else self.heldout_entries
    prompts = prompts if prompts is not None else self.heldout_prompts
    if self.tools is not None:
      traj, row_entries = self.tools.generate(self.graphdef, self._policy_state(), prompts,
                                              entries, jax.random.key(0), self.eval_cfg,
                                              num_samples=1)
    else:
      traj = rollout_lib.generate(self.graphdef, self._policy_state(), prompts,
                                  jax.random.key(0), self.eval_cfg, num_samples=1,
                                  mesh=self.placement.rollout_mesh)
      row_entries = [entries[g] for g in np.asarray(traj.group_id)]
    rewards = score_trajectories(traj, row_entries, self.tokenizer, self.config, self.tools)
    return float(rewards["acc"].mean())

  # ---------------------------------------------------------------------- Loop
  def run(self) -> dict[str, float]:
    """Trains to config.train.steps. SIGTERM / SIGINT: the step in progress finishes, is
    saved, and Preempted is raised (rl/jobs/checkpoint.py)."""
    with PreemptionGuard() as preemption:
      return self._run(preemption)

  def _run(self, preemption: PreemptionGuard) -> dict[str, float]:
    c = self.config
    last: dict[str, float] = {}
    t_start = time.perf_counter()
    for step in range(self.start_step, c.train.steps):
      t0 = time.perf_counter()
      traj, rewards, stats = self.collect(step)
      t1 = time.perf_counter()
      advs = self.advantages(traj, rewards)
      batch = self.build_batch(traj, rewards, advs)
      metrics = self.update(step, batch)
      if "returns" in advs:  # how much of the return variance the critic explained
        metrics["explained_variance"] = float(losses.explained_variance(
            advs["values"], advs["returns"], batch["response_mask"]))
      t2 = time.perf_counter()
      if metrics["skipped"]:
        self.bad_steps += 1
        if self.bad_steps >= c.train.max_bad_steps:
          self.save(step, force=True)
          self.checkpointer.close()
          raise RuntimeError(
              f"{self.bad_steps} consecutive steps with non-finite loss or gradients (last at "
              f"step {step}); state saved to {self.checkpointer.directory}. Lower "
              "config.optim.lr or check the data.")
      else:
        self.bad_steps = 0
      resp = np.asarray(traj.response_mask)
      lengths = resp.sum(-1)
      generated = stats["gen_batches"] * c.train.prompts_per_step * c.train.samples_per_prompt
      last = {
          "reward": float(rewards["scores"].mean()), f"acc/{c.data.task}": stats["raw_acc"],
          "kept_acc": float(rewards["acc"].mean()),
          "response_len_mean": stats["raw_len_mean"], "response_len_max": float(lengths.max()),
          "truncation_rate": float(np.asarray(traj.truncated).mean()),
          "kept_group_fraction": stats["groups_kept"] / max(stats["groups_seen"], 1),
          "filled_groups": stats["filled_groups"],
          "gen_batches": stats["gen_batches"], "bad_steps": self.bad_steps,
          "time/rollout": stats["t_rollout"], "time/reward": stats["t_reward"],
          "time/update": t2 - t1, "time/step": t2 - t0,
          "tokens_per_s": generated * stats["raw_len_mean"] / max(stats["t_rollout"], 1e-9),
          **metrics,
          **{k: v for k, v in stats.items() if k.startswith(("tools/", "stream/"))},
          **stats["curriculum"],
      }
      if c.train.eval_every and (step + 1) % c.train.eval_every == 0:
        last["heldout_acc"] = self.evaluate()
      self.writer.write(step + 1, last)
      if (step + 1) % c.train.log_every == 0:
        done = step + 1 - self.start_step
        eta = (time.perf_counter() - t_start) / done * (c.train.steps - step - 1)
        logging.info("step %d/%d reward %.3f acc %.3f len %.1f tok/s %.0f ETA %.0fs",
                     step + 1, c.train.steps, last["reward"], last[f"acc/{c.data.task}"],
                     last["response_len_mean"], last["tokens_per_s"], eta)
      self.save(step + 1)
      if step + 1 < c.train.steps and preemption.requested():
        self.save(step + 1, force=True)
        self.checkpointer.close()
        self.writer.close()
        raise Preempted(f"stopped by {preemption.received or 'another process'} after step "
                        f"{step + 1}/{c.train.steps}; checkpoint saved in "
                        f"{self.checkpointer.directory}: rerun the same command to resume")
    self.save(c.train.steps, force=True)
    self.checkpointer.close()
    self.writer.close()
    if self.tools is not None:
      self.tools.runner.close()
    return last


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  return Trainer(config, workdir).run()
