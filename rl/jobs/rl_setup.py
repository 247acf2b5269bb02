"""What the RL trainer (rl/jobs/trainer.py) builds before its first step, from the run config:
its task (prompts, grader, curriculum), the policy and critic (`Role`s: each with its optimiser
on the run's mesh and its jitted update), the one jitted log-prob forward (reference model and
sampler gap), the start from an earlier stage's checkpoint, and the rollout sources
(rl/rollout/sources.py) for training and evaluation."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging
from flax import nnx

from models.config import ModelConfig
from models.transformer import Transformer
from rl.core import train_step as ts
from rl.core.policy import build_policy
from rl.data.curriculum import PromptCurriculum
from rl.data.entries import encode_prompts, load_entries
from rl.data.templates import prompt_of
from rl.jobs import reward_models
from rl.jobs.batch import ResponseGrader
from rl.jobs.checkpoint import Checkpointer
from rl.parallel.placement import Placement
from rl.rollout import engine as rollout_lib
from rl.rollout import fp8
from rl.core.sampling import kept_mask_from_ids, next_token_logprobs
from rl.rollout.sources import EngineSource, RolloutSource, StreamingSource
from rl.rollout.streaming import StreamingConfig, StreamingRollout
from rl.tool_use.episodes import ToolEpisodes


# ======================================================================== Data

@dataclasses.dataclass
class Task:
  """What the run trains on and how it is graded: training and held-out entries with their
  encoded prompts (`encode`: entries -> prompt ids), the `grader` (per-row accuracy and
  reward), the `curriculum` choosing each step's prompts (config.data.curriculum; it may
  regenerate the training entries), and the tool episodes' warm start on expert transcripts
  (`warm_start(graphdef, params, rest, entries, prompts) -> params`; None without one)."""
  train_entries: list
  train_prompts: list
  heldout_entries: list
  heldout_prompts: list
  encode: Callable
  grader: Any
  curriculum: PromptCurriculum
  warm_start: Callable | None

  def follow_curriculum(self) -> None:
    """Takes up the curriculum's training entries when it regenerated them (a new level)."""
    if self.curriculum.entries is self.train_entries:
      return
    self.train_entries = self.curriculum.entries
    self.train_prompts = self.encode(self.train_entries)


def task(c: ml_collections.ConfigDict, tokenizer, mesh=None
         ) -> tuple[Task, ToolEpisodes | None]:
  """(the run's task, the tool episodes its rollout sources run, or None). Tool-use episodes
  (config.tools) bring their environments' tasks, chat prompts, grader (verifier + judge) and
  warm start (config.tools.warm_start_steps); otherwise config.data's entries, its prompt
  template and the grading registry config.reward builds (rl/jobs/reward_models.py,
  rl/jobs/batch.ResponseGrader). The curriculum is deterministic in the seed and the step and
  never draws a held-out prompt."""
  episodes = ToolEpisodes(c, tokenizer) if c.tools.enabled else None
  warm_start = None
  if episodes is not None:
    (train, heldout), encode, grader = episodes.entries(), episodes.encode, episodes
    warm_start = episodes.warm_start if c.tools.warm_start_steps else None
  else:
    train, heldout = load_entries(c, tokenizer)
    encode = functools.partial(encode_prompts, tokenizer=tokenizer,
                               template=c.data.prompt_template)
    grader = ResponseGrader(tokenizer, reward_models.graders_from_config(c, mesh))
  train_prompts, heldout_prompts = encode(train), encode(heldout)
  curriculum = PromptCurriculum(c.data, train, seed=c.seed,
                                exclude=[prompt_of(e) for e in heldout])
  return Task(train, train_prompts, heldout, heldout_prompts, encode, grader, curriculum,
              warm_start), episodes


# ======================================================================== Model and optimiser

def placement(c: ml_collections.ConfigDict) -> Placement:
  """The run's mesh and layouts (config.mesh), with a warning when a micro-batch's rows do not
  split over its batch axes."""
  p = Placement.from_config(c)
  p.warn_unsplit_rows(
      c.train.prompts_per_step * c.train.samples_per_prompt // c.train.mini_batches
      // c.train.micro_batches,
      "a micro-batch (prompts_per_step x samples_per_prompt / mini_batches / micro_batches)")
  return p


def make_optimizer(c: ml_collections.ConfigDict, lr: float):
  """AdamW of config.optim at learning rate `lr` (policy and critic differ only in it)."""
  return ts.make_optimizer(lr=lr, warmup_steps=c.optim.warmup_steps,
                           weight_decay=c.optim.weight_decay, grad_clip=c.optim.grad_clip,
                           b1=c.optim.b1, b2=c.optim.b2,
                           master_weights=c.optim.master_weights)


@dataclasses.dataclass
class Role:
  """One trained model of the run (the policy, the critic): its graph, TrainState (parameters
  and optimiser state), other state `rest` (MoE router biases, replicated), optimiser, and
  jitted update (`update_fn`; None until the trainer builds it from the final state)."""
  graphdef: Any
  state: ts.TrainState
  rest: Any
  optimizer: Any
  update: Callable | None = None


def train_state(c: ml_collections.ConfigDict, placement: Placement, params,
                optimizer) -> ts.TrainState:
  """A fresh TrainState of `params` on the run's mesh (config.optim.offload_state)."""
  return placement.train_state(params, optimizer, offload=c.optim.offload_state)


def policy(c: ml_collections.ConfigDict, placement: Placement) -> Role:
  """The run's policy, built on the mesh (config.init_hf_dir or the random init), then
  config.init_checkpoint's weights when set; `rest` (MoE router biases) replicated."""
  graphdef, params, rest = nnx.split(build_policy(c, placement.mesh), nnx.Param, ...)
  optimizer = make_optimizer(c, c.optim.lr)
  role = Role(graphdef, train_state(c, placement, params, optimizer),
              jax.device_put(rest, placement.replicated), optimizer)
  if c.init_checkpoint:
    params, role.rest = load_init(c.init_checkpoint, role.state.params, role.rest, placement)
    role.state = train_state(c, placement, params, optimizer)
  return role


def critic(c: ml_collections.ConfigDict, model_cfg: ModelConfig, placement: Placement,
           policy_params, policy_rest) -> Role:
  """The value model: the policy's architecture with a scalar head and its own learning rate
  (config.optim.critic_lr). config.rl.critic_init "policy": every weight but the head is a copy
  of the policy's starting weights (`policy_params`, `policy_rest`: the SFT checkpoint of a
  demo run), the scalar head fresh, as VAPO and verl start the critic from a trained model;
  "random": its own initialisation."""
  model = Transformer(model_cfg.replace(head="scalar", tie_embeddings=False),
                      rngs=nnx.Rngs(params=c.seed + 1))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  if c.rl.critic_init == "policy":
    params = _copy_backbone(params, policy_params)
    rest = _copy_backbone(rest, policy_rest)
  optimizer = make_optimizer(c, c.optim.critic_lr)
  return Role(graphdef, train_state(c, placement, params, optimizer),
              jax.device_put(rest, placement.replicated), optimizer)


def _copy_backbone(target, source):
  """`target` with each leaf that `source` holds at the same path and shape replaced by a copy
  of it (a copy: the policy's update donates its buffers). The head is never taken: the
  critic's scalar head has no counterpart, and an untied LM head's path would mismatch."""
  held = {path: leaf for path, leaf in jax.tree_util.tree_flatten_with_path(source)[0]}

  def take(path, leaf):
    theirs = held.get(path)
    if (theirs is None or jax.tree_util.keystr(path[:1]) == "['head']"
        or theirs.shape != leaf.shape):
      return leaf
    return jnp.array(theirs, dtype=leaf.dtype, copy=True)
  return jax.tree_util.tree_map_with_path(take, target)


def update_fn(objective, c: ml_collections.ConfigDict, placement: Placement, graphdef,
              optimizer, state, **objective_kwargs):
  """The jitted update of `objective` (rl/core/train_step.py) with the state's layout pinned:
  the update keeps the state where placement put it (the batch comes placed by
  Placement.put_batch, its rows over the mesh's batch axes)."""
  return ts.make_update(
      objective, graphdef, optimizer, micro_batches=c.train.micro_batches, rl=c.rl.to_dict(),
      max_len=c.rollout.max_new_tokens, state_sharding=placement.state_sharding(state),
      offload_optimizer=bool(c.optim.offload_state), **objective_kwargs)


def token_logprobs_fn(graphdef, temperature: float):
  """A jitted `logprobs(params, rest, tokens, routing, kept_ids) -> [B, T]` of the policy's
  architecture: each token's log-prob at the sampling temperature (0 at position 0), restricted
  to the sampler's kept set when `kept_ids` is given. One function for the reference model
  and the trainer's own parameters (the sampler gap): it compiles once per batch shape."""

  @jax.jit
  def logprobs(params, rest, tokens, routing, kept_ids):
    model = nnx.merge(graphdef, params, rest)
    out = model.forward(tokens, routing=routing)
    kept = None
    if kept_ids is not None:
      kept = kept_mask_from_ids(kept_ids[:, 1:], out.logits.shape[-1])
    logp = next_token_logprobs(out.logits, tokens, temperature=temperature, kept_mask=kept)
    return jnp.pad(logp, ((0, 0), (1, 0)))
  return logprobs


def load_init(directory: str, params, rest, placement: Placement):
  """(params, rest) of an earlier stage's checkpoint (e.g. SFT): policy parameters and MoE
  router biases, or parameters only (an older SFT stage; the biases keep `rest`)."""
  init = Checkpointer(directory)
  step = init.latest_step()
  if step is None:
    raise FileNotFoundError(f"config.init_checkpoint={directory!r} holds no checkpoint")
  try:
    restored, _ = init.restore(step, {"params": params, "rest": rest}, partial=True)
    rest = jax.device_put(restored["rest"], placement.replicated)
  except ValueError:  # a checkpoint of parameters only (an older SFT stage)
    restored, _ = init.restore(step, {"params": params}, partial=True)
    logging.warning("%s step %d holds parameters only: the MoE router biases start from "
                    "their initial values", directory, step)
  init.close()
  return restored["params"], rest


# ======================================================================== Rollout

@dataclasses.dataclass
class Sources:
  """Where the run's trajectories come from (`rollout_sources`): `train` for the steps,
  `heldout` for the held-out evaluations, and the sampler's quantised `weights`
  (`sampler_weights`; None: it samples with the trainer's own)."""
  train: RolloutSource
  heldout: RolloutSource
  weights: fp8.SamplerWeights | None


def sampler_weights(c: ml_collections.ConfigDict) -> fp8.SamplerWeights | None:
  """The sampler's quantised weights (config.rollout.weight_dtype), or None: it samples with
  the trainer's own."""
  if not c.rollout.weight_dtype:
    return None
  return fp8.SamplerWeights(c.rollout.weight_dtype, block_size=c.rollout.weight_block_size)


def rollout_sources(c: ml_collections.ConfigDict, tokenizer, placement: Placement,
                    episodes: ToolEpisodes | None, *, resuming: bool
                    ) -> tuple[RolloutSource, RolloutSource]:
  """(training source, held-out evaluation source) of the run:

  - tool-use episodes (config.tools.enabled): `episodes`' multi-turn episodes for both;
  - streaming (config.rollout.streaming.enabled): partial generations carry over between steps,
    each token keeping the log-prob and version of the policy that sampled it;
  - otherwise the rollout engine's single-turn generation.

  Training samples config.train.samples_per_prompt responses per prompt with config.rollout;
  evaluation one per prompt at config.rollout.eval_temperature (0: greedy), never streamed."""
  if c.rollout.streaming.enabled and episodes is not None:
    raise ValueError("config.rollout.streaming.enabled=True with config.tools.enabled=True: "
                     "multi-turn tool episodes are not streamed; turn one of them off")
  train_cfg = rollout_lib.run_rollout_config(c, stop_ids=tokenizer.stop_ids,
                                             pad_id=tokenizer.pad_id)
  eval_cfg = train_cfg.replace(greedy=c.rollout.eval_temperature == 0,
                               temperature=c.rollout.eval_temperature or 1.0,
                               keep_sampling_mask=False, keep_routing=False)
  samples = c.train.samples_per_prompt
  if episodes is not None:
    return (episodes.source(train_cfg, num_samples=samples),
            episodes.source(eval_cfg, num_samples=1))
  mesh = placement.rollout_mesh
  evaluation = EngineSource(eval_cfg, num_samples=1, mesh=mesh)
  if not c.rollout.streaming.enabled:
    return EngineSource(train_cfg, num_samples=samples, mesh=mesh), evaluation
  s = c.rollout.streaming
  if resuming:
    logging.warning("streaming rollouts: the pool of partial generations is not in the "
                    "checkpoint; the resumed run starts with an empty pool")
  stream = StreamingRollout(
      train_cfg, StreamingConfig(on_policy_fraction=s.on_policy_fraction,
                                 max_staleness=s.max_staleness, round_tokens=s.round_tokens),
      num_samples=samples, seed=c.seed, mesh=mesh, rules=placement.rules)
  return StreamingSource(stream, num_groups=c.train.prompts_per_step), evaluation
