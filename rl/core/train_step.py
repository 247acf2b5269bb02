"""The pure, jitted update steps of the RL trainer: one optimiser step of the policy (PPO-family
loss, optional KL / entropy / positive-example NLL terms) and of the critic, over one
mini-batch split into gradient-accumulation micro-batches.

Token normalisation is global: the token and sequence counts of the whole mini-batch are taken
before the micro-batch loop and every micro-batch's loss is divided by them, so the summed
micro-batch gradients equal the unsplit gradient exactly (the per-micro-batch mean is the bug
verl shipped). Across data-parallel shards the same holds because the counts are sums over the
global (sharded) batch arrays.

Alignment: arrays are [B, T] over the token sequence; the log-prob of token t comes from the
logits at position t - 1, so the loss runs over positions 1..T-1 (`[:, 1:]` of every per-token
input, logits `[:, :-1]`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models import remat as remat_lib
from models.transformer import update_router_biases
from rl.core import advantages, algorithms, losses
from rl.core.sampling import kept_mask_from_ids, masked_logprobs, token_logprobs


class TrainState(NamedTuple):
  params: Any  # nnx.State of nnx.Param
  opt_state: Any
  step: jax.Array


class MasterState(NamedTuple):
  master: Any  # float32 copy of every parameter: what the optimiser updates
  inner: Any  # the wrapped optimiser's state, over the float32 copy


def fp32_master(inner: optax.GradientTransformation) -> optax.GradientTransformation:
  """`inner` run on float32 master weights kept in the optimiser state: each step updates the
  master copy in float32 and sets the parameters to it rounded to their own dtype. A bf16
  parameter otherwise loses every AdamW step smaller than half its ulp (at lr 1e-6 and weights
  near 0.01, all of them); with a master copy the steps accumulate until they show."""

  def init(params):
    master = jax.tree.map(lambda p: jnp.asarray(p, jnp.float32), params)
    return MasterState(master, inner.init(master))

  def update(grads, state, params=None):
    grads = jax.tree.map(lambda g: g.astype(jnp.float32), grads)
    steps, inner_state = inner.update(grads, state.inner, state.master)
    master = optax.apply_updates(state.master, steps)
    # Exact in float32 (both ends are representable in the parameter's dtype), so
    # apply_updates lands each parameter on its master weight rounded to its dtype.
    updates = jax.tree.map(
        lambda m, p: m.astype(p.dtype).astype(jnp.float32) - p.astype(jnp.float32),
        master, params)
    return updates, MasterState(master, inner_state)

  return optax.GradientTransformation(init, update)


def make_optimizer(*, lr: float, warmup_steps: int | None, weight_decay: float,
                   grad_clip: float, decay_steps: int = 0, final_lr_fraction: float = 1.0,
                   b1: float = 0.9, b2: float = 0.999,
                   master_weights: bool = False) -> optax.GradientTransformation:
  """Every optimiser of the project (RL policy and critic, SFT, the preference trainers, the
  tool-use warm start): global-norm clip of the gradient, then AdamW (optax's eps, weight decay
  on every parameter) with the learning rate

    warmup_steps=None                 lr from the first step (preference trainers, tool warm
                                      start);
    warmup_steps=w                    linear from 0 over max(w, 1) steps, then constant (the
                                      DAPO/VAPO schedule of the RL update; w = 0 still spends
                                      its first step at lr 0);
    warmup_steps=w, decay_steps=n     linear from 0 over min(w, n - 1) steps, then cosine decay
                                      to final_lr_fraction * lr at step n (SFT).

  master_weights: the whole chain runs on float32 master weights (`fp32_master`), for
  parameters stored in 16 bits.
  """
  if warmup_steps is None:
    learning_rate = lr
  elif decay_steps:
    learning_rate = optax.warmup_cosine_decay_schedule(
        0.0, lr, min(warmup_steps, decay_steps - 1), decay_steps,
        end_value=lr * final_lr_fraction)
  else:
    warmup = optax.linear_schedule(0.0, lr, max(warmup_steps, 1))
    learning_rate = optax.join_schedules([warmup, optax.constant_schedule(lr)],
                                         [max(warmup_steps, 1)])
  chain = optax.chain(optax.clip_by_global_norm(grad_clip),
                      optax.adamw(learning_rate, b1=b1, b2=b2, weight_decay=weight_decay))
  return fp32_master(chain) if master_weights else chain


def gradient_step(loss_fn: Callable, optimizer: optax.GradientTransformation) -> Callable:
  """`step(params, opt_state, *args) -> (params, opt_state, loss, aux)`: one optimiser step on
  the gradient of `loss_fn(params, *args) -> (loss, aux)`, the whole batch at once (the SFT,
  preference and tool warm-start steps; the RL update, with gradient accumulation and skipped
  non-finite steps, is `make_update`). Unjitted: each caller jits it with its own donation and
  layouts."""
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def step(params, opt_state, *args):
    (loss, aux), grads = grad_fn(params, *args)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, aux
  return step


def init_state(params, optimizer: optax.GradientTransformation) -> TrainState:
  return TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32))


def _split_micro(batch: dict, micro_batches: int) -> dict:
  def split(x):
    return x.reshape(micro_batches, x.shape[0] // micro_batches, *x.shape[1:])
  return jax.tree.map(split, batch)


# The update's mini-batch (Trainer.build_batch): the fields every update reads, then those a
# feature adds (keep-routing, keep-sampling-mask, KL to the reference); the advantage
# estimator's outputs (rl/core/advantages.py, e.g. GAE's critic targets) are fields too.
BATCH_FIELDS = ("tokens", "response_mask", "attention_mask", "logp_old", "advantages", "acc")
OPTIONAL_BATCH_FIELDS = ("routing", "kept_ids", "logp_ref", "kl_coef")


def check_batch(batch: dict, rl: dict) -> None:
  """Refuses a mini-batch with an unknown key (not a field above nor an output of the estimator
  `rl["estimator"]`) or without a field every update reads: a misnamed optional key fails here
  instead of quietly switching its feature off."""
  known = BATCH_FIELDS + OPTIONAL_BATCH_FIELDS + tuple(
      k for k in advantages.ESTIMATOR_REGISTRY[rl["estimator"]].outputs if k not in BATCH_FIELDS)
  unknown = sorted(set(batch) - set(known))
  if unknown:
    raise ValueError(f"update batch: unknown fields {unknown}; known: {list(known)}")
  missing = [k for k in BATCH_FIELDS if k not in batch]  # features' fields: read unguarded
  if missing:
    raise ValueError(f"update batch: missing fields {missing}")


def global_counts(batch: dict, rl: dict) -> dict:
  """Normalisers of the whole mini-batch (all micro-batches, all data shards)."""
  mask = batch["response_mask"][:, 1:].astype(jnp.float32)
  counts = {"num_tokens": jnp.maximum(jnp.sum(mask), 1.0),
            "num_seqs": jnp.asarray(mask.shape[0], jnp.float32),
            "num_attended": jnp.maximum(jnp.sum(batch["attention_mask"]), 1.0)}
  if rl["nll_coef"]:
    positive = mask * (batch["acc"][:, None] > 0)
    counts["num_positive_tokens"] = jnp.maximum(jnp.sum(positive), 1.0)
  return counts


def policy_objective(params, graphdef, rest, batch: dict, counts: dict, *, rl: dict,
                     temperature: float, max_len: int,
                     router_aux_loss_coef: float = 0.0) -> tuple[jax.Array, dict]:
  """Loss of one micro-batch, already divided by the global counts; metrics are likewise
  global token means (so they sum over micro-batches; `*_max` / `*_min` combine by max / min),
  the policy loss's own metrics (config.rl.policy_loss's registry entry) among them. MoE models
  add `router_aux_loss_coef` x the sequence-wise balance loss (models/moe.py) and report the
  per-layer expert load `router_load` [n_moe_layers, E] (tokens summed over micro-batches),
  which the trainer feeds to the aux-loss-free bias update."""
  model = nnx.merge(graphdef, params, rest)
  routing = batch.get("routing") if rl["keep_routing"] else None
  stage = "sparse" if rl["indexer_coef"] else None
  out = model.forward(batch["tokens"], routing=routing, token_mask=batch["attention_mask"],
                      indexer_stage=stage)
  kept = None
  if rl["keep_sampling_mask"] and batch.get("kept_ids") is not None:
    kept = kept_mask_from_ids(batch["kept_ids"][:, 1:], out.logits.shape[-1])
  logp_all = masked_logprobs(out.logits[:, :-1], temperature=temperature, kept_mask=kept)
  targets = batch["tokens"][:, 1:]
  logp = token_logprobs(logp_all, targets)
  mask = batch["response_mask"][:, 1:].astype(jnp.float32)
  logp_old = batch["logp_old"][:, 1:]
  adv = batch["advantages"][:, 1:]
  agg = dict(num_tokens=counts["num_tokens"], num_seqs=counts["num_seqs"], max_len=max_len)

  pg_mask = mask
  if rl["offpolicy_mask_delta"]:
    keep = losses.off_policy_sequence_mask(jax.lax.stop_gradient(logp), logp_old, adv, mask,
                                           delta=rl["offpolicy_mask_delta"])
    pg_mask = mask * keep
  loss, pg_metrics = losses.POLICY_LOSS_REGISTRY[rl["policy_loss"]](logp, logp_old, adv,
                                                                    pg_mask, rl, **agg)

  def token_mean(x, m=mask):
    return losses.aggregate(x, m, "token-mean", num_tokens=counts["num_tokens"])

  metrics = dict(pg_metrics, offpolicy_masked_frac=token_mean(mask - pg_mask))
  if algorithms.kl_on(rl):
    logp_ref = batch["logp_ref"][:, 1:]
    per_token = losses.KL_REGISTRY[rl["kl_kind"]](logp, logp_old, logp_ref)
    beta = batch["kl_coef"][:, None]  # per-sequence (per-domain) beta
    kl_loss = losses.aggregate(beta * per_token, mask, rl["loss_agg_mode"], **agg)
    loss = loss + kl_loss
    metrics["kl"] = token_mean(per_token)
  entropy = losses.entropy_from_logprobs(logp_all)
  metrics["entropy"] = token_mean(entropy)
  if rl["entropy_coef"]:
    loss = loss - rl["entropy_coef"] * losses.aggregate(entropy, mask, rl["loss_agg_mode"], **agg)
  if stage is not None:
    # DSA indexer KL on the sampled sequences (inputs detached: trains only the indexer).
    loss = loss + rl["indexer_coef"] * out.indexer_loss / counts["num_attended"]
    metrics["indexer_kl"] = out.indexer_metrics["indexer_kl"] / counts["micro_batches"]
  if rl["nll_coef"]:
    positive = mask * (batch["acc"][:, None] > 0)
    nll = losses.aggregate(-logp, positive, "token-mean",
                           num_tokens=counts["num_positive_tokens"])
    loss = loss + rl["nll_coef"] * nll
    metrics["nll_positive"] = nll
  loss, metrics = add_router_balance(loss, metrics, out.router_stats, router_aux_loss_coef,
                                     counts["micro_batches"])
  return loss, metrics


def add_router_balance(loss, metrics: dict, stats, coef: float, micro_batches) -> tuple:
  """MoE load balancing terms of one micro-batch: `coef` x the mean over MoE layers of the
  sequence-wise balance loss (divided by the micro-batch count, so micro-batches sum to the
  mean), the expert load `router_load` [n_moe_layers, E] for the bias update and the share of
  assignments the expert capacity dropped (`moe_dropped_fraction`). Dense models pass
  through."""
  if stats is None:
    return loss, metrics
  balance = jnp.mean(stats.aux_loss)
  # Share of the valid (token, expert) assignments the expert capacity dropped, all MoE layers.
  dropped = jnp.sum(stats.dropped) / jnp.maximum(jnp.sum(stats.tokens_per_expert), 1.0)
  metrics = dict(metrics, router_aux_loss=balance / micro_batches,
                 moe_dropped_fraction=dropped / micro_batches,
                 router_load=stats.tokens_per_expert)
  if coef:
    loss = loss + coef * balance / micro_batches
  return loss, metrics


def make_rebalance(graphdef, rate: float) -> Callable:
  """A jitted `rebalance(params, rest, router_load) -> rest`: one aux-loss-free bias step of
  every MoE router (models.transformer.update_router_biases) from the load a step saw."""
  @jax.jit
  def rebalance(params, rest, router_load):
    model = nnx.merge(graphdef, params, rest)
    update_router_biases(model, router_load, rate)
    return nnx.split(model, nnx.Param, ...)[2]
  return rebalance


def load_metrics(router_load) -> dict[str, float]:
  """Per MoE layer i: `moe/load_max_over_mean/i` (1 = perfectly balanced) and
  `moe/load_cv/i` (coefficient of variation of tokens per expert)."""
  out = {}
  for i, load in enumerate(np.asarray(router_load, np.float64)):
    mean = max(load.mean(), 1e-9)
    out[f"moe/load_max_over_mean/{i}"] = float(load.max() / mean)
    out[f"moe/load_cv/{i}"] = float(load.std() / mean)
  return out


def critic_objective(params, graphdef, rest, batch: dict, counts: dict, *, rl: dict,
                     max_len: int) -> tuple[jax.Array, dict]:
  model = nnx.merge(graphdef, params, rest)
  values = model.forward(batch["tokens"], token_mask=batch["attention_mask"]).values
  values = values[:, :-1]  # value of the state that produced token t sits at t - 1
  mask = batch["response_mask"][:, 1:].astype(jnp.float32)
  loss = losses.value_loss(values, batch["values"][:, 1:], batch["returns"][:, 1:], mask,
                           clip=rl["value_clip"], agg="token-mean",
                           num_tokens=counts["num_tokens"])
  return loss, {"value_loss": loss}


def _combine(name: str) -> tuple[Callable, float]:
  """(op, start) of an objective's metric over micro-batches: max for `*_max`, min for
  `*_min`, else the sum."""
  if name.endswith("_max"):
    return jnp.maximum, -jnp.inf
  if name.endswith("_min"):
    return jnp.minimum, jnp.inf
  return jnp.add, 0.0


def make_update(objective: Callable, graphdef, optimizer: optax.GradientTransformation, *,
                micro_batches: int, rl: dict, state_sharding=None, batch_sharding=None,
                offload_optimizer: bool = False, **objective_kwargs) -> Callable:
  """A jitted `update(state, rest, minibatch) -> (state, metrics)` with gradient accumulation;
  `rest` is the model's non-parameter state (e.g. MoE router biases), an argument because the
  trainer's bias updates change it between steps.

  `state_sharding` / `batch_sharding` (pytrees of NamedSharding, or None to let XLA choose)
  pin the layouts; the state is donated.

  `offload_optimizer`: the optimiser state lives in pinned host memory between steps (pass it
  there, e.g. `jax.device_put(opt_state, remat.host_shardings(state_sharding.opt_state))`)
  and comes onto the device only for the update (models/remat.py); needs `state_sharding`.

  The objective's metrics (a flat dict) add up over the micro-batches, except those named
  `*_max` / `*_min`, which take the max / min.

  A step whose loss or gradient is non-finite leaves the state unchanged and reports
  `skipped = 1` (the trainer counts these and stops a run that keeps producing them).
  """
  def micro_loss(params, rest, micro, counts):
    return objective(params, graphdef, rest, micro, counts, rl=rl, **objective_kwargs)

  grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

  if offload_optimizer:
    if state_sharding is None:
      raise ValueError("offload_optimizer=True needs state_sharding (the optimiser state's "
                       "device layout, moved to pinned host memory between steps)")
    opt_on_device = remat_lib.device_shardings(state_sharding.opt_state)
    opt_on_host = remat_lib.host_shardings(state_sharding.opt_state)
    state_sharding = state_sharding._replace(opt_state=opt_on_host)

  def update(state: TrainState, rest, minibatch: dict):
    check_batch(minibatch, rl)  # at trace time: a new set of keys traces anew
    if offload_optimizer:
      state = state._replace(opt_state=jax.device_put(state.opt_state, opt_on_device))
    counts = dict(global_counts(minibatch, rl),
                  micro_batches=jnp.asarray(micro_batches, jnp.float32))
    micros = _split_micro(minibatch, micro_batches)

    def body(carry, micro):
      grads_acc, loss_acc, metrics_acc = carry
      (loss, metrics), grads = grad_fn(state.params, rest, micro, counts)
      metrics = {k: _combine(k)[0](metrics_acc[k], v) for k, v in metrics.items()}
      return (jax.tree.map(jnp.add, grads_acc, grads), loss_acc + loss, metrics), None

    zero_grads = jax.tree.map(jnp.zeros_like, state.params)
    first = jax.tree.map(lambda x: x[0], micros)
    metric_shapes = jax.eval_shape(lambda: micro_loss(state.params, rest, first, counts)[1])
    zero_metrics = {k: jnp.full(s.shape, _combine(k)[1], s.dtype)
                    for k, s in metric_shapes.items()}
    (grads, loss, metrics), _ = jax.lax.scan(body, (zero_grads, jnp.zeros(()), zero_metrics),
                                             micros)
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, new_opt = optimizer.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    new_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                             TrainState(new_params, new_opt, state.step + 1), state)
    metrics = dict(metrics, loss=loss, grad_norm=grad_norm,
                   skipped=(~finite).astype(jnp.float32))
    if offload_optimizer:
      new_state = new_state._replace(opt_state=jax.device_put(new_state.opt_state, opt_on_host))
    return new_state, metrics

  if state_sharding is None and batch_sharding is None:
    return jax.jit(update, donate_argnums=0)
  return jax.jit(update, donate_argnums=0, in_shardings=(state_sharding, None, batch_sharding),
                 out_shardings=(state_sharding, None))
