"""Streaming rollout tests: per-token versions and behaviour log-probs of partial generations
resumed by a newer policy, the on-policy fraction and staleness bound, and split-mode weight
resharding onto a separate device slice."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import sharding as sharding_lib
from models.transformer import build
from rl.rollout import engine, streaming
from rl.core import sampling

CFG = engine.RolloutConfig(
    max_new_tokens=12, temperature=1.0, top_k=100, keep_sampling_mask=True,
    stop_ids=tuple(range(1, 30)), max_prompt_len=8, batch_size=8)
STREAM = streaming.StreamingConfig(on_policy_fraction=0.5, max_staleness=1, round_tokens=4)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [3] * 8, [40, 41], [77], [90, 91, 92]]


@functools.lru_cache(maxsize=None)
def policy(seed):
  """Two seeds stand for two versions of the same policy (same graphdef, other weights)."""
  return nnx.split(build("tiny_dense", seed=seed))


@functools.lru_cache(maxsize=None)
def teacher_forced_fn(graphdef):
  @jax.jit
  def run(state, tokens, kept_ids):
    logits = nnx.merge(graphdef, state).forward(tokens).logits[:, :-1]
    kept = sampling.kept_mask_from_ids(kept_ids[:, 1:], logits.shape[-1])
    logp = sampling.masked_logprobs(logits, temperature=CFG.temperature, kept_mask=kept)
    logp = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.pad(logp, ((0, 0), (1, 0)))
  return run


def two_version_run():
  """Version 0 collects 1 of 3 groups, leaving partials; version 1 (other weights) resumes
  them. (Seed 5 is one where partial responses are still running when version 0 stops: two
  rows are sampled by both versions.)"""
  graphdef, state_v0 = policy(1)
  _, state_v1 = policy(2)
  stream = streaming.StreamingRollout(CFG, STREAM, num_samples=2, seed=5)
  stream.submit(PROMPTS[:3], payloads=[0, 1, 2])
  first, payloads0, stats0 = stream.collect(graphdef, state_v0, policy_version=0, num_groups=1)
  leftover = stream.num_in_flight + stream.num_ready
  stream.submit(PROMPTS[3:5], payloads=[3, 4])
  second, payloads1, stats1 = stream.collect(graphdef, state_v1, policy_version=1, num_groups=2)
  return stream, (first, payloads0, stats0), (second, payloads1, stats1), leftover


@functools.lru_cache(maxsize=None)
def cached_two_version_run():
  return two_version_run()


def test_mixed_version_responses_carry_exact_behaviour_logprobs():
  """A partial started by version 0 and finished by version 1 keeps, per token, the version
  that sampled it and that version's log-prob: teacher-forcing each token under its own
  version's weights (with the recorded kept mask) reproduces logp_old (<= 1e-5). Versions never
  decrease along a response, payloads follow their groups, and at least ceil(alpha * n) groups
  are generated entirely by the latest version."""
  _, (first, payloads0, stats0), (second, payloads1, stats1), leftover = (
      cached_two_version_run())
  assert leftover >= 1 and stats0["fresh_groups"] == 1 and stats0["old_groups"] == 0
  assert stats1["old_groups"] == 1 and stats1["fresh_groups"] == 1
  graphdef, state_v0 = policy(1)
  _, state_v1 = policy(2)
  recompute = teacher_forced_fn(graphdef)
  for traj, payloads in ((first, payloads0), (second, payloads1)):
    tokens = jnp.asarray(traj.tokens)
    mask = np.asarray(traj.response_mask).astype(bool)
    versions = np.asarray(traj.policy_version)
    under = {0: np.asarray(recompute(state_v0, tokens, traj.kept_ids)),
             1: np.asarray(recompute(state_v1, tokens, traj.kept_ids))}
    for version, logp in under.items():
      sel = mask & (versions == version)
      np.testing.assert_allclose(logp[sel], np.asarray(traj.logp_old)[sel], atol=1e-5, rtol=0)
    for row in range(len(tokens)):
      response_versions = versions[row][mask[row]]
      assert np.all(np.diff(response_versions) >= 0)
      prompt = PROMPTS[payloads[traj.group_id[row]]]
      assert np.asarray(traj.tokens)[row, :len(prompt)].tolist() == prompt
  versions = np.asarray(second.policy_version)[np.asarray(second.response_mask) == 1]
  mixed_rows = [row for row in range(len(second.tokens))
                if len(set(np.asarray(second.policy_version)[row][
                    np.asarray(second.response_mask)[row] == 1])) == 2]
  assert mixed_rows, "the run must contain a response sampled by both versions"
  assert set(versions.tolist()) == {0, 1} and stats1["token_staleness_max"] == 1


def test_staleness_bound_and_on_policy_fraction():
  """Groups older than max_staleness are restarted under the current version, so no token in a
  batch is older than the bound; with on_policy_fraction = 1 every group is fully on-policy."""
  stream, *_ = two_version_run()
  assert stream.num_in_flight + stream.num_ready >= 1
  graphdef, state = policy(3)
  traj, _, stats = stream.collect(graphdef, state, policy_version=5, num_groups=2)
  assert stats["restarted_groups"] >= 1 and stats["token_staleness_max"] == 0
  assert np.all(np.asarray(traj.policy_version) == 5)

  on_policy = streaming.StreamingRollout(
      CFG, streaming.StreamingConfig(on_policy_fraction=1.0, max_staleness=4, round_tokens=4),
      num_samples=2, seed=1)
  on_policy.submit(PROMPTS[:3])
  on_policy.collect(graphdef, policy(1)[1], policy_version=0, num_groups=1)
  on_policy.submit(PROMPTS[3:5])
  traj, _, stats = on_policy.collect(graphdef, state, policy_version=1, num_groups=2)
  assert stats["old_groups"] == 0 and stats["token_staleness_max"] == 0


def test_split_mode_reshards_weights_and_matches_colocated():
  """Split mode: weights sharded over a trainer slice (devices 0-3) are resharded onto a
  rollout slice (devices 4-7) with the same values, and the streamed trajectories equal the
  co-located ones for the same seed."""
  graphdef, state = policy(1)
  devices = jax.devices()
  train_mesh = sharding_lib.make_mesh({"data": 2, "tensor": 2}, devices[:4])
  rollout_mesh = sharding_lib.make_mesh({"data": 4}, devices[4:])
  train_state = jax.device_put(state, sharding_lib.state_shardings(state, train_mesh))
  moved = streaming.reshard_weights(train_state, rollout_mesh)
  for before, after in zip(jax.tree.leaves(train_state), jax.tree.leaves(moved)):
    assert after.sharding.device_set == set(devices[4:])
    np.testing.assert_array_equal(np.asarray(after), np.asarray(before))

  results = []
  for mesh, weights in ((None, state), (rollout_mesh, train_state)):
    stream = streaming.StreamingRollout(CFG, STREAM, num_samples=2, seed=2, mesh=mesh)
    stream.submit(PROMPTS[:4])
    results.append(stream.collect(graphdef, weights, policy_version=0, num_groups=2)[0])
  colocated, split = results
  np.testing.assert_array_equal(split.tokens, colocated.tokens)
  np.testing.assert_allclose(split.logp_old, colocated.logp_old, atol=1e-5, rtol=0)


def test_errors_name_the_problem():
  """Bad stream settings and a batch that cannot be filled fail with a clear message."""
  with pytest.raises(ValueError, match="on_policy_fraction=1.5"):
    streaming.StreamingConfig(on_policy_fraction=1.5)
  with pytest.raises(ValueError, match="round_tokens=0"):
    streaming.StreamingConfig(round_tokens=0)
  stream = streaming.StreamingRollout(CFG, STREAM, num_samples=2)
  graphdef, state = policy(1)
  with pytest.raises(ValueError, match="submit more prompts"):
    stream.collect(graphdef, state, policy_version=0, num_groups=1)
  with pytest.raises(ValueError, match="2 prompts but 1 payloads"):
    stream.submit([[1], [2]], payloads=[0])
