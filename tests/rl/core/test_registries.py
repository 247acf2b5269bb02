"""A user's advantage estimator and policy loss, registered from one module (this file), are used
end to end: nothing else in the project changes to add them.

The module registers them with the registries' decorators (`adv.register_estimator`,
`losses.register_policy_loss`), as a user's module imported before the run would; config
validation (rl/config/validation.py) reads the registries when it runs, so it accepts their
names. The estimator reads the critic's values (needs_values=True), so the run trains a critic
(the trainer builds one and the placement planner counts it); its declared outputs are
fields of the update's batch. The loss's own metric comes out of the update step.

The fixture removes both entries afterwards, so other tests see the project's registries.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from models.transformer import build
from rl.config.defaults import base_config
from rl.config.validation import validate
from rl.core import advantages as adv
from rl.core import losses
from rl.core import train_step as ts
from rl.parallel import placement
from rl.rewards.shaping import place_on_last_token

ESTIMATOR, LOSS = "mc_critic_baseline", "plain_pg"
WIDTH = 8


def mc_critic_baseline(scores, group_ids, token_rewards, mask, values, rl):
  """Monte-Carlo return minus the critic's value on every response token; the critic learns
  the return. `baseline` is each row's mean value (an output of its own)."""
  returns = scores[:, None] * mask
  baseline = jnp.sum(values * mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1.0)
  return {"advantages": returns - values * mask, "returns": returns, "values": values,
          "baseline": baseline}


def plain_pg(logp, logp_old, advantages, mask, rl, **agg_kwargs):
  """Unclipped importance-weighted policy gradient; its metric `pg_ratio_mean` is a global token
  mean (divided by agg_kwargs' num_tokens), so it adds up over micro-batches."""
  ratio = jnp.exp(logp - logp_old)
  loss = losses.aggregate(-advantages * ratio, mask, rl["loss_agg_mode"], **agg_kwargs)
  n = agg_kwargs.get("num_tokens", jnp.maximum(jnp.sum(mask), 1.0))
  return loss, {"pg_ratio_mean": jnp.sum(ratio * mask) / n}


@pytest.fixture
def registered():
  adv.register_estimator(ESTIMATOR, needs_values=True,
                         outputs=("advantages", "returns", "values", "baseline"))(
                             mc_critic_baseline)
  losses.register_policy_loss(LOSS)(plain_pg)
  try:
    yield
  finally:
    adv.ESTIMATOR_REGISTRY.remove(ESTIMATOR)
    losses.POLICY_LOSS_REGISTRY.remove(LOSS)


def _config(**rl):
  c = base_config(algorithm="grpo")
  c.rl.update(rl)
  return c


def test_user_estimator_and_loss_run_validation_advantages_and_an_update(registered):
  """Validation accepts the registered names and the run counts a critic for the critic-reading
  estimator; the estimator's outputs (its own `baseline` among them) make an update batch the
  step accepts; the step reports the loss's own metric and no PPO clip metrics."""
  c = _config(estimator=ESTIMATOR, policy_loss=LOSS, kl_coef=0.0)
  validate(c)
  assert placement.workload(c).critic and not placement.workload(_config()).critic

  rng = np.random.default_rng(0)
  mask = np.zeros((4, WIDTH), np.float32)
  mask[:, 3:] = 1
  scores = jnp.array([1.0, 0.0, 1.0, 0.0])
  values = jnp.full((4, WIDTH), 0.25) * mask
  out = adv.estimate(c.rl, scores, jnp.array([0, 0, 1, 1]), place_on_last_token(scores, mask),
                     jnp.asarray(mask), lambda: values)
  np.testing.assert_allclose(out["advantages"][:, -1], [0.75, -0.25, 0.75, -0.25])

  model = build("tiny_dense", seed=0)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  batch = {"tokens": rng.integers(0, model.cfg.vocab_size, (4, WIDTH), dtype=np.int32),
           "response_mask": mask, "attention_mask": np.ones((4, WIDTH), np.float32),
           "logp_old": np.full((4, WIDTH), -4.0, np.float32), "acc": np.asarray(scores), **out}
  optimizer = optax.sgd(1e-3)
  update = ts.make_update(ts.policy_objective, graphdef, optimizer, micro_batches=2,
                          rl=c.rl.to_dict(), temperature=1.0, max_len=WIDTH)
  _, metrics = update(ts.init_state(params, optimizer), rest,
                      jax.tree.map(jnp.asarray, batch))
  assert "pg_ratio_mean" in metrics and "clipfrac_high" not in metrics
  assert np.isfinite(float(metrics["pg_ratio_mean"])) and not float(metrics["skipped"])


def test_critic_follows_the_estimators_needs_values(registered):
  """An estimator declaring needs_values without the critic's targets is refused at
  registration."""
  with pytest.raises(ValueError, match=r"lack \['returns', 'values'\]"):
    adv.register_estimator("no_targets", needs_values=True)
  assert "no_targets" not in adv.ESTIMATOR_REGISTRY.names()
