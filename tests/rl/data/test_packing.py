"""Sequence packing for SFT: segment-restricted DSA top-k (reference and Pallas), and a packed
batch whose loss equals the sum of the unpacked examples' losses on dense and DSA models."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kernels
from kernels import indexer as pallas_indexer
from kernels import reference
from models.transformer import build
from rl.core.losses import response_nll
from rl.jobs import sft


def jitted_forward(model):
  """model.forward under one jit (op-by-op dispatch of a whole model is slow on CPU)."""
  graphdef, state = nnx.split(model)

  def call(tokens, *, stage=None, **kwargs):
    return _forward(graphdef, stage)(state, jnp.asarray(tokens),
                                     **{k: jnp.asarray(v) for k, v in kwargs.items()})
  return call


@functools.lru_cache(maxsize=None)
def _forward(graphdef, stage):
  @jax.jit
  def run(state, tokens, **kwargs):
    return nnx.merge(graphdef, state).forward(tokens, indexer_stage=stage, **kwargs)
  return run


def random_indexer_inputs(seed, batch=2, steps=24, heads=2, dim=16):
  kq, kk, kw = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (batch, steps, heads, dim)),
          jax.random.normal(kk, (batch, steps, dim)),
          jax.random.normal(kw, (batch, steps, heads)))


SEGMENTS = np.array([[1] * 7 + [2] * 10 + [3] * 5 + [0] * 2,
                     [1] * 20 + [2] * 4], np.int32)


def test_segment_topk_matches_each_document_alone():
  """With segment ids, query t selects among its own document's keys only: the same keys (by
  offset) and scores as the indexer run on that document by itself."""
  q, k, w = random_indexer_inputs(0)
  topk = 4
  indexer = jax.jit(reference.lightning_indexer, static_argnames="topk")
  idx, scores = indexer(q, k, w, topk=topk, segment_ids=jnp.asarray(SEGMENTS))
  for b in range(2):
    for segment in set(SEGMENTS[b].tolist()) - {0}:
      cols = np.flatnonzero(SEGMENTS[b] == segment)
      lo, hi = cols[0], cols[-1] + 1
      alone_idx, alone_scores = indexer(
          q[b:b + 1, lo:hi], k[b:b + 1, lo:hi], w[b:b + 1, lo:hi], topk=topk)
      got = np.asarray(idx[b, lo:hi, :alone_idx.shape[-1]])
      want = np.where(alone_idx[0] >= 0, alone_idx[0] + lo, -1)
      np.testing.assert_array_equal(got, want)
      np.testing.assert_allclose(np.asarray(scores[b, lo:hi, :alone_idx.shape[-1]]),
                                 np.asarray(alone_scores[0]), rtol=1e-5, atol=1e-5)
      # Nothing beyond the document's own keys is selectable.
      assert np.all(np.asarray(idx[b, lo:hi, alone_idx.shape[-1]:]) == -1)


def test_pallas_indexer_respects_segments_like_the_reference():
  q, k, w = random_indexer_inputs(1)
  segments = jnp.asarray(SEGMENTS)
  want_idx, want_scores = reference.lightning_indexer(q, k, w, topk=5, segment_ids=segments)
  got_idx, got_scores = pallas_indexer.lightning_indexer(
      q, k, w, topk=5, segment_ids=segments, interpret=True, block_q=16, block_l=16,
      query_chunk=16)
  np.testing.assert_array_equal(np.asarray(got_idx), np.asarray(want_idx))
  # Scores are fp32 sums in another order (XLA:CPU's blocking differs by host and shape): an
  # absolute floor of 1e-5 for scores near 0 (ReLU), whose relative error is unbounded.
  np.testing.assert_allclose(np.asarray(got_scores), np.asarray(want_scores), rtol=1e-5,
                             atol=1e-5)
  with pytest.raises(ValueError, match="segment_ids"):
    kernels.lightning_indexer(q, k[:, :12], w, topk=5, segment_ids=segments, backend="interpret")


def test_pack_rows_fills_rows_and_keeps_every_example_once():
  lengths = [5, 9, 3, 7, 2, 6, 4]
  rows = sft.pack_rows(lengths, range(len(lengths)), width=10)
  assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
  assert all(sum(lengths[i] for i in row) <= 10 for row in rows)
  # First fit: 5+3+2 share a row, 9 alone, 7 alone? no: 7 goes to a new row, 6 and 4 share one.
  assert rows == [[0, 2, 4], [1], [3], [5, 6]]
  with pytest.raises(ValueError, match="example 0 has 11 tokens"):
    sft.pack_rows([11], [0], width=10)


def test_fit_examples_truncates_responses_and_drops_overlong_prompts():
  examples = [([1, 2], [3, 4, 5]), ([1] * 6, [2]), ([1], [2, 3])]
  kept, counts = sft.fit_examples(examples, max_len=4)
  assert kept == [([1, 2], [3, 4]), ([1], [2, 3])]
  assert counts == {"truncated": 1, "dropped": 1}


@pytest.mark.parametrize("preset", ["tiny_dense", "tiny_moe_mla_dsa"])
def test_packed_loss_equals_sum_of_unpacked_losses(preset):
  """The acceptance property: response NLL of a packed batch == sum over the examples run one
  per row (DSA with top-k 4, smaller than every document, so the sparse path is exercised)."""
  overrides = {"index_topk": 4} if preset == "tiny_moe_mla_dsa" else {}
  forward = jitted_forward(build(preset, seed=0, **overrides))
  rng = np.random.default_rng(0)
  examples = [(rng.integers(7, 200, size=p).tolist(), rng.integers(7, 200, size=r).tolist())
              for p, r in [(3, 6), (5, 4), (2, 9), (4, 3), (6, 5)]]
  width = 24
  rows = sft.pack_rows([len(p) + len(r) for p, r in examples], range(len(examples)), width)
  assert any(len(row) > 1 for row in rows)
  packed = sft.make_packed_batch(examples, rows, pad_id=0, width=width)
  out = forward(packed["tokens"], positions=packed["positions"],
                segment_ids=packed["segment_ids"], token_mask=packed["token_mask"])
  packed_nll = response_nll(out.logits, jnp.asarray(packed["tokens"]),
                            jnp.asarray(packed["loss_mask"]), mean=False)
  single = sft.make_batch(examples, pad_id=0, width=width)
  logits = forward(single["tokens"]).logits
  single_nll = response_nll(logits, jnp.asarray(single["tokens"]),
                            jnp.asarray(single["loss_mask"]), mean=False)
  assert packed["loss_mask"].sum() == single["loss_mask"].sum()
  np.testing.assert_allclose(float(packed_nll), float(single_nll), rtol=1e-5)


def test_packed_indexer_loss_equals_sum_of_unpacked():
  """The DSA indexer's KL (both stages) sums per token, so packing leaves it unchanged too."""
  forward = jitted_forward(build("tiny_moe_mla_dsa", seed=1, index_topk=4))
  rng = np.random.default_rng(1)
  examples = [(rng.integers(7, 200, size=p).tolist(), rng.integers(7, 200, size=r).tolist())
              for p, r in [(4, 7), (3, 5), (6, 6)]]
  width = 32
  rows = sft.pack_rows([len(p) + len(r) for p, r in examples], range(len(examples)), width)
  assert rows == [[0, 1, 2]]
  packed = sft.make_packed_batch(examples, rows, pad_id=0, width=width)
  single = sft.make_batch(examples, pad_id=0, width=width)
  for stage in ("dense_warmup", "sparse"):
    a = forward(packed["tokens"], positions=packed["positions"],
                segment_ids=packed["segment_ids"], token_mask=packed["token_mask"],
                stage=stage).indexer_loss
    b = forward(single["tokens"], token_mask=single["token_mask"], stage=stage).indexer_loss
    # A KL near zero: absolute agreement (float32 cancellation inside each term).
    np.testing.assert_allclose(float(a), float(b), rtol=1e-5, atol=1e-6)
