"""Per-domain KL (DeepSeek-V3.2): each row of a mixed batch is held to the reference with its own
domain's beta (config.rl.kl_coef_per_domain, else config.rl.kl_coef), from the rewarder's
per-row weights to the KL term of the policy objective."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.tokenizer import ByteTokenizer
from models.transformer import build
from rl.config.defaults import base_config
from rl.core import algorithms
from rl.core import train_step as ts
from rl.rewards import puzzles
from rl.jobs.batch import ResponseGrader, kl_coefs, score_trajectories
from rl.core.types import Trajectories

BETAS = "math=0.1, addition=0.5"


def _config():
  c = base_config(algorithm="dapo")
  c.rl.kl_coef = 0.01
  c.rl.kl_coef_per_domain = BETAS
  return c


def test_rewarder_weighs_each_row_by_its_domain():
  """A math record and a generated addition puzzle in one batch get their domains' betas, a
  domain without one the run's kl_coef (one beta per run gave every row the run task's)."""
  tokenizer = ByteTokenizer()
  puzzle = puzzles.make("addition", size=1, seed=0, difficulty=1)[0]
  entries = [{"prompt": "2+2?", "answer": "4", "domain": "math"}, puzzle]
  responses = ["\\boxed{4}", puzzle["solution"]]
  width = 64
  tokens = np.zeros((2, width), np.int32)
  mask = np.zeros((2, width), np.float32)
  for i, text in enumerate(responses):
    ids = tokenizer.encode(text)
    tokens[i, 1:1 + len(ids)] = ids
    mask[i, 1:1 + len(ids)] = 1
  traj = Trajectories(tokens=tokens, prompt_lens=np.ones(2, np.int32), response_mask=mask,
                      logp_old=np.zeros((2, width), np.float32),
                      policy_version=np.zeros((2, width), np.int32),
                      group_id=np.arange(2, dtype=np.int32), finished=np.ones(2, bool),
                      truncated=np.zeros(2, bool))
  c = _config()
  c.rl.overlong_buffer = 0
  rewards = score_trajectories(traj, entries, ResponseGrader(tokenizer), c)
  np.testing.assert_array_equal(rewards["acc"], [1.0, 1.0])
  np.testing.assert_allclose(rewards["kl_coef"], [0.1, 0.5])
  np.testing.assert_allclose(kl_coefs(entries + [{"prompt": "p", "domain": "logic"}], c.rl),
                             [0.1, 0.5, 0.01])


def test_kl_term_weighs_each_row_by_its_beta():
  """Hand-computed: with zero advantages, k1 KL and seq-mean-token-mean, lowering row i's
  reference log-probs by d on every response token raises the loss by beta_i * d / 2."""
  model = build("tiny_moe_mla_dsa", seed=0)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  rl = algorithms.recipe("grpo")
  rl.update(kl_kind="k1", kl_coef=0.01, kl_coef_per_domain=BETAS, indexer_coef=0.0,
            loss_agg_mode="seq-mean-token-mean", offpolicy_mask_delta=0.0)
  rng = np.random.default_rng(0)
  width = 12
  tokens = rng.integers(0, model.cfg.vocab_size, (2, width), dtype=np.int32)
  response = np.zeros((2, width), np.float32)
  response[:, 4:] = 1
  batch = {"tokens": tokens, "response_mask": response,
           "attention_mask": np.ones((2, width), np.int32),
           "logp_old": np.zeros((2, width), np.float32),
           "advantages": np.zeros((2, width), np.float32),
           "logp_ref": rng.normal(-5.0, 1.0, (2, width)).astype(np.float32),
           "kl_coef": np.array([0.1, 0.5], np.float32)}
  counts = {"num_tokens": jnp.float32(response[:, 1:].sum()), "num_seqs": jnp.float32(2),
            "micro_batches": jnp.float32(1)}

  def loss(b):
    value, _ = ts.policy_objective(params, graphdef, rest, {k: jnp.asarray(v) for k, v in
                                                            b.items()}, counts, rl=rl,
                                   temperature=1.0, max_len=width)
    return float(value)

  base, d = loss(batch), 0.5
  for row, beta in enumerate(batch["kl_coef"]):
    moved = dict(batch, logp_ref=batch["logp_ref"].copy())
    moved["logp_ref"][row] -= d
    assert loss(moved) - base == pytest.approx(beta * d / 2, rel=1e-4), row
