"""Sampling distribution tests: draw frequencies (chi-square), top-p / top-k kept sets, the
sampler/trainer log-prob identity and the keep-sampling-mask's kept-id record."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from rl.core import sampling

LOGITS = jnp.array([2.0, 1.5, 1.0, 0.3, 0.0, -0.5, -1.0, -3.0])
DRAWS = 40_000


def draw(logits, **kwargs):
  keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.key(7), jnp.arange(DRAWS))
  tokens, token_logp, kept = jax.jit(lambda k, x: sampling.sample(k, x, **kwargs))(
      keys, jnp.broadcast_to(logits, (DRAWS, logits.shape[-1])))
  return np.asarray(tokens), np.asarray(token_logp), np.asarray(kept[0])


def chi_square_pvalue(tokens, probs):
  """p-value of observed counts against expected probabilities (zero-probability ids must
  never occur; they are dropped from the test's cells)."""
  counts = np.bincount(tokens, minlength=len(probs))
  probs = np.asarray(probs, np.float64)
  support = probs > 0
  assert counts[~support].sum() == 0
  expected = probs[support] / probs[support].sum() * len(tokens)
  return stats.chisquare(counts[support], expected).pvalue


def test_frequencies_match_tempered_softmax():
  """Plain sampling at T=0.7 on an 8-token vocabulary: frequencies pass a chi-square test
  against softmax(logits / T), and the reported log-probs are exactly log_softmax(logits / T)."""
  tokens, token_logp, kept = draw(LOGITS, temperature=0.7)
  probs = np.asarray(jax.nn.softmax(LOGITS / 0.7))
  assert chi_square_pvalue(tokens, probs) > 1e-3
  assert kept.all()
  expected = np.asarray(jax.nn.log_softmax(LOGITS / 0.7))[tokens]
  np.testing.assert_allclose(token_logp, expected, atol=1e-6)


@pytest.mark.parametrize("top_p,top_k", [(0.7, 0), (1.0, 3), (0.8, 5)])
def test_top_p_top_k_stay_in_kept_set(top_p, top_k):
  """Top-p / top-k never emit a token outside the kept set, and inside it the frequencies match
  the renormalised tempered distribution (chi-square)."""
  tokens, token_logp, kept = draw(LOGITS, temperature=1.3, top_p=top_p, top_k=top_k)
  assert kept[tokens].all()
  probs = np.where(kept, np.exp(np.asarray(LOGITS) / 1.3), 0.0)
  probs /= probs.sum()
  assert chi_square_pvalue(tokens, probs) > 1e-3
  np.testing.assert_allclose(token_logp, np.log(probs[tokens]), atol=1e-5)


def test_kept_set_hand_computed():
  """Kept sets of a hand-made distribution: top-p keeps the smallest prefix reaching p (at least
  one id), top-k exactly k ids (ties broken by id), top-p applies after top-k renormalisation,
  vocab_limit removes the tail ids."""
  logits = jnp.log(jnp.array([0.05, 0.5, 0.3, 0.15]))
  kept = lambda **kw: np.asarray(sampling.kept_set(logits, **kw)).tolist()  # noqa: E731
  assert kept(top_p=0.8) == [False, True, True, False]
  assert kept(top_p=0.81) == [False, True, True, True]
  assert kept(top_p=0.01) == [False, True, False, False]
  assert kept(top_k=2) == [False, True, True, False]
  # top-k=2 renormalises to (0.625, 0.375): top-p=0.6 then keeps only the first.
  assert kept(top_k=2, top_p=0.6) == [False, True, False, False]
  assert kept(vocab_limit=2) == [True, True, False, False]
  assert kept(vocab_limit=2, top_k=1) == [False, True, False, False]
  ties = jnp.zeros(5)
  assert np.asarray(sampling.kept_set(ties, top_k=2)).tolist() == [True, True, False, False, False]


def _kept_reference(scaled, *, top_p=1.0, top_k=0, vocab_limit=None, max_kept=0):
  """The module docstring's kept set in float64 numpy, one row at a time by a stable sort of
  the whole row: (kept [N, V], cut [N], each row's distance of top-p from the nearest
  cumulative mass, inf without top-p)."""
  vocab = scaled.shape[-1]
  rows = np.where(np.arange(vocab) < (vocab_limit or vocab), scaled.astype(np.float64), -np.inf)
  kept, cut = np.zeros(rows.shape, bool), np.zeros(len(rows), bool)
  margin = np.full(len(rows), np.inf)
  rank = np.arange(vocab)
  for r, row in enumerate(rows):
    order = np.argsort(-row, kind="stable")
    ok = np.isfinite(row[order]) & ((rank < top_k) if top_k else True)
    if top_p < 1.0:
      probs = np.where(ok, np.exp(row[order] - row[order][0]), 0.0)
      probs /= probs.sum()
      before = np.cumsum(probs) - probs
      margin[r] = np.min(np.abs(before[ok] - top_p))
      ok &= (before < top_p) | (rank == 0)
    if max_kept:
      cut[r] = ok.sum() > max_kept
      ok &= rank < max_kept
    kept[r, order[ok]] = True
  return kept, cut, margin


@pytest.mark.parametrize("settings", [
    dict(top_k=50), dict(top_k=200, top_p=0.9), dict(top_k=7, max_kept=3),
    dict(top_p=0.9, max_kept=40), dict(top_p=0.9, max_kept=40, vocab_limit=700),
    dict(top_p=0.9), dict(top_k=30, vocab_limit=5)])
def test_kept_set_matches_a_full_sort(settings):
  """The kept set and cut flag (ranked by lax.top_k over the bound's prefix, or by a full sort
  for top-p alone) equal a float64 stable sort of the whole row, on logits with many ties at
  every rank (integers), half of them peaked: the same ids at the top-k boundary (ties to the
  lower id), the same nucleus and the same cut. Rows whose top-p meets a cumulative mass within 1e-5 are left out
  (float rounding may decide them either way)."""
  spread = jnp.where(jnp.arange(32) % 2 == 0, 2.0, 4.0)[:, None]  # odd rows: narrow nuclei
  scaled = jnp.round(spread * jax.random.normal(jax.random.key(3), (32, 1000)))
  kept, cut = jax.jit(lambda x: sampling.kept_set_and_cut(x, **settings))(scaled)
  want_kept, want_cut, margin = _kept_reference(np.asarray(scaled), **settings)
  clear = margin > 1e-5
  assert clear.sum() >= 16
  np.testing.assert_array_equal(np.asarray(kept)[clear], want_kept[clear])
  np.testing.assert_array_equal(np.asarray(cut)[clear], want_cut[clear])
  if settings.get("max_kept"):
    assert 0 < want_cut.sum() < 32 or settings.get("top_k")  # both branches of the cap ran


def test_trainer_logprobs_equal_sampler_logprobs():
  """`masked_logprobs` with the recorded kept mask equals `sampling_logprobs` on the kept set;
  without a mask it is log_softmax(logits / T); an empty mask row gives zeros, not NaNs."""
  logits = jax.random.normal(jax.random.key(0), (4, 6, 50)) * 3
  logp, kept = sampling.sampling_logprobs(logits, temperature=0.6, top_p=0.85, top_k=20,
                                          vocab_limit=45)
  recomputed = sampling.masked_logprobs(logits, temperature=0.6, kept_mask=kept)
  np.testing.assert_array_equal(np.isneginf(logp), ~np.asarray(kept))
  np.testing.assert_allclose(np.where(kept, recomputed, 0), np.where(kept, logp, 0), atol=1e-6)
  full, everything = sampling.sampling_logprobs(logits, temperature=0.6)
  assert bool(everything.all())
  np.testing.assert_allclose(full, jax.nn.log_softmax(logits / 0.6), atol=1e-6)
  np.testing.assert_allclose(sampling.masked_logprobs(logits, temperature=0.6), full, atol=1e-6)
  empty = sampling.masked_logprobs(logits, temperature=1.0, kept_mask=jnp.zeros((50,), bool))
  assert np.all(np.asarray(empty) == 0.0)


def test_next_token_logprobs_shift_and_gather():
  """Position t - 1 predicts token t: the log-prob of each next token, read from log_softmax of
  the fp32 logits (bf16 logits give exactly the fp32 numbers of their values), or from the
  tempered, masked distribution when a temperature and kept mask are given."""
  logits = jax.random.normal(jax.random.key(1), (2, 5, 11)).astype(jnp.bfloat16) * 3
  tokens = jax.random.randint(jax.random.key(2), (2, 5), 0, 11)
  full = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32)))
  expected = np.array([[full[b, t - 1, tokens[b, t]] for t in range(1, 5)] for b in range(2)])
  got = sampling.next_token_logprobs(logits, tokens)
  assert got.dtype == jnp.float32 and got.shape == (2, 4)
  np.testing.assert_array_equal(got, expected)
  kept = jnp.ones((2, 4, 11), bool).at[..., 0].set(False)
  tempered = sampling.masked_logprobs(logits[:, :-1], temperature=0.7, kept_mask=kept)
  np.testing.assert_array_equal(
      sampling.next_token_logprobs(logits, tokens, temperature=0.7, kept_mask=kept),
      sampling.token_logprobs(tempered, tokens[:, 1:]))


def test_greedy_and_vocab_limit():
  """Greedy takes the argmax among ids below vocab_limit and reports that token's tempered
  log-prob; sampling with vocab_limit never draws a removed id."""
  logits = jnp.array([[0.0, 1.0, 5.0, 9.0], [3.0, 1.0, 0.0, -1.0]])
  keys = jax.random.split(jax.random.key(0), 2)
  tokens, token_logp, _ = sampling.sample(keys, logits, temperature=0.0, greedy=True,
                                          vocab_limit=3)
  assert np.asarray(tokens).tolist() == [2, 0]
  expected = jax.nn.log_softmax(logits[:, :3])[jnp.arange(2), tokens]
  np.testing.assert_allclose(token_logp, expected, atol=1e-6)
  drawn, _, _ = draw(jnp.array([0.0, 0.0, 0.0, 4.0]), temperature=1.0, vocab_limit=3)
  assert drawn.max() < 3


@pytest.mark.parametrize("vocab", [1000, 4099])
def test_sampler_over_many_ids_per_group(vocab):
  """`sample` reads the logits in 128 groups of several ids (a ragged last group at 4099): greedy
  gives jnp.argmax of the kept logits (ties: the first id), draws at T=0.7 with top-k and a
  vocab_limit follow the kept softmax (chi-square), and every reported log-prob is the
  trainer's `masked_logprobs` of that token."""
  rng = np.random.default_rng(vocab)
  base = rng.normal(size=vocab).astype(np.float32) * 2
  base[rng.integers(0, vocab, 20)] = base.max()  # tied maxima in several groups
  logits = jnp.asarray(base)
  settings = dict(temperature=0.7, top_k=300, vocab_limit=vocab - 50)
  kept = np.asarray(sampling.kept_set(logits / 0.7, top_k=300, vocab_limit=vocab - 50))
  trainer = np.asarray(sampling.masked_logprobs(logits, temperature=0.7,
                                                kept_mask=jnp.asarray(kept)))
  tokens, token_logp, _ = draw(logits, **settings)
  assert chi_square_pvalue(tokens, np.where(kept, np.exp(trainer), 0.0)) > 1e-3
  np.testing.assert_allclose(token_logp, trainer[tokens], atol=1e-5)
  rows = jnp.asarray(rng.normal(size=(16, vocab)).astype(np.float32)).at[:, 7].set(9.0)
  rows = rows.at[:8, vocab - 3].set(9.0).at[8:, vocab - 60].set(9.5)
  greedy, greedy_logp, _ = sampling.sample(jax.random.split(jax.random.key(1), 16), rows,
                                           temperature=0.7, greedy=True, vocab_limit=vocab - 50)
  limited = jnp.where(jnp.arange(vocab) < vocab - 50, rows, -jnp.inf)
  np.testing.assert_array_equal(greedy, jnp.argmax(limited, axis=-1))
  expected = jax.nn.log_softmax(limited / 0.7)[jnp.arange(16), greedy]
  np.testing.assert_allclose(greedy_logp, expected, atol=1e-5)


@pytest.mark.parametrize("top_p,top_k", [(1.0, 1), (1.0, 7), (0.9, 5), (0.5, 40), (0.99, 300)])
def test_kept_ids_round_trip(top_p, top_k):
  """The recorded kept ids (int32 [..., top_k], 4 * top_k bytes per token, ascending, -1 padded)
  rebuild exactly the sampler's kept set, for random logits over a 300-id vocabulary and
  several top-p / top-k; a position without ids keeps every id."""
  logits = 3.0 * jax.random.normal(jax.random.key(top_k), (4, 6, 300))
  _, kept = sampling.sampling_logprobs(logits, temperature=0.8, top_p=top_p, top_k=top_k)
  width = sampling.kept_ids_width(top_p=top_p, top_k=top_k, vocab_size=300)
  assert width == min(top_k, 300)
  ids = sampling.kept_ids_from_mask(kept, width)
  assert ids.dtype == jnp.int32 and ids.shape == (4, 6, width)
  assert ids.nbytes // (4 * 6) == 4 * width
  np.testing.assert_array_equal(sampling.kept_mask_from_ids(ids, 300), kept)
  ids = np.asarray(ids)
  count = np.asarray(kept).sum(-1)
  for row, n in zip(ids.reshape(-1, width), count.reshape(-1)):
    assert np.all(np.diff(row[:n]) > 0) and np.all(row[n:] == -1)
  assert bool(sampling.kept_mask_from_ids(jnp.full((2, width), -1), 300).all())


@pytest.mark.parametrize("settings", [dict(top_k=7), dict(top_k=40, top_p=0.8),
                                      dict(top_p=0.9, max_kept=6), dict(top_k=300)])
def test_sampler_record_is_the_kept_set(settings):
  """The record `sample_and_cut` writes (from the ranked prefix where the kept set is bounded)
  is `kept_record` of the kept mask it returns; the drawn tokens are in that set, and their
  log-probs are the trainer's over the set rebuilt from the record."""
  logits = 3.0 * jax.random.normal(jax.random.key(5), (64, 300))
  keys = jax.random.split(jax.random.key(2), 64)
  width = sampling.kept_ids_width(top_p=settings.get("top_p", 1.0), top_k=settings.get("top_k", 0),
                                  vocab_size=300, max_kept=settings.get("max_kept", 0))
  cap = settings.get("max_kept", 0)
  tokens, logp, kept, cut, record = jax.jit(lambda k, x: sampling.sample_and_cut(
      k, x, temperature=0.8, record_width=width, **settings))(keys, logits)
  np.testing.assert_array_equal(record, sampling.kept_record(kept, cut, width, cap=cap))
  rebuilt = sampling.kept_mask_from_ids(record, 300)
  np.testing.assert_array_equal(rebuilt, kept)
  assert bool(kept[jnp.arange(64), tokens].all())
  trainer = sampling.masked_logprobs(logits, temperature=0.8, kept_mask=rebuilt)
  np.testing.assert_allclose(sampling.token_logprobs(trainer, tokens), logp, atol=1e-5)


def test_kept_ids_width_is_the_recording_rule():
  """Nothing is recorded when the sampler does not truncate (top_p 1 and top_k 0, or greedy);
  top_k ids when it does; top-p without top-k (an unbounded kept set) is refused."""
  assert sampling.kept_ids_width(top_p=1.0, top_k=0) == 0
  assert sampling.kept_ids_width(top_p=0.9, top_k=0, greedy=True) == 0
  assert sampling.kept_ids_width(top_p=0.95, top_k=256) == 256
  assert sampling.kept_ids_width(top_p=1.0, top_k=20, vocab_size=8) == 8
  with pytest.raises(ValueError, match="top_p=0.95 with top_k=0 and max_kept=0"):
    sampling.kept_ids_width(top_p=0.95, top_k=0)
  # Top-p alone: max_kept ids (at most the vocabulary) and the cut flag slot.
  assert sampling.kept_ids_width(top_p=0.95, top_k=0, max_kept=32) == 33
  assert sampling.kept_ids_width(top_p=0.95, top_k=0, max_kept=32, vocab_size=8) == 9
  assert sampling.kept_ids_width(top_p=0.95, top_k=16, max_kept=32) == 16  # top-k bounds it


@pytest.mark.parametrize("cap", [1, 6, 40, 300])
def test_top_p_alone_record_is_the_nucleus_cut_to_the_cap(cap):
  """Top-p without top-k under keep-sampling-mask: the record holds the sampler's nucleus
  exactly where it has at most `cap` ids (flag slot -1); a wider nucleus is cut to its `cap`
  most probable ids (flag -2) and counted; either way the mask rebuilt from the record is the
  set the sampler drew from, and its log-probs are the sampler's."""
  vocab, top_p = 300, 0.9
  logits = 2.0 * jax.random.normal(jax.random.key(cap), (64, vocab))
  logits = logits.at[:32].multiply(4.0)  # half the rows peaked: narrow nuclei
  keys = jax.random.split(jax.random.key(1), 64)
  width = sampling.kept_ids_width(top_p=top_p, top_k=0, vocab_size=vocab, max_kept=cap)
  applied = sampling.nucleus_cap(top_p=top_p, top_k=0, max_kept=cap, vocab_size=vocab)
  tokens, logp, kept, cut, record = sampling.sample_and_cut(
      keys, logits, temperature=0.8, top_p=top_p, max_kept=applied, record_width=width)
  record = np.asarray(record)
  np.testing.assert_array_equal(record, sampling.kept_record(kept, cut, width, cap=applied))
  assert record.shape == (64, min(cap, vocab) + 1)
  rebuilt = np.asarray(sampling.kept_mask_from_ids(record, vocab))
  np.testing.assert_array_equal(rebuilt, kept)
  nucleus = np.asarray(sampling.kept_set(logits / 0.8, top_p=top_p))
  sizes = nucleus.sum(-1)
  wide = sizes > cap
  np.testing.assert_array_equal(rebuilt[~wide], nucleus[~wide])
  assert np.all(record[~wide, -1] == -1) and np.all(record[wide, -1] == sampling.CUT_FLAG)
  assert sampling.cut_tokens(record) == wide.sum()
  for row in np.nonzero(wide)[0]:  # the cap's most probable ids of the nucleus
    top = np.argsort(-np.asarray(logits[row]), kind="stable")[:cap]
    assert rebuilt[row].sum() == cap and set(np.nonzero(rebuilt[row])[0]) == set(top)
    assert nucleus[row, top].all()
  assert rebuilt[np.arange(64), np.asarray(tokens)].all()
  trainer = sampling.masked_logprobs(logits, temperature=0.8, kept_mask=jnp.asarray(rebuilt))
  np.testing.assert_allclose(np.asarray(sampling.token_logprobs(trainer, tokens)),
                             np.asarray(logp), atol=1e-5)
  if cap == 1:
    assert wide.sum() > 16  # the flat rows' nuclei are wider than one id
  if cap == 300:
    assert not wide.any()  # a cap of the whole vocabulary never cuts
  elif cap == 6:
    assert 0 < wide.sum() < 64  # some nuclei fit, some are cut


def test_bad_arguments_name_the_value():
  """Temperature, top-p and top-k outside their ranges raise with the bad value named."""
  with pytest.raises(ValueError, match="temperature=0"):
    sampling.sampling_logprobs(LOGITS, temperature=0)
  with pytest.raises(ValueError, match="top_p=1.5"):
    sampling.sampling_logprobs(LOGITS, temperature=1.0, top_p=1.5)
  with pytest.raises(ValueError, match="top_k=-1"):
    sampling.sampling_logprobs(LOGITS, temperature=1.0, top_k=-1)


def sparse_weights(vocab, seed):
  """Weights over `vocab` ids with runs of zeros: whole zero groups, zeros on group edges and
  at both ends of the vocabulary (the cases a two-level inverse CDF can get wrong)."""
  rng = np.random.default_rng(seed)
  w = rng.gamma(0.5, size=vocab)
  w[rng.random(vocab) < 0.4] = 0.0
  width = -(-vocab // 128)
  w[:width] = 0.0
  w[5 * width:9 * width] = 0.0
  w[-3:] = 0.0
  return w


@pytest.mark.parametrize("vocab", [300, 1000, 4099])
def test_draw_frequencies_over_many_groups(vocab):
  """`sample` (one uniform per row through group masses, then inside the group) draws each id
  with probability weight / sum on vocabularies of several ids per group and a ragged last
  group; ids of weight 0 (logit -inf) never come out."""
  w = sparse_weights(vocab, vocab)
  with np.errstate(divide="ignore"):
    tokens, _, _ = draw(jnp.asarray(np.log(w), jnp.float32), temperature=1.0)
  assert chi_square_pvalue(tokens, w) > 1e-3


def test_inverse_cdf_edges_land_on_positive_weights():
  """u at 0 gives the first id of positive weight and u just below 1 (or at 1, where rounding
  of the cumulative sums can carry a draw) the last: never an id of weight 0, with masses
  spanning 1e-30..1e3 in one row."""
  rows = []
  for seed in range(6):
    w = sparse_weights(1000, seed)
    w[np.nonzero(w)[0][::2]] *= 1e-30
    rows.append(w)
  w = jnp.asarray(np.stack(rows), jnp.float32)
  for u, pick in ((0.0, lambda nz: nz[0]), (1.0, lambda nz: nz[-1]),
                  (np.nextafter(np.float32(1), np.float32(0)), lambda nz: nz[-1])):
    ids = np.asarray(sampling.inverse_cdf(w, jnp.full((w.shape[0],), u, jnp.float32)))
    for row, i in zip(np.asarray(w), ids):
      assert row[i] > 0
      assert i == pick(np.nonzero(row)[0]) or row[pick(np.nonzero(row)[0])] < 1e-20
  u = jax.random.uniform(jax.random.key(0), (2000,))
  ids = np.asarray(sampling.inverse_cdf(jnp.repeat(w, 2000 // w.shape[0] + 1, 0)[:2000], u))
  weights = np.asarray(jnp.repeat(w, 2000 // w.shape[0] + 1, 0)[:2000])
  assert (weights[np.arange(2000), ids] > 0).all()


def test_greedy_is_jnp_argmax():
  """Greedy `sample` returns jnp.argmax's index: the first of tied maxima, rows of -inf giving 0,
  a lone finite id among -inf, on vocabularies with a ragged last group."""
  rng = np.random.default_rng(0)
  keys = jax.random.split(jax.random.key(0), 64)
  for vocab in (7, 128, 1000, 4099):
    x = rng.integers(-3, 3, size=(64, vocab)).astype(np.float32)  # many ties
    x[1] = -np.inf
    x[2, :] = -np.inf
    x[2, vocab // 2] = -1e30
    x[3, :] = -np.inf
    x[3, -1] = 5.0
    tokens = sampling.sample(keys, jnp.asarray(x), temperature=1.0, greedy=True)[0]
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(jnp.argmax(jnp.asarray(x), axis=-1)))
