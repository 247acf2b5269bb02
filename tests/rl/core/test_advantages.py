"""Advantage estimators and reward shaping against hand-computed values (spec section 3, 6)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl.core import advantages as adv
from rl.rewards.shaping import overlong_penalty, place_on_last_token
from rl.core.types import Trajectories


def test_grpo_group_normalisation_with_unbiased_std_and_group_of_one():
  scores = jnp.array([1.0, 0.0, 0.0, 1.0, 0.5])
  groups = jnp.array([7, 7, 7, 7, 1_000_003])  # arbitrary, non-dense ids
  a = adv.grpo(scores, groups)
  # group 7: mean 0.5, unbiased std sqrt(1/3); singleton: mean 0, std 1.
  np.testing.assert_allclose(a, [0.866025, -0.866025, -0.866025, 0.866025, 0.5], atol=1e-5)


def test_dr_grpo_has_no_std_division():
  a = adv.grpo(jnp.array([3.0, 1.0, 2.0, 2.0]), jnp.array([0, 0, 1, 1]), normalize_std=False)
  np.testing.assert_allclose(a, [1.0, -1.0, 0.0, 0.0])


def test_grpo_is_jittable_and_groups_can_interleave():
  f = jax.jit(adv.grpo)
  a = f(jnp.array([1.0, 5.0, 0.0, 5.0]), jnp.array([2, 9, 2, 9]))
  np.testing.assert_allclose(a, [0.707106, 0.0, -0.707106, 0.0], atol=1e-5)


def test_rloo_is_score_minus_mean_of_the_others():
  a = adv.rloo(jnp.array([1.0, 0.0, 0.0, 1.0, 0.25]), jnp.array([4, 4, 4, 4, 5]))
  # 1 - mean(0, 0, 1) = 2/3; 0 - mean(0, 1, 1) = -2/3; a group of one keeps its score.
  np.testing.assert_allclose(a, [2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.25], atol=1e-6)


def test_gae_hand_values():
  rewards = jnp.array([[0.0, 0.0, 1.0]])
  values = jnp.array([[0.5, 0.6, 0.7]])
  mask = jnp.ones((1, 3))
  a, r = adv.gae(rewards, values, mask, gamma=1.0, lam=0.5)
  np.testing.assert_allclose(a, [[0.225, 0.25, 0.3]], atol=1e-6)
  np.testing.assert_allclose(r, [[0.725, 0.85, 1.0]], atol=1e-6)
  a, r = adv.gae(rewards, values, mask, gamma=1.0, lam=1.0)  # Monte-Carlo
  np.testing.assert_allclose(a, [[0.5, 0.4, 0.3]], atol=1e-6)
  np.testing.assert_allclose(r, [[1.0, 1.0, 1.0]], atol=1e-6)


def test_gae_discount():
  a, r = adv.gae(jnp.array([[0.0, 1.0]]), jnp.zeros((1, 2)), jnp.ones((1, 2)), gamma=0.9)
  np.testing.assert_allclose(a, [[0.9, 1.0]], atol=1e-6)
  np.testing.assert_allclose(r, [[0.9, 1.0]], atol=1e-6)


def test_gae_masked_tokens_pass_value_and_advantage_through():
  # prompt, response, tool output, response: the tool token must not break the recursion.
  rewards = jnp.array([[0.0, 0.0, 0.0, 1.0]])
  values = jnp.array([[9.0, 0.5, 9.0, 0.7]])
  mask = jnp.array([[0.0, 1.0, 0.0, 1.0]])
  a, r = adv.gae(rewards, values, mask)
  np.testing.assert_allclose(a, [[0.0, 0.5, 0.0, 0.3]], atol=1e-6)
  np.testing.assert_allclose(r, [[0.0, 1.0, 0.0, 1.0]], atol=1e-6)


def test_gae_per_sequence_lambda():
  rewards = jnp.array([[0.0, 0.0, 1.0]] * 2)
  values = jnp.array([[0.5, 0.6, 0.7]] * 2)
  a, _ = adv.gae(rewards, values, jnp.ones((2, 3)), lam=jnp.array([0.5, 1.0]))
  np.testing.assert_allclose(a, [[0.225, 0.25, 0.3], [0.5, 0.4, 0.3]], atol=1e-6)


def test_length_adaptive_lambda_clamps():
  lam = adv.length_adaptive_lambda(jnp.array([0, 10, 20, 100, 1000]), alpha=0.05)
  np.testing.assert_allclose(lam, [0.0, 0.0, 0.0, 0.8, 0.98], atol=1e-6)


def test_reinforce_pp_returns_are_whitened_over_the_batch():
  rewards = jnp.array([[0.0, 0.0, 1.0], [0.0, 0.0, -1.0]])
  mask = jnp.array([[1.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
  a = adv.reinforce_pp(rewards, mask)
  # returns {1, 1, 1, -1, -1}: mean 0.2, unbiased var 1.2.
  hi, lo = 0.8 / np.sqrt(1.2 + 1e-8), -1.2 / np.sqrt(1.2 + 1e-8)
  np.testing.assert_allclose(a, [[hi, hi, hi], [0.0, lo, lo]], atol=1e-5)


def test_overlong_penalty_counts_tokens():
  p = overlong_penalty(jnp.array([10, 15, 17, 20]), max_len=20, buffer=5)
  np.testing.assert_allclose(p, [0.0, 0.0, -0.4, -1.0], atol=1e-6)
  np.testing.assert_allclose(overlong_penalty(jnp.array([20]), max_len=20, buffer=5, factor=0.5),
                             [-0.5])
  with pytest.raises(ValueError, match="buffer"):
    overlong_penalty(jnp.array([1]), max_len=20, buffer=0)


def test_place_on_last_token():
  mask = jnp.array([[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 1, 0]])
  r = place_on_last_token(jnp.array([2.0, 3.0, 4.0]), mask)
  np.testing.assert_allclose(r, [[0, 0, 2, 0], [0, 0, 0, 0], [0, 0, 4, 0]])


def test_trajectories_is_a_pytree_with_optional_fields():
  t = Trajectories(tokens=np.zeros((2, 4), np.int32), prompt_lens=np.array([1, 2]),
                   response_mask=np.array([[0, 1, 1, 0], [0, 0, 1, 0]]),
                   logp_old=np.zeros((2, 4)), policy_version=np.zeros((2, 4), np.int32),
                   group_id=np.array([0, 0]), finished=np.array([True, False]),
                   truncated=np.array([False, True]))
  assert len(jax.tree.leaves(t)) == 8  # unset optional fields are empty subtrees
  t2 = t.replace(routing=np.zeros((2, 4, 1, 2), np.int32))
  assert len(jax.tree.leaves(t2)) == 9 and t.routing is None
  np.testing.assert_array_equal(t.response_lengths, [2, 1])


# ----------------------------------------------------------------------------- Registry

SCORES = jnp.array([1.0, 0.0, 0.5, 0.5])
GROUPS = jnp.array([0, 0, 1, 1])
MASK = jnp.array([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 1.0]])


def test_estimator_registry_holds_the_spec_estimators():
  """Spec section 3: GRPO, Dr.GRPO, RLOO, REINFORCE++ and GAE, the one that needs the critic;
  the config's allowed values are the registry's entries."""
  names = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "gae")
  assert adv.ESTIMATOR_REGISTRY.names() == names
  assert [n for n in names if adv.ESTIMATOR_REGISTRY[n].needs_values] == ["gae"]


def _estimate(estimator, values, **overrides):
  rl = dict(estimator=estimator, gamma=0.9, lam=0.8, lam_critic=1.0, length_adaptive_alpha=0.0)
  rl.update(overrides)
  return adv.estimate(rl, SCORES, GROUPS, place_on_last_token(SCORES, MASK), MASK, values)


def test_estimate_calls_each_estimator_the_same_way():
  """Each entry gives what its pure function gives; the critic's values are asked for only by
  GAE, which returns the critic's targets (lam_critic) and the values beside its advantages."""
  asked = []
  values = jnp.full(MASK.shape, 0.25) * MASK

  def critic():
    asked.append(1)
    return values
  rewards = place_on_last_token(SCORES, MASK)
  want = {"grpo": adv.grpo(SCORES, GROUPS)[:, None] * MASK,
          "dr_grpo": adv.grpo(SCORES, GROUPS, normalize_std=False)[:, None] * MASK,
          "rloo": adv.rloo(SCORES, GROUPS)[:, None] * MASK,
          "reinforce_pp": adv.reinforce_pp(rewards, MASK, gamma=0.9)}
  for name, advantages in want.items():
    out = _estimate(name, critic)
    assert list(out) == ["advantages"], name
    np.testing.assert_array_equal(out["advantages"], advantages, err_msg=name)
  assert not asked
  out = _estimate("gae", critic)
  assert asked == [1] and list(out) == ["advantages", "returns", "values"]
  np.testing.assert_array_equal(out["advantages"],
                                adv.gae(rewards, values, MASK, gamma=0.9, lam=0.8)[0])
  np.testing.assert_array_equal(out["returns"],
                                adv.gae(rewards, values, MASK, gamma=0.9, lam=1.0)[1])
  lam = adv.length_adaptive_lambda(jnp.sum(MASK, -1), alpha=0.5)
  out = _estimate("gae", critic, length_adaptive_alpha=0.5)
  np.testing.assert_array_equal(out["advantages"],
                                adv.gae(rewards, values, MASK, gamma=0.9, lam=lam)[0])


def test_grpo_v32_advantage_is_the_reward_minus_the_group_mean():
  """DeepSeek-V3.2 section 3.1: A_i = R_i - mean(R) over the group, with no division by the
  group's standard deviation (GRPO's), on every response token."""
  from rl.core import algorithms
  scores, groups = jnp.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0]), jnp.array([0, 0, 0, 0, 1, 1])
  mask = jnp.ones((6, 3))
  out = adv.estimate(algorithms.recipe("grpo_v32"), scores, groups,
                     place_on_last_token(scores, mask), mask, None)
  want = np.array([0.75, -0.25, -0.25, -0.25, 0.0, 0.0])[:, None] * np.ones((1, 3))
  np.testing.assert_allclose(out["advantages"], want, atol=1e-6)


def test_unknown_estimator_names_the_field_and_the_entries():
  from rl.core import algorithms
  want = ("config.rl.estimator='ppo2': must be one of "
          "['grpo', 'dr_grpo', 'rloo', 'reinforce_pp', 'gae']")
  with pytest.raises(ValueError) as error:
    _estimate("ppo2", lambda: None)
  assert str(error.value) == want
  with pytest.raises(ValueError) as error:
    algorithms.validate_rl(dict(algorithms.recipe("grpo"), estimator="ppo2"))
  assert str(error.value) == want
