"""MoE load balancing during training: DeepSeek-V3's sequence-wise balance loss against
hand-computed values, the aux-loss-free bias step (direction, rate, not a gradient leaf), and
that SFT with balancing on ends with a tighter per-expert load than with it off."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from configs import demo
from models import moe
from models.transformer import build
from rl.core.policy import build_policy
from rl.config.validation import validate
from rl.jobs import sft
from rl.core import train_step as ts
from rl.jobs.checkpoint import Checkpointer
from rl.data.entries import load_entries
from models.tokenizer import load_tokenizer


def test_sequence_wise_balance_loss_by_hand():
  """Two sequences of two tokens, E = 4 experts, top-2. Sequence 0 sends both tokens to
  experts {0, 1}; sequence 1 spreads them over {0, 1} and {2, 3}. With normalised scores p,
  f_e = E / (k T) x count_e and P_e = mean p over the sequence: L = mean_b sum_e f_e P_e."""
  scores = jnp.array([[0.4, 0.4, 0.1, 0.1],
                      [0.4, 0.4, 0.1, 0.1],
                      [0.4, 0.4, 0.1, 0.1],
                      [0.1, 0.1, 0.4, 0.4]])
  ids = jnp.array([[0, 1], [0, 1], [0, 1], [2, 3]])
  stats = moe.router_stats(scores, ids, jnp.ones(4, bool), 4, batch=2)
  # Sequence 0: f = 4/(2*2) * [2, 2, 0, 0] = [2, 2, 0, 0]; P = [.4, .4, .1, .1] -> 1.6.
  # Sequence 1: f = [1, 1, 1, 1]; P = [.25, .25, .25, .25] -> 1.0.  Mean 1.3.
  np.testing.assert_allclose(float(stats.aux_loss), 1.3, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(stats.tokens_per_expert), [3, 3, 1, 1])
  # A masked token counts in neither the load nor its sequence's means.
  masked = moe.router_stats(scores, ids, jnp.array([True, True, True, False]), 4, batch=2)
  # Sequence 1 keeps one token: f = 4/(2*1) * [1, 1, 0, 0]; P = [.4, .4, .1, .1] -> 1.6.
  np.testing.assert_allclose(float(masked.aux_loss), 1.6, rtol=1e-6)
  np.testing.assert_array_equal(np.asarray(masked.tokens_per_expert), [3, 3, 0, 0])


def test_balanced_routing_has_balance_loss_one():
  scores = jnp.full((8, 4), 0.25)
  ids = jnp.array([[0, 1], [2, 3]] * 4)
  stats = moe.router_stats(scores, ids, jnp.ones(8, bool), 4, batch=2)
  np.testing.assert_allclose(float(stats.aux_loss), 1.0, rtol=1e-6)


def test_bias_step_moves_toward_balance_and_is_not_trained_by_gradients():
  """The router bias lives outside nnx.Param (no gradient, no optimiser state); one rebalance
  step raises under-loaded experts' bias by the rate and lowers over-loaded ones'."""
  model = build("tiny_moe_mla_dsa", seed=0)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  param_paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)]
  assert not any("bias" in p and "router" in p for p in param_paths)
  load = jnp.array([[10.0, 0.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0]])  # one MoE layer, mean 5
  new_rest = ts.make_rebalance(graphdef, 0.01)(params, rest, load)
  bias = np.asarray(jax.tree.leaves(new_rest)[0])
  np.testing.assert_allclose(bias, [[-0.01, 0.01, 0, 0, 0, 0, 0, 0]], atol=1e-7)  # [layers, E]


def small_sft_config(rate: float, coef: float) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict(demo.get_config().to_dict())
  c.model.router_bias_rate, c.model.router_aux_loss_coef = rate, coef
  c.data.train_size, c.data.heldout_size = 256, 64
  c.sft.update(epochs=8, batch_size=16, dense_steps=0, dense_warmup_steps=20, log_every=1000)
  c.mesh.devices = 1
  validate(c)
  return c


def heldout_load_cv(c, workdir) -> float:
  """Coefficient of variation of tokens per expert on the held-out SFT examples."""
  model = build_policy(c)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  ckpt = Checkpointer(workdir + "/checkpoints")
  restored, _ = ckpt.restore(ckpt.latest_step(), {"params": params, "rest": rest}, partial=True)
  ckpt.close()
  tokenizer = load_tokenizer("byte")
  examples = sft.sft_examples(load_entries(c)[1], tokenizer, "plain")
  batch = sft.make_batch(examples, tokenizer.pad_id, 24)
  out = nnx.merge(graphdef, restored["params"], restored["rest"]).forward(
      jnp.asarray(batch["tokens"]), token_mask=jnp.asarray(batch["token_mask"]))
  load = np.asarray(out.router_stats.tokens_per_expert)[0]
  return float(load.std() / load.mean())


@pytest.mark.slow
def test_sft_with_balancing_ends_with_a_tighter_expert_load(tmp_path):
  """128 SFT steps of the demo model: with the bias step and the balance loss, the held-out
  per-expert load varies less than with both off (the demo's numbers are in the README)."""
  off = small_sft_config(0.0, 0.0)
  on = small_sft_config(0.01, 1e-2)
  sft.run(off, str(tmp_path / "off"))
  sft.run(on, str(tmp_path / "on"))
  cv_off, cv_on = heldout_load_cv(off, str(tmp_path / "off")), heldout_load_cv(
      on, str(tmp_path / "on"))
  assert cv_on < 0.6 * cv_off, (cv_on, cv_off)
