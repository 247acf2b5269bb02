"""What the RL trainer (rl/jobs/trainer.py) builds before its first step, from the run config:
its prompts and grader, the policy and critic with their optimisers on the run's mesh, the jitted updates, the one
jitted log-prob forward (reference model and sampler gap), the start from an earlier stage's
checkpoint, and the rollout sources (rl/rollout/sources.py) for training and evaluation."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging
from flax import nnx

from models.config import ModelConfig
from models.transformer import Transformer
from rl.core import train_step as ts
from rl.core.policy import build_policy
from rl.data.entries import encode_prompts, load_entries
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

def data(c: ml_collections.ConfigDict, tokenizer, episodes: ToolEpisodes | None):
  """(train entries, held-out entries, encode, grader). Tool-use episodes bring their
  environments' tasks, chat prompts and grader (verifier + judge); otherwise config.data's
  entries, its prompt template and the grading registry config.reward builds
  (rl/jobs/reward_models.py, rl/jobs/batch.ResponseGrader)."""
  if episodes is not None:
    return (*episodes.entries(), episodes.encode, episodes)
  encode = functools.partial(encode_prompts, tokenizer=tokenizer,
                             template=c.data.prompt_template)
  return (*load_entries(c, tokenizer), encode,
          ResponseGrader(tokenizer, reward_models.graders_from_config(c)))


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


def policy(c: ml_collections.ConfigDict, placement: Placement):
  """(graphdef, params, rest) of the run's policy, built on the mesh; `rest` (MoE router
  biases) replicated."""
  graphdef, params, rest = nnx.split(build_policy(c, placement.mesh), nnx.Param, ...)
  return graphdef, params, jax.device_put(rest, placement.replicated)


def critic(c: ml_collections.ConfigDict, model_cfg: ModelConfig, placement: Placement,
           policy_params, policy_rest):
  """(graphdef, rest, optimizer, train state) of the value model: the policy's architecture
  with a scalar head and its own learning rate (config.optim.critic_lr). config.rl.critic_init
  "policy": every weight but the head is a copy of the policy's starting weights
  (`policy_params`, `policy_rest`: the SFT checkpoint of a demo run), the scalar head fresh, as
  VAPO and verl start the critic from a trained model; "random": its own initialisation."""
  model = Transformer(model_cfg.replace(head="scalar", tie_embeddings=False),
                      rngs=nnx.Rngs(params=c.seed + 1))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  if c.rl.critic_init == "policy":
    params = _copy_backbone(params, policy_params)
    rest = _copy_backbone(rest, policy_rest)
  optimizer = make_optimizer(c, c.optim.critic_lr)
  state = placement.train_state(params, optimizer, offload=c.optim.offload_state)
  return graphdef, jax.device_put(rest, placement.replicated), optimizer, state


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
      num_samples=samples, seed=c.seed, mesh=mesh)
  return StreamingSource(stream, num_groups=c.train.prompts_per_step), evaluation
