"""The sampling distribution, shared by the rollout engine and the trainer.

One definition of "the distribution the sampler drew from", so that the behaviour log-probs the
rollout records (`logp_old`) and the log-probs the trainer recomputes are the same function of
the logits:

  1. logits / temperature (fp32);
  2. ids >= vocab_limit removed (the tokenizer may emit fewer ids than the model has rows);
  3. top-k: the k highest-scoring ids are kept (exactly k: ties are broken by a stable sort);
  4. top-p (nucleus) over the renormalised top-k distribution: the smallest prefix of ids,
     by decreasing probability, whose mass reaches top_p (at least one id);
  5. renormalised over the kept set: log-probs are -inf outside it.

Without top-p / top-k / vocab_limit the kept set is the whole vocabulary and the log-probs are
log_softmax(logits / temperature). `sample` draws from it by inverse CDF with one uniform per
row (`inverse_cdf`), greedy takes the first maximum, both in two levels over 128 groups of ids,
and forms only the drawn ids' log-probs. Top-k (and the top-p cap below) bound the kept set:
only the top P ids of a row are ranked (`jax.lax.top_k`, not a sort of the vocabulary), and the
draw and the record read only them.

Keep-sampling-mask (DeepSeek-V3.2): the rollout records the kept set of every sampled token so
the trainer restricts its log-softmax to it (pi_old and pi_theta share one action space, and
sampler and trainer log-probs are equal). The record is the kept ids, int32 [..., width]
(`kept_ids_from_mask`: ascending, padded with -1), 4 bytes per id and token: 1 KiB at top_k
256 against V / 8 = 16 KiB for a bit array of DeepSeek's 129k vocabulary. A position the
sampler did not draw (prompt, padding) holds only -1 and keeps every id. The trainer rebuilds
the boolean [..., V] mask inside its jitted step (`kept_mask_from_ids`). `kept_ids_width` is
the rule: a sampler that does not truncate (top_p 1 and top_k 0, or greedy) keeps every allowed
id and records nothing (the trainer's full distribution is the sampler's; run configs never set
vocab_limit); with top-k the record is top_k ids wide.

Top-p alone (the paper's setting) has a nucleus of up to V ids, so the record is bounded by
`max_kept`: the sampler's kept set is the nucleus cut to its `max_kept` most probable ids
(`kept_set_and_cut`), which is exact top-p whenever the nucleus has at most `max_kept` ids.
The record is max_kept + 1 wide: the ids, then a flag slot that holds CUT_FLAG (-2) where the
nucleus was wider and was cut, else -1, so the cut tokens are counted from the record
(`cut_tokens`) and the trainer still rebuilds exactly the set the sampler drew from.

`next_token_logprobs` is the one log p(token t | tokens < t) of a sequence that every objective
reads (RL update, SFT, DPO, the tool warm start); `token_logprobs` reads chosen ids out of a
distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


CUT_FLAG = -2  # the flag slot of a top-p record whose nucleus was cut to max_kept ids


def _allowed(shape: tuple[int, ...], vocab_limit: int | None) -> jax.Array:
  vocab = shape[-1]
  if vocab_limit is not None and vocab_limit < vocab:
    return jnp.broadcast_to(jnp.arange(vocab) < vocab_limit, shape)
  return jnp.ones(shape, bool)


def _ranked(scaled_logits: jax.Array, *, top_p: float, top_k: int, vocab_limit: int | None,
            max_kept: int) -> tuple[jax.Array, ...] | None:
  """None where the sampler keeps every allowed id; else (order, scores, keep [..., P], cut
  [...]): the ids by decreasing score, ties to the lower id, as far as the kept set can reach
  (P = top_k with top-k, max_kept + 1 with the cap alone, else V), their scores, which of them
  are kept (a prefix) and whether max_kept cut the set.

  Only the prefix is ranked, by lax.top_k (which orders ties as the stable sort does); a full
  sort of the vocabulary is left to top-p without a bound (128 x 151936 fp32 on a 2-core XLA:CPU
  host, top_k 50: 13.9 s a sampler step by argsort, 35 ms by top-k; docs/performance.md)."""
  vocab = scaled_logits.shape[-1]
  use_top_k = 0 < top_k < vocab
  use_cap = 0 < max_kept < vocab
  if not use_top_k and top_p >= 1.0 and not use_cap:
    return None
  scores = jnp.where(_allowed(scaled_logits.shape, vocab_limit),
                     scaled_logits.astype(jnp.float32), -jnp.inf)
  prefix = top_k if use_top_k else (max_kept + 1 if use_cap else vocab)
  if prefix < vocab:
    # XLA:CPU lowers top-k to a sort of the row and finds its TopK call again where the sort's
    # users only slice off the first k: a slice of those (the peak below) left a sort of the
    # vocabulary (128 x 151936, top_k 50: 6.7 s a step), hence the barrier; and it made one call
    # per output used (82 against 35 ms), hence the scores gathered back by id.
    order = jax.lax.optimization_barrier(jax.lax.top_k(scores, prefix)[1])
    sorted_scores = jnp.take_along_axis(scores, order, axis=-1)
  else:
    order = jnp.argsort(-scores, axis=-1, stable=True)
    sorted_scores = jnp.take_along_axis(scores, order, axis=-1)
  rank = jnp.arange(min(prefix, vocab))
  keep = jnp.isfinite(sorted_scores)
  if top_p < 1.0:
    # Probabilities over the top-k set (all inside the prefix), else over every allowed id.
    norm = (jax.nn.logsumexp(jnp.where(keep, sorted_scores, -jnp.inf), axis=-1, keepdims=True)
            if use_top_k else _row_logsumexp(scores))
    probs = jnp.where(keep, jnp.exp(sorted_scores - norm), 0.0)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep = keep & ((mass_before < top_p) | (rank == 0))
  cut = jnp.zeros(scaled_logits.shape[:-1], bool)
  if use_cap:  # kept ids are a prefix of `order`: the cap keeps its first max_kept
    cut = jnp.sum(keep, axis=-1) > max_kept
    keep = keep & (rank < max_kept)
  return order, sorted_scores, keep, cut


def _row_logsumexp(scores: jax.Array) -> jax.Array:
  """logsumexp over the last axis, [..., V] -> [..., 1], in `_grouped`'s two levels (a row's
  reduction over 128 groups runs on XLA:CPU's threads, one over whole rows does not: 128 x 151936,
  ~40 ms against ~10 ms)."""
  flat = scores.reshape(-1, scores.shape[-1])
  grouped = _grouped(flat, -jnp.inf)
  peak = jnp.max(jax.lax.optimization_barrier(jnp.max(grouped, axis=-1)), axis=-1)
  peak = jnp.where(jnp.isfinite(peak), peak, 0.0)[:, None]
  mass = jax.lax.optimization_barrier(jnp.sum(jnp.exp(grouped - peak[..., None]), axis=-1))
  return (peak + jnp.log(jnp.sum(mass, axis=-1, keepdims=True))).reshape(*scores.shape[:-1], 1)


def _kept_mask(order: jax.Array, keep: jax.Array, vocab: int) -> jax.Array:
  """`_ranked`'s kept prefix as a boolean [..., V] mask."""
  flat = order.reshape(-1, order.shape[-1])
  rows = jnp.arange(flat.shape[0])[:, None]
  mask = jnp.zeros((flat.shape[0], vocab), bool).at[rows, flat].set(
      keep.reshape(flat.shape), unique_indices=True)
  return mask.reshape(*order.shape[:-1], vocab)


def kept_set_and_cut(scaled_logits: jax.Array, *, top_p: float = 1.0, top_k: int = 0,
                     vocab_limit: int | None = None, max_kept: int = 0
                     ) -> tuple[jax.Array, jax.Array]:
  """(boolean [..., V] mask of the ids the sampler may draw, bool [...] whether max_kept cut
  the set), from logits already divided by T. `max_kept` > 0 keeps at most that many ids after
  top-k and top-p, the most probable ones (ties broken by id)."""
  ranked = _ranked(scaled_logits, top_p=top_p, top_k=top_k, vocab_limit=vocab_limit,
                   max_kept=max_kept)
  if ranked is None:
    return (_allowed(scaled_logits.shape, vocab_limit),
            jnp.zeros(scaled_logits.shape[:-1], bool))
  order, _, keep, cut = ranked
  return _kept_mask(order, keep, scaled_logits.shape[-1]), cut


def kept_set(scaled_logits: jax.Array, *, top_p: float = 1.0, top_k: int = 0,
             vocab_limit: int | None = None, max_kept: int = 0) -> jax.Array:
  """Boolean [..., V] mask of the ids the sampler may draw, from logits already divided by T."""
  return kept_set_and_cut(scaled_logits, top_p=top_p, top_k=top_k, vocab_limit=vocab_limit,
                          max_kept=max_kept)[0]


def masked_logprobs(logits: jax.Array, *, temperature: float, kept_mask: jax.Array | None = None,
                    vocab_limit: int | None = None) -> jax.Array:
  """log-probs [..., V] of softmax(logits / T) renormalised over `kept_mask` (-inf outside).

  The trainer's recomputation: with the recorded kept mask (keep-sampling-mask) it equals the
  sampler's `sampling_logprobs`; without one it is the full-vocabulary distribution (restricted
  to ids < vocab_limit when given). A row whose mask keeps nothing gives zeros, not NaNs, so
  padding positions never poison a masked loss.
  """
  scaled = logits.astype(jnp.float32) / temperature
  vocab = logits.shape[-1]
  if vocab_limit is not None and vocab_limit < vocab:
    limit = jnp.arange(vocab) < vocab_limit
    kept_mask = limit if kept_mask is None else kept_mask & limit
  if kept_mask is None:
    return jax.nn.log_softmax(scaled, axis=-1)
  scaled = jnp.where(kept_mask, scaled, -jnp.inf)
  peak = jnp.max(scaled, axis=-1, keepdims=True)
  peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
  shifted = scaled - jax.lax.stop_gradient(peak)
  log_norm = jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))
  logp = shifted - log_norm
  return jnp.where(jnp.isfinite(log_norm), logp, 0.0)


def token_logprobs(logp_all: jax.Array, tokens: jax.Array) -> jax.Array:
  """log-probs [...] of the ids `tokens` [...] in the distributions `logp_all` [..., V]."""
  return jnp.take_along_axis(logp_all, tokens[..., None], axis=-1)[..., 0]


def next_token_logprobs(logits_BTV: jax.Array, tokens_BT: jax.Array, *,
                        temperature: float = 1.0,
                        kept_mask: jax.Array | None = None) -> jax.Array:
  """log p(tokens[:, t] | tokens[:, :t]) for t = 1..T-1: fp32 [B, T-1].

  Position t - 1 predicts token t, through `masked_logprobs` (logits in fp32 divided by
  `temperature`, renormalised over `kept_mask` [B, T-1, V], the kept set of each target token,
  when given). The defaults give log_softmax of the fp32 logits, the supervised losses' choice.
  """
  logp_all = masked_logprobs(logits_BTV[:, :-1], temperature=temperature, kept_mask=kept_mask)
  return token_logprobs(logp_all, tokens_BT[:, 1:])


def _check_settings(temperature: float, top_p: float, top_k: int) -> None:
  if temperature <= 0:
    raise ValueError(f"temperature={temperature}: must be > 0 (use greedy decoding for T=0)")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p={top_p}: must be in (0, 1]")
  if top_k < 0:
    raise ValueError(f"top_k={top_k}: must be >= 0 (0 disables top-k)")


def sampling_logprobs(logits: jax.Array, *, temperature: float, top_p: float = 1.0,
                      top_k: int = 0, vocab_limit: int | None = None, max_kept: int = 0
                      ) -> tuple[jax.Array, jax.Array]:
  """The exact distribution the sampler draws from: (logprobs [..., V], kept_mask [..., V]).

  logprobs are -inf outside the kept set (temperature, vocab_limit, top-k, top-p and the
  max_kept cut as in the module docstring).
  """
  _check_settings(temperature, top_p, top_k)
  scaled = logits.astype(jnp.float32) / temperature
  kept = kept_set(scaled, top_p=top_p, top_k=top_k, vocab_limit=vocab_limit, max_kept=max_kept)
  logp = masked_logprobs(logits, temperature=temperature, kept_mask=kept)
  return jnp.where(kept, logp, -jnp.inf), kept


_GROUPS = 128  # the sampler works on [B, 128, ceil(V / 128)]: one group per row first


def _grouped(x: jax.Array, fill: float) -> jax.Array:
  """x [B, V] -> [B, G, W] (G = 128 groups of W = ceil(V / G) consecutive ids, padded with fill)."""
  width = -(-x.shape[-1] // _GROUPS)
  pad = width * _GROUPS - x.shape[-1]
  if pad:
    x = jnp.pad(x, ((0, 0), (0, pad)), constant_values=fill)
  return x.reshape(x.shape[0], _GROUPS, width)


def _pick(grouped: jax.Array, group: jax.Array) -> jax.Array:
  """Row b of group[b]: grouped [B, G, W], group [B] -> [B, W]."""
  return jnp.take_along_axis(grouped, group[:, None, None], axis=1)[:, 0]


def inverse_cdf(weights: jax.Array, u: jax.Array) -> jax.Array:
  """The id where u [B] in [0, 1) falls in the cumulative mass of weights [B, V], in two levels:
  the group (of `_grouped`'s 128), then the id inside it. Ids of weight 0 are never returned."""
  weights = _grouped(weights.astype(jnp.float32), 0.0)  # [B, G, W]
  group, inner = _inverse_cdf_in_groups(jnp.sum(weights, axis=-1),
                                        lambda group: _pick(weights, group), u)
  return (group * weights.shape[-1] + inner).astype(jnp.int32)


def _inverse_cdf_in_groups(mass: jax.Array, row_of, u: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`inverse_cdf` from the groups' masses [B, G] and `row_of(group [B])`, the weights [B, W]
  of one group per row: (group [B], index inside it [B])."""
  upto = jnp.cumsum(mass, axis=-1)
  target = u * upto[:, -1]  # in [0, total)
  # The first group whose cumulative mass passes target has mass > 0; rounding can only leave
  # the count at G when target meets the total, so it is clamped to the last group with mass.
  last_group = jnp.max(jnp.where(mass > 0, jnp.arange(mass.shape[-1]), 0), axis=-1)
  group = jnp.minimum(jnp.sum(upto <= target[:, None], axis=-1), last_group)
  before = jnp.take_along_axis(upto - mass, group[:, None], axis=-1)[:, 0]
  row = row_of(group)  # [B, W]
  last_id = jnp.max(jnp.where(row > 0, jnp.arange(row.shape[-1]), 0), axis=-1)
  inner = jnp.sum(jnp.cumsum(row, axis=-1) <= (target - before)[:, None], axis=-1)
  # `inner` lands on an id with weight > 0 unless rounding carries it past the group's last
  # such id: clamped there.
  return group, jnp.minimum(inner, last_id)


def sample(keys: jax.Array, logits: jax.Array, *, temperature: float, top_p: float = 1.0,
           top_k: int = 0, vocab_limit: int | None = None, greedy: bool = False,
           max_kept: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Draws one token per row: keys [B] (typed PRNG keys), logits [B, V].

  Returns (tokens [B] int32, their log-probs [B] under `sampling_logprobs`, kept_mask [B, V]).
  Greedy takes the argmax among ids < vocab_limit; its log-prob is still reported under the
  tempered distribution (T = temperature, or 1 when temperature is 0), i.e. the policy's own
  probability of the chosen token, and its kept set is every allowed id. Only the drawn ids'
  log-probs are formed (the [B, V] array of them is not).
  """
  return sample_and_cut(keys, logits, temperature=temperature, top_p=top_p, top_k=top_k,
                        vocab_limit=vocab_limit, greedy=greedy, max_kept=max_kept)[:3]


def sample_and_cut(keys: jax.Array, logits: jax.Array, *, temperature: float,
                   top_p: float = 1.0, top_k: int = 0, vocab_limit: int | None = None,
                   greedy: bool = False, max_kept: int = 0, record_width: int = 0
                   ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array | None]:
  """`sample`, per row whether max_kept cut the kept set (bool [B]), and with record_width > 0
  each row's kept-id record (`kept_record` of the kept set, `record_width` wide and capped at
  max_kept), else None."""
  if greedy:
    temperature, top_p, top_k, max_kept = (temperature if temperature > 0 else 1.0), 1.0, 0, 0
  _check_settings(temperature, top_p, top_k)
  vocab = logits.shape[-1]
  scaled = logits.astype(jnp.float32) / temperature
  ranked = _ranked(scaled, top_p=top_p, top_k=top_k, vocab_limit=vocab_limit, max_kept=max_kept)
  if ranked is not None and ranked[0].shape[-1] < vocab:
    # A bounded kept set (top-k, or the nucleus cap) lies in the ranked prefix: the draw and
    # the record read only the prefix's P ids (128 x 151936 fp32 at top_k 256, top_p 0.95 on a
    # 2-core XLA:CPU host, draw and record: 13.5 s a step after a full sort, 52 ms from the
    # prefix; docs/performance.md).
    order, ranked_scores, keep, cut = ranked
    peak = ranked_scores[:, :1]  # the first ranked id: the row's maximum, always kept
    weights = jnp.where(keep, jnp.exp(ranked_scores - peak), 0.0)
    at = inverse_cdf(weights, jax.vmap(jax.random.uniform)(keys))[:, None]
    tokens = jnp.take_along_axis(order, at, axis=-1)[:, 0].astype(jnp.int32)
    logp = (jnp.take_along_axis(ranked_scores, at, axis=-1)[:, 0] - peak[:, 0]
            - jnp.log(jnp.sum(weights, axis=-1)))
    kept = _kept_mask(order, keep, vocab)
    record = None
    if record_width:
      if (max_kept or record_width) > order.shape[-1]:
        record = kept_record(kept, cut, record_width, cap=max_kept)
      else:  # the kept ids ascending, then -1: the prefix sorted, not the [B, V] mask ranked
        ids = jnp.sort(jnp.where(keep, order, vocab), axis=-1)[:, :max_kept or record_width]
        record = _with_cut_flag(jnp.where(ids < vocab, ids, -1).astype(jnp.int32), cut, max_kept)
    return tokens, logp, kept, cut, record
  if ranked is None:
    kept, cut = _allowed(scaled.shape, vocab_limit), jnp.zeros(scaled.shape[:-1], bool)
  else:
    kept, cut = _kept_mask(ranked[0], ranked[2], vocab), ranked[3]
  # Everything below reads the [B, V] logits as `_grouped`'s [B, G, W] groups, twice: the
  # groups' maxima, then their masses exp(logit - row max) (as `masked_logprobs` shifts). Then
  # one group per row: greedy takes the group of the first maximum and the first maximum inside
  # it (jnp.argmax's id); a draw is `inverse_cdf` at one uniform per row (the Gumbel-max draw,
  # jax.random.categorical, needs V random numbers per row: 240 ms of threefry bits at 128 x
  # 151936 on XLA:CPU, more than the model's decode step). XLA:CPU spreads a reduction over
  # groups across its threads, one over whole rows not: 128 x 151936 fp32 logits on a 2-core
  # host, greedy 52-55 -> 15 ms a step, T = 1 64-71 -> 16 ms (docs/performance.md).
  scores = _grouped(jnp.where(kept, scaled, -jnp.inf), -jnp.inf)  # [B, G, W]
  # The barriers keep XLA from merging the two levels of a reduction back into one over rows.
  group_peak = jax.lax.optimization_barrier(jnp.max(scores, axis=-1))  # [B, G]
  peak = jnp.max(group_peak, axis=-1)[:, None]  # [B, 1]
  mass = jax.lax.optimization_barrier(jnp.sum(jnp.exp(scores - peak[..., None]), axis=-1))
  # The picked group is scored again from the logits and the mask: picking it from `scores`
  # would make XLA write all of them out first.
  logits_g, kept_g = _grouped(logits, 0), _grouped(kept, False)

  def scores_of(group):  # [B] -> [B, W]
    row = _pick(logits_g, group).astype(jnp.float32) / temperature
    return jnp.where(_pick(kept_g, group), row, -jnp.inf)
  if greedy:
    group = jnp.argmax(group_peak, axis=-1)
    inner = jnp.argmax(scores_of(group), axis=-1)
  else:
    u = jax.vmap(jax.random.uniform)(keys)
    group, inner = _inverse_cdf_in_groups(mass, lambda g: jnp.exp(scores_of(g) - peak), u)
  row = scores_of(group)
  logp = (jnp.take_along_axis(row, inner[:, None], axis=-1)[:, 0] - peak[:, 0]
          - jnp.log(jnp.sum(mass, axis=-1)))
  tokens = (group * scores.shape[-1] + inner).astype(jnp.int32)
  record = kept_record(kept, cut, record_width, cap=max_kept) if record_width else None
  return tokens, logp, kept, cut, record


def kept_ids_width(*, top_p: float, top_k: int, greedy: bool = False,
                   vocab_size: int | None = None, max_kept: int = 0) -> int:
  """How wide a keep-sampling-mask rollout's per-token record is: 0 when the sampler does not
  truncate (greedy, or top_p 1 and top_k 0: the kept set is every allowed id, nothing to
  record); top_k with top-k (at most `vocab_size`: a larger top_k leaves top-p alone); with
  top-p alone, max_kept ids and the cut flag slot (`nucleus_cap`). Raises for top-p alone
  without a max_kept, whose kept set has no bound."""
  if greedy or (top_p >= 1.0 and top_k == 0):
    return 0
  if top_k == 0:
    if max_kept <= 0:
      raise ValueError(f"top_p={top_p} with top_k=0 and max_kept={max_kept}: the "
                       "keep-sampling-mask records the kept ids, which top-p alone does not "
                       "bound; set max_kept (the nucleus cut to that many ids) or top_k")
    return nucleus_cap(top_p=top_p, top_k=top_k, max_kept=max_kept, vocab_size=vocab_size) + 1
  return top_k if vocab_size is None else min(top_k, vocab_size)


def nucleus_cap(*, top_p: float, top_k: int, greedy: bool = False, max_kept: int = 0,
                vocab_size: int | None = None) -> int:
  """The `max_kept` the sampler applies (at most `vocab_size`): max_kept for top-p alone (the
  record's bound), else 0 (top-k bounds the record, or nothing is recorded)."""
  if greedy or top_p >= 1.0 or top_k:
    return 0
  return max_kept if vocab_size is None else min(max_kept, vocab_size)


def kept_record(kept_mask: jax.Array, cut: jax.Array, width: int, *, cap: int) -> jax.Array:
  """The record of one sampled token per row: `kept_ids_from_mask` over `width` ids, or with a
  nucleus cap, the cap's ids then the flag slot (CUT_FLAG where `cut`, else -1)."""
  return _with_cut_flag(kept_ids_from_mask(kept_mask, cap or width), cut, cap)


def _with_cut_flag(ids: jax.Array, cut: jax.Array, cap: int) -> jax.Array:
  """ids, and with a nucleus cap the flag slot after them (CUT_FLAG where `cut`, else -1)."""
  if not cap:
    return ids
  flag = jnp.where(cut, CUT_FLAG, -1).astype(jnp.int32)[..., None]
  return jnp.concatenate([ids, flag], axis=-1)


def cut_tokens(kept_ids) -> int:
  """How many tokens of a record (a host or device array) had their nucleus cut (0 for a
  record without a flag slot: its ids are never CUT_FLAG)."""
  return int((kept_ids[..., -1] == CUT_FLAG).sum())


def kept_ids_from_mask(kept_mask: jax.Array, width: int) -> jax.Array:
  """bool [..., V] with at most `width` ids set per row -> int32 [..., width]: the kept ids in
  ascending order, padded with -1."""
  vocab = kept_mask.shape[-1]
  if vocab > 2 ** 24:
    raise ValueError(f"vocab {vocab}: kept ids are ranked as float32, exact up to 2^24 ids")
  # Kept ids score V - id (> 0), the rest 0: the top `width` scores are the kept ids, smallest
  # first, then the padding. In float32 (exact below 2^24): XLA:CPU's top-k of int32 sorts the
  # whole row (128 x 151936: 4 s against 50 ms).
  scores = jnp.where(kept_mask, (vocab - jnp.arange(vocab)).astype(jnp.float32), 0.0)
  top = jax.lax.top_k(scores, width)[0]
  return jnp.where(top > 0, vocab - top.astype(jnp.int32), -1).astype(jnp.int32)


def kept_mask_from_ids(ids: jax.Array, vocab_size: int) -> jax.Array:
  """int32 [..., K] kept ids (-1: padding) -> bool [..., V]; the inverse of
  `kept_ids_from_mask`. A position without ids (prompt, padding: nothing was drawn there) keeps
  every id, i.e. the trainer's unrestricted distribution."""
  lead = ids.shape[:-1]
  flat = ids.reshape(-1, ids.shape[-1])
  rows = jnp.arange(flat.shape[0])[:, None]
  safe = jnp.where(flat < 0, vocab_size, flat)  # padding lands out of range and is dropped
  mask = jnp.zeros((flat.shape[0], vocab_size), bool).at[rows, safe].set(True, mode="drop")
  mask = mask | jnp.all(flat < 0, axis=-1, keepdims=True)
  return mask.reshape(*lead, vocab_size)
