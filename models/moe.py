"""Mixture-of-Experts feed-forward block behind one interface.

Routers:
- "softmax" (Qwen3-MoE): p = softmax(router logits); top-k; optionally renormalised.
- "sigmoid_noaux" (DeepSeek-V3 noaux_tc): s = sigmoid(logits); choice scores s + bias (the
  auxiliary-loss-free load-balancing bias, not trained by gradients); experts live in n_group
  groups scored by the sum of their top-2 choice scores; only the best topk_group groups may be
  picked; gate weights are s (without the bias) at the picked experts, renormalised, times
  routed_scaling_factor.

Dispatch:
- "ragged": dropless; assignments sorted by expert, grouped matmuls with jax.lax.ragged_dot,
  weighted scatter-add back to tokens (`models.ops.expert_ffn`: on CPU, the same FFN with each
  expert on its own tokens in tiles); with an expert mesh axis, exchanged across it
  (models/moe_ep.py);
- "dense": every expert on every token, combined with one-hot gate weights (the reference).

Routing replay (DeepSeek-V3.2 keep-routing): a caller may pass the expert ids to use; the gate
weights are still computed from the current router, so the router keeps its gradients.
Per-call router statistics (RouterStats) feed the load metrics, the aux-free bias update
(`aux_free_bias_update`, applied by the trainers after each optimiser step through
models.transformer.update_router_biases at rate cfg.router_bias_rate) and the sequence-wise
auxiliary loss (weight cfg.router_aux_loss_coef), both used by rl/jobs/sft.py and rl/core/train_step.py.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from models import moe_ep, ops
from models.config import ModelConfig
from models.layers import MLP, param


class RouterBias(nnx.Variable):
  """Aux-loss-free load-balancing bias: updated by `aux_free_bias_update`, never by gradients."""


class RouterStats(NamedTuple):
  tokens_per_expert: jax.Array  # [E] assignments counted over valid tokens
  mean_prob: jax.Array  # [E] mean normalised router probability over valid tokens
  aux_loss: jax.Array  # scalar: mean over sequences of E/k * sum_e f_e * P_e (DeepSeek-V3)
  dropped: jax.Array  # scalar int32: valid assignments the expert capacity dropped (moe_ep)


class Router(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.kernel = param(rngs, (cfg.d_model, cfg.n_experts), ("embed", None), std=cfg.init_std,
                        dtype=cfg.param_dtype)
    self.bias = (RouterBias(jnp.zeros((cfg.n_experts,), jnp.float32))
                 if cfg.router == "sigmoid_noaux" else None)

  def scores(self, x: jax.Array) -> jax.Array:
    """Router scores [N, E] in fp32: softmax probabilities or sigmoid affinities."""
    logits = x.astype(jnp.float32) @ self.kernel[...].astype(jnp.float32)
    if self.cfg.router == "softmax":
      return jax.nn.softmax(logits, axis=-1)
    return jax.nn.sigmoid(logits)

  def select(self, scores: jax.Array) -> jax.Array:
    """Expert ids [N, k] chosen from the scores."""
    cfg = self.cfg
    if cfg.router == "softmax":
      return jax.lax.top_k(scores, cfg.n_experts_per_tok)[1]
    choice = scores + self.bias[...]
    if cfg.n_group > 1:
      n = choice.shape[0]
      grouped = choice.reshape(n, cfg.n_group, cfg.n_experts // cfg.n_group)
      group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, n_group]
      top_groups = jax.lax.top_k(group_scores, cfg.topk_group)[1]
      group_ok = jnp.zeros((n, cfg.n_group), bool).at[jnp.arange(n)[:, None], top_groups].set(True)
      expert_ok = jnp.repeat(group_ok, cfg.n_experts // cfg.n_group, axis=1)
      # Experts outside the chosen groups can never be picked (-inf, so a negative bias
      # inside an allowed group cannot lose to a masked expert).
      choice = jnp.where(expert_ok, choice, -jnp.inf)
    return jax.lax.top_k(choice, cfg.n_experts_per_tok)[1]

  def gate_weights(self, scores: jax.Array, expert_ids: jax.Array) -> jax.Array:
    """Gate weights [N, k] at the given experts (differentiable w.r.t. the router)."""
    cfg = self.cfg
    weights = jnp.take_along_axis(scores, expert_ids, axis=-1)
    if cfg.norm_topk_prob:
      weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor


def router_stats(scores: jax.Array, expert_ids: jax.Array, token_mask: jax.Array,
                 n_experts: int, batch: int = 1) -> RouterStats:
  """Load statistics of one MoE call over its valid tokens: scores [N, E], expert_ids [N, k]
  and token_mask [N] for N = batch x T tokens, row-major by sequence.

  aux_loss is DeepSeek-V3's sequence-wise balance loss: per sequence, f_e = E / (k T) x (tokens
  sent to e) and P_e = mean normalised score of e over the sequence's T valid tokens; the loss
  sum_e f_e P_e (1 when perfectly balanced) averaged over sequences with a valid token."""
  valid = token_mask.astype(jnp.float32)  # [N]
  k = expert_ids.shape[-1]
  counts = jnp.zeros((n_experts,), jnp.float32).at[expert_ids].add(
      jnp.broadcast_to(valid[:, None], expert_ids.shape))
  probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
  mean_prob = jnp.sum(probs * valid[:, None], axis=0) / jnp.maximum(jnp.sum(valid), 1.0)
  # Per sequence: [batch, E] counts and probability sums.
  seq_valid = valid.reshape(batch, -1)
  seq_tokens = jnp.sum(seq_valid, axis=-1)  # [batch]
  onehot_counts = jnp.zeros((batch, n_experts), jnp.float32).at[
      jnp.arange(batch)[:, None, None], expert_ids.reshape(batch, -1, k)].add(
          seq_valid[:, :, None] * jnp.ones((1, 1, k)))
  seq_prob = jnp.einsum("bte,bt->be", probs.reshape(batch, -1, n_experts), seq_valid)
  denom = jnp.maximum(seq_tokens, 1.0)[:, None]
  f = n_experts / k * onehot_counts / denom
  per_seq = jnp.sum(f * seq_prob / denom, axis=-1)
  has_tokens = (seq_tokens > 0).astype(jnp.float32)
  aux = jnp.sum(per_seq * has_tokens) / jnp.maximum(jnp.sum(has_tokens), 1.0)
  return RouterStats(counts, mean_prob, aux, jnp.zeros((), jnp.int32))


def aux_free_bias_update(bias: jax.Array, tokens_per_expert: jax.Array, rate: float) -> jax.Array:
  """DeepSeek-V3 aux-loss-free balancing: raise the bias of under-loaded experts, lower it for
  over-loaded ones, by `rate` per step. tokens_per_expert may be summed over steps/devices."""
  load = tokens_per_expert.astype(jnp.float32)
  return bias + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)


def _combine_weights(expert_ids: jax.Array, weights: jax.Array, n_experts: int) -> jax.Array:
  """Each token's gate weight per expert, [N, E] (0 for experts it did not choose)."""
  return jnp.sum(jax.nn.one_hot(expert_ids, n_experts, dtype=weights.dtype)
                 * weights[..., None], axis=1)


def dense_experts(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, w_gate: jax.Array,
                  w_up: jax.Array, w_down: jax.Array) -> jax.Array:
  """Reference dispatch: all experts on all tokens, combined with one-hot gate weights."""
  combine = _combine_weights(expert_ids, weights, w_gate.shape[0])
  hidden = (jax.nn.silu(jnp.einsum("nd,edf->nef", x, w_gate))
            * jnp.einsum("nd,edf->nef", x, w_up))
  out = jnp.einsum("nef,efd->ned", hidden, w_down)
  return jnp.einsum("ned,ne->nd", out, combine.astype(out.dtype))


class MoE(nnx.Module):
  """Routed experts (+ shared experts) replacing the dense MLP in MoE layers."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.compute_dtype = jnp.dtype(cfg.dtype)
    e, d, f = cfg.n_experts, cfg.d_model, cfg.moe_mlp_dim
    self.router = Router(cfg, rngs=rngs)
    self.w_gate = param(rngs, (e, d, f), ("experts", "embed", "mlp"), std=cfg.init_std,
                        dtype=cfg.param_dtype)
    self.w_up = param(rngs, (e, d, f), ("experts", "embed", "mlp"), std=cfg.init_std,
                      dtype=cfg.param_dtype)
    self.w_down = param(rngs, (e, f, d), ("experts", "mlp", "embed"), std=cfg.init_std,
                        dtype=cfg.param_dtype)
    self.shared = (MLP(cfg, cfg.n_shared_experts * f, rngs=rngs)
                   if cfg.n_shared_experts else None)
    self.per_expert = False  # True: w_* are lists of E per-expert params (`store_per_expert`)

  def store_per_expert(self) -> None:
    """Replaces the stacked expert weights [E, ...] by nnx.Lists of their E experts, in place:
    the CPU rollout engine's layout (`models.ops.sampler_layout`), where `ops.expert_ffn` then
    multiplies by an expert's weights where they lie instead of copying them out of the stack
    for every product. Expert e's gate and up kernels lie side by side in one [D, 2F] array
    (`w_gate[e]`, gate | up; `w_up` is None), so one product reads both: a decode row's 8
    layers x 8 experts of the Qwen3-MoE shape take 64 products there instead of 128. A second
    copy of the experts' weights, held as long as the layout is. Kept stacked under the "dense"
    reference dispatch, which takes them stacked."""
    if self.per_expert or self.cfg.moe_dispatch != "ragged":
      return
    gate, up, down = self.w_gate[...], self.w_up[...], self.w_down[...]
    self.w_gate = nnx.List([nnx.Param(jnp.concatenate([gate[e], up[e]], axis=-1))
                            for e in range(gate.shape[0])])
    self.w_up = None
    self.w_down = nnx.List([nnx.Param(down[e]) for e in range(down.shape[0])])
    self.per_expert = True

  def _expert_weights(self, dt, stacked: bool) -> tuple:
    """(w_gate, w_up, w_down) in dtype dt: stacked [E, ...] arrays, or with the per-expert layout
    and `stacked` False, that layout's tuples (E gate | up arrays, None, E down arrays)."""
    if not self.per_expert:
      return tuple(getattr(self, n)[...].astype(dt) for n in ("w_gate", "w_up", "w_down"))
    gate_up = tuple(p[...].astype(dt) for p in self.w_gate)
    down = tuple(p[...].astype(dt) for p in self.w_down)
    if not stacked:
      return gate_up, None, down
    gate_up, width = jnp.stack(gate_up), self.cfg.moe_mlp_dim
    return gate_up[..., :width], gate_up[..., width:], jnp.stack(down)

  def __call__(self, x: jax.Array, *, expert_ids: jax.Array | None = None,
               token_mask: jax.Array | None = None, dispatch: str | None = None):
    """x [B, T, D] -> (y [B, T, D], expert_ids [B, T, k] int32, RouterStats)."""
    cfg = self.cfg
    batch, steps, dim = x.shape
    flat = x.reshape(batch * steps, dim)
    scores = self.router.scores(flat)
    if expert_ids is None:
      ids = self.router.select(scores)
    else:
      ids = expert_ids.reshape(batch * steps, cfg.n_experts_per_tok).astype(jnp.int32)
    weights = self.router.gate_weights(scores, ids)
    mask = (jnp.ones((batch * steps,), bool) if token_mask is None
            else token_mask.reshape(-1).astype(bool))
    stats = router_stats(scores, ids, mask, cfg.n_experts, batch)
    dt = self.compute_dtype
    if (dispatch or cfg.moe_dispatch) == "ragged":
      # Expert parallelism when the ambient mesh (jax.set_mesh) has an "expert" axis > 1,
      # bounded by the capacity factor (0: dropless).
      mesh = moe_ep.ambient_mesh()
      if mesh is not None and cfg.moe_capacity_factor:
        stats = stats._replace(dropped=moe_ep.dropped_assignments(
            ids, cfg.n_experts, mesh, cfg.moe_capacity_factor, mask))
      experts = moe_ep.dispatch_for_mesh(ops.expert_ffn, mesh,
                                         capacity_factor=cfg.moe_capacity_factor)
    else:
      experts = dense_experts
    # Only the local dropless FFN takes per-expert weights; the others get them stacked again.
    stacked = experts is not ops.expert_ffn
    y = experts(flat.astype(dt), ids, weights.astype(dt), *self._expert_weights(dt, stacked))
    y = y.reshape(batch, steps, dim)
    if self.shared is not None:
      y = y + self.shared(x)
    return y, ids.reshape(batch, steps, -1).astype(jnp.int32), stats
