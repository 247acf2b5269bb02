"""The rollout engine: batched prefill and KV-cached decoding inside one jitted `lax.while_loop`,
with continuous batching, per-sequence RNG streams and the records keep-routing and
keep-sampling-mask need.

How one call runs (`run_engine`, all inside one jit):

  slots   S decode rows share one fixed-shape KV cache [S, W] (W = prompt bucket P + new M;
          on CPU from M = 128 it grows through P + M/4, M/2, 3M/4, M: `cache_widths`).
  refill  a free slot takes the next pending sequence: its prompt is prefilled (R rows at a
          time, in a fresh [R, P] cache whose rows are then copied into the free slots) and its
          next-token logits parked in the slot. Static batching is the case S >= N (one fill).
  sample  every occupied slot draws its next token from the parked logits (`rl.core.sampling`),
          with key fold_in(fold_in(rng, sequence uid), index of the token in the response), so
          the draw does not depend on which slot or step it happens in: static and continuous
          batching give the same samples.
  decode  one cached forward step processes the drawn tokens (this records the experts every
          token was processed with, the stop token included) and parks the next logits; slots
          whose sequence hit a stop id or its token budget become free for the next refill.
          A finished row's token goes through the model only to record its routing, so
          without keep-routing the step that finishes every row runs no forward.

Shapes are bucketed (prompt width to a multiple of `prompt_bucket` or a fixed
`max_prompt_len`; sequence count to a multiple of the slot count), so steady-state calls reuse
one compiled program; `trace_count()` counts compilations for tests.

Output rows follow the `Trajectories` layout: prompt, then response, then padding; logp_old,
kept_ids and routing are aligned with the tokens (routing[n, t] = experts used when token t
was processed; kept_ids[n, t] = the ids the sampler could draw token t from, int32 [top_k] padded with -1
(top-p alone: max_kept_ids ids and a cut flag), recorded only when it truncates:
rl/core/sampling.py kept_ids_width). Prompts
in, `Trajectories` out (bucketing the prompts, repeating them per sample, wrapping the output)
is rl/rollout/trajectories.py, built on `run_engine`.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from models import cache as cache_lib
from models import ops
from models import sharding as sharding_lib
from models.padding import round_up
from rl.rollout import fp8
from rl.core import sampling
from rl.core.batching import batching

_TRACES: collections.Counter = collections.Counter()


def trace_count() -> int:
  """How many times the engine has been traced (= compiled) in this process."""
  return sum(_TRACES.values())


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """Sampling and batching settings of the rollout engine."""

  max_new_tokens: int = 256
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0  # 0: off
  greedy: bool = False
  stop_ids: tuple[int, ...] = ()
  prompt_bucket: int = 64  # prompt width is rounded up to a multiple of this
  max_prompt_len: int = 0  # > 0: every batch uses exactly this prompt width
  batch_size: int = 0  # decode slots; 0: one slot per sequence (static batching)
  prefill_batch: int = 0  # prompts prefilled together on refill; 0: max(1, batch_size // 4)
  keep_sampling_mask: bool = False
  # Keep-sampling-mask with top-p alone: the nucleus is cut to this many ids (the record's
  # bound; rl/core/sampling.py kept_ids_width). 0: top-p alone is refused.
  max_kept_ids: int = 0
  keep_routing: bool = False
  vocab_limit: int | None = None  # ids >= this are never sampled
  pad_id: int = 0

  def __post_init__(self):
    object.__setattr__(self, "stop_ids", tuple(int(i) for i in self.stop_ids))
    if self.max_new_tokens <= 0:
      raise ValueError(f"RolloutConfig.max_new_tokens={self.max_new_tokens}: must be positive")
    if not self.greedy and self.temperature <= 0:
      raise ValueError(f"RolloutConfig.temperature={self.temperature}: must be > 0 unless "
                       "greedy=True")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"RolloutConfig.top_p={self.top_p}: must be in (0, 1]")
    for name in ("top_k", "max_prompt_len", "batch_size", "prefill_batch", "max_kept_ids"):
      if getattr(self, name) < 0:
        raise ValueError(f"RolloutConfig.{name}={getattr(self, name)}: must be >= 0")
    if self.prompt_bucket <= 0:
      raise ValueError(f"RolloutConfig.prompt_bucket={self.prompt_bucket}: must be positive")
    if self.vocab_limit is not None and self.vocab_limit <= 0:
      raise ValueError(f"RolloutConfig.vocab_limit={self.vocab_limit}: must be positive")
    if self.keep_sampling_mask:
      try:
        sampling.kept_ids_width(top_p=self.top_p, top_k=self.top_k, greedy=self.greedy,
                                max_kept=self.max_kept_ids)
      except ValueError as e:
        raise ValueError(f"RolloutConfig.keep_sampling_mask: {e}") from None

  def replace(self, **changes: Any) -> "RolloutConfig":
    return dataclasses.replace(self, **changes)


def run_rollout_config(config, *, stop_ids: Sequence[int] = (), pad_id: int = 0
                       ) -> RolloutConfig:
  """The training rollouts' settings of a run config (config.rollout, config.rl's
  keep-sampling-mask and keep-routing; temperature 0 is greedy) with the tokenizer's stop and
  pad ids: what the trainer samples with and the dry run compiles."""
  r = config.rollout
  return RolloutConfig(
      max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
      greedy=r.temperature == 0, stop_ids=tuple(stop_ids), prompt_bucket=r.prompt_bucket,
      batch_size=r.batch_size, prefill_batch=r.prefill_batch,
      keep_sampling_mask=config.rl.keep_sampling_mask, max_kept_ids=r.max_kept_ids,
      keep_routing=config.rl.keep_routing, pad_id=pad_id)


@dataclasses.dataclass(frozen=True)
class _EngineSpec:
  """Everything static about one compiled engine (shapes come from the arguments)."""

  slots: int
  refill_rows: int
  # Consecutive sequences [g*G, (g+1)*G) share one context (a group's samples of one prompt):
  # a refill prefills each context once and copies its KV rows and last logits to the group's
  # slots. refill_contexts: contexts one refill can touch (static: refill_rows / G).
  group: int
  refill_contexts: int
  new_tokens: int  # M: response tokens one call may add to a sequence
  temperature: float
  top_p: float
  top_k: int
  greedy: bool
  keep_sampling_mask: bool
  max_kept_ids: int
  keep_routing: bool
  vocab_limit: int | None
  pad_id: int
  row_sharding: NamedSharding | None  # rows (slots, sequences) over the mesh's batch axes


# ------------------------------------------------------------------------------ Engine

def _scatter_cache_rows(cache: dict, rows: dict, slots: jax.Array) -> dict:
  """Copies prefill cache rows [R, ..., P, C] into slots [R] of the big cache [S, ..., W, C]
  (slot S: dropped)."""
  width = cache_lib.slot_count(rows)
  layers = tuple({name: big.at[slots, ..., :width, :].set(rows_layer[name].astype(big.dtype),
                                                          mode="drop")
                  for name, big in big_layer.items()}
                 for big_layer, rows_layer in zip(cache["layers"], rows["layers"]))
  lengths = cache["lengths"].at[slots].set(rows["lengths"], mode="drop")
  return {"lengths": lengths, "layers": layers}


def _engine_fn(graphdef, spec: _EngineSpec):
  """The pure engine: (state, inputs) -> per-sequence outputs; jitted by `_compiled_engine`."""

  def constrain(x):
    if spec.row_sharding is None:
      return x
    spec_rows = PartitionSpec(spec.row_sharding.spec[0], *([None] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(spec.row_sharding.mesh, spec_rows))

  def run(state, rng, context_ids, context_lens, uids, generated_before, max_new, stop_table,
          n_real):
    _TRACES[(graphdef, spec, context_ids.shape)] += 1
    # An FP8 sampler state (rl/rollout/fp8.py) enters as codes + scales and is dequantised here.
    # The weight pipeline: FP8 codes dequantised, then the decode layout of this platform.
    model = nnx.merge(*ops.sampler_layout(graphdef, fp8.dequantize_state(state)))
    cfg = model.cfg
    n_seqs, prompt_width = context_ids.shape
    width = prompt_width + spec.new_tokens
    slots = spec.slots
    vocab = cfg.vocab_size
    free = n_seqs  # slot_seq value of an empty slot (also an out-of-range row: writes drop)
    seq_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, uids)
    record_routing = spec.keep_routing and cfg.is_moe

    def init_cache(rows, length):
      return jax.tree.map(constrain, model.init_cache(rows, length)) if rows == slots else (
          model.init_cache(rows, length))

    widths = cache_widths(prompt_width, spec.new_tokens)
    carry = {
        "cache": init_cache(slots, widths[0]),
        "slot_seq": constrain(jnp.full((slots,), free, jnp.int32)),
        "slot_count": constrain(jnp.zeros((slots,), jnp.int32)),
        "slot_new": constrain(jnp.zeros((slots,), jnp.int32)),
        "slot_logits": constrain(jnp.zeros((slots, vocab), jnp.float32)),
        "queue": jnp.zeros((), jnp.int32),
        "steps": jnp.zeros((), jnp.int32),
        "prefills": jnp.zeros((), jnp.int32),
        "tokens": constrain(jnp.pad(context_ids, ((0, 0), (0, spec.new_tokens)),
                                    constant_values=spec.pad_id)),
        "logp": constrain(jnp.zeros((n_seqs, width), jnp.float32)),
        "new_count": constrain(jnp.zeros((n_seqs,), jnp.int32)),
        "stopped": constrain(jnp.zeros((n_seqs,), bool)),
    }
    if record_routing:
      k = cfg.n_experts_per_tok
      # Positions never processed (trailing padding) hold distinct valid ids: replaying them
      # is harmless because no loss reads those positions' outputs.
      carry["routing"] = constrain(jnp.broadcast_to(
          jnp.arange(k, dtype=jnp.int32), (n_seqs, width, cfg.n_moe_layers, k)))
    kept_width = sampling.kept_ids_width(
        top_p=spec.top_p, top_k=spec.top_k, greedy=spec.greedy, vocab_size=vocab,
        max_kept=spec.max_kept_ids) if spec.keep_sampling_mask else 0
    # The nucleus cut that bounds a top-p-alone record (0: none; the sampler is unchanged).
    cap = sampling.nucleus_cap(top_p=spec.top_p, top_k=spec.top_k, greedy=spec.greedy,
                               max_kept=spec.max_kept_ids, vocab_size=vocab) if kept_width else 0
    if kept_width:
      carry["kept_ids"] = constrain(jnp.full((n_seqs, width, kept_width), -1, jnp.int32))

    def refill(c):
      """Moves up to R pending sequences into free slots (prefill + parked logits)."""
      rows = spec.refill_rows
      slot_idx = jnp.nonzero(c["slot_seq"] == free, size=rows, fill_value=slots)[0]
      seq = c["queue"] + jnp.arange(rows, dtype=jnp.int32)
      valid = (slot_idx < slots) & (seq < n_real)
      slot_idx = jnp.where(valid, slot_idx, slots)
      seq_safe = jnp.where(valid, seq, 0)
      # Shared prefill: the distinct contexts of these rows (their groups' first sequences)
      # are prefilled once each, and every row takes its context's KV rows and logits.
      first = c["queue"] // spec.group
      context_seq = (first + jnp.arange(spec.refill_contexts, dtype=jnp.int32)) * spec.group
      context_seq = jnp.where(context_seq < n_real, context_seq, 0)
      lens = context_lens[context_seq]
      out = model.forward(context_ids[context_seq],
                          cache=init_cache(spec.refill_contexts, prompt_width),
                          num_new=lens, head_at=lens - 1)
      prefilled, last_logits, routing = out.cache, out.logits[:, 0], out.routing
      if spec.group > 1:
        local = jnp.clip(seq_safe // spec.group - first, 0, spec.refill_contexts - 1)
        prefilled = jax.tree.map(lambda x: x[local], prefilled)
        last_logits = last_logits[local]
        routing = routing[local] if record_routing else routing
      c = dict(c)
      c["cache"] = _scatter_cache_rows(c["cache"], prefilled, slot_idx)
      c["slot_seq"] = c["slot_seq"].at[slot_idx].set(seq, mode="drop")
      c["slot_count"] = c["slot_count"].at[slot_idx].set(generated_before[seq_safe], mode="drop")
      c["slot_new"] = c["slot_new"].at[slot_idx].set(0, mode="drop")
      c["slot_logits"] = c["slot_logits"].at[slot_idx].set(last_logits, mode="drop")
      if record_routing:
        seq_rows = jnp.where(valid, seq, free)
        c["routing"] = c["routing"].at[seq_rows, :prompt_width].set(routing, mode="drop")
      c["queue"] = c["queue"] + jnp.sum(valid.astype(jnp.int32))
      c["prefills"] = c["prefills"] + 1
      return c

    def pending(c):
      return jnp.any(c["slot_seq"] == free) & (c["queue"] < n_real)

    def step(c):
      c = dict(jax.lax.while_loop(pending, refill, c))
      active = c["slot_seq"] < free
      seq = jnp.where(active, c["slot_seq"], 0)
      keys = jax.vmap(jax.random.fold_in)(seq_keys[seq], c["slot_count"])
      token, token_logp, _, _, record = sampling.sample_and_cut(
          keys, c["slot_logits"], temperature=spec.temperature, top_p=spec.top_p,
          top_k=spec.top_k, vocab_limit=spec.vocab_limit, greedy=spec.greedy, max_kept=cap,
          record_width=kept_width)
      token = jnp.where(active, token, spec.pad_id)
      position = c["cache"]["lengths"]
      row = c["slot_seq"]  # `free` for empty slots: their writes are dropped
      c["tokens"] = c["tokens"].at[row, position].set(token, mode="drop")
      c["logp"] = c["logp"].at[row, position].set(token_logp, mode="drop")
      if kept_width:
        c["kept_ids"] = c["kept_ids"].at[row, position].set(record, mode="drop")
      c["slot_count"] = c["slot_count"] + active
      c["slot_new"] = c["slot_new"] + active
      stop = active & jnp.any(token[:, None] == stop_table[seq], axis=-1)
      done = stop | (c["slot_new"] >= max_new[seq])
      c["new_count"] = c["new_count"].at[row].set(c["slot_new"], mode="drop")
      c["stopped"] = c["stopped"].at[row].set(stop, mode="drop")
      # The drawn tokens go through the model only where something reads the result: the next
      # logits of a row that goes on, or the routing of any drawn token when it is recorded. A
      # finished row's slot is refilled (cache rows and logits overwritten) or stays empty, so
      # the step that draws every row's last token runs no forward, as HF `generate` and vLLM
      # run none after their last token.
      forward_rows = active & ~done if not record_routing else active

      def forward(cache):
        out = model.forward(token[:, None], cache=cache, num_new=forward_rows.astype(jnp.int32))
        return out.cache, out.logits[:, 0], out.routing[:, 0] if record_routing else None

      def skip(cache):
        routing = (jnp.zeros((slots, *c["routing"].shape[2:]), c["routing"].dtype)
                   if record_routing else None)  # no active row: the writes are dropped
        return cache, c["slot_logits"], routing

      c["cache"], c["slot_logits"], routing = jax.lax.cond(
          jnp.any(forward_rows), forward, skip, c["cache"])
      if record_routing:
        c["routing"] = c["routing"].at[row, position].set(routing, mode="drop")
      c["slot_seq"] = jnp.where(done, free, c["slot_seq"])
      c["steps"] = c["steps"] + 1
      return c

    def running(c):
      return jnp.any(c["slot_seq"] < free) | (c["queue"] < n_real)

    # The cache grows through `widths` slots: a step's attention and cache write cost scale
    # with the cache's width, so early steps run on a narrower cache. A phase ends when an
    # occupied slot's next token would not fit (refills start at <= prompt_width < widths[0]).
    for i, cache_width in enumerate(widths):
      if i:
        carry["cache"] = jax.tree.map(constrain, cache_lib.widen(carry["cache"], cache_width))

      def fits(c, cache_width=cache_width):
        occupied = c["slot_seq"] < free
        return jnp.all(jnp.where(occupied, c["cache"]["lengths"], 0) < cache_width)

      last = i == len(widths) - 1
      carry = jax.lax.while_loop(
          running if last else (lambda c, fits=fits: running(c) & fits(c)), step, carry)

    positions = jnp.arange(width, dtype=jnp.int32)[None, :]
    response = ((positions >= context_lens[:, None])
                & (positions < (context_lens + carry["new_count"])[:, None]))
    result = {
        "tokens": carry["tokens"],
        "response_mask": response.astype(jnp.int32),
        "logp_old": jnp.where(response, carry["logp"], 0.0),
        "new_count": carry["new_count"],
        "stopped": carry["stopped"],
        "decode_steps": carry["steps"],
        "prefill_calls": carry["prefills"],
    }
    if record_routing:
      result["routing"] = carry["routing"]
    if kept_width:
      result["kept_ids"] = carry["kept_ids"]
    return {k: v if v.ndim == 0 else constrain(v) for k, v in result.items()}

  return run


def cache_widths(prompt_width: int, new_tokens: int) -> tuple[int, ...]:
  """The KV cache widths one engine call decodes through: prompt + j/phases of the new tokens,
  j = 1..phases (`models.ops.decode_phases`: 4 on CPU from 128 new tokens, else 1). A step
  reads only its phase's width of the cache; each width compiles its own decode loop."""
  phases = ops.decode_phases(new_tokens)
  return tuple(prompt_width + -(-new_tokens * j // phases) for j in range(1, phases + 1))


@functools.lru_cache(maxsize=64)
def _compiled_engine(graphdef, spec: _EngineSpec):
  return jax.jit(_engine_fn(graphdef, spec))


def _row_sharding(mesh) -> NamedSharding | None:
  if mesh is None:
    return None
  spec = sharding_lib.logical_to_spec(("batch",), (math.prod(mesh.devices.shape),), mesh)
  return NamedSharding(mesh, PartitionSpec(spec[0]))


def _slot_multiple(row_sharding: NamedSharding | None) -> int:
  return 1 if row_sharding is None else sharding_lib.shard_count(row_sharding.spec,
                                                                  row_sharding.mesh)


def _engine_spec(cfg: RolloutConfig, n: int, new_tokens: int, rows: int | None,
                 mesh, group: int = 1) -> tuple[_EngineSpec, int]:
  """The compiled engine's static spec for n sequences in groups of `group` sharing a context,
  and the padded sequence count."""
  row_sharding = _row_sharding(mesh)
  b = batching(cfg.batch_size, cfg.prefill_batch, n, group_size=group,
               row_shards=_slot_multiple(row_sharding), rows=rows)
  spec = _EngineSpec(
      slots=b["slots"], refill_rows=b["refill_rows"], group=group,
      refill_contexts=b["refill_contexts"], new_tokens=new_tokens,
      temperature=float(cfg.temperature), top_p=float(cfg.top_p), top_k=int(cfg.top_k),
      greedy=bool(cfg.greedy), keep_sampling_mask=cfg.keep_sampling_mask,
      max_kept_ids=int(cfg.max_kept_ids), keep_routing=cfg.keep_routing,
      vocab_limit=cfg.vocab_limit, pad_id=int(cfg.pad_id), row_sharding=row_sharding)
  return spec, b["padded"]


def lower_engine(graphdef, state, cfg: RolloutConfig, *, sequences: int, prompt_width: int,
                 new_tokens: int | None = None, mesh=None, stop_width: int = 8,
                 group_size: int = 1):
  """The engine `run_engine` compiles for `sequences` contexts of `prompt_width` tokens and
  `new_tokens` more (default cfg.max_new_tokens), in groups of `group_size` sharing a context,
  lowered from abstract values (`state`: a tree of ShapeDtypeStruct with shardings), nothing
  allocated: launch/aot.py compiles it for a TPU topology this host does not have."""
  spec, n_padded = _engine_spec(cfg, sequences, int(new_tokens or cfg.max_new_tokens), None,
                                mesh, group_size)

  def rows(*shape):
    return jax.ShapeDtypeStruct((n_padded, *shape), jnp.int32, sharding=spec.row_sharding)
  rng = jax.eval_shape(lambda: jax.random.key(0))
  return _compiled_engine(graphdef, spec).lower(
      state, rng, rows(prompt_width), rows(), rows(), rows(), rows(), rows(stop_width),
      jax.ShapeDtypeStruct((), jnp.int32))


def decode_weights(graphdef, state):
  """The weights in the engine's decode layout (`models.ops.sampler_layout`), for a caller that
  runs several engine calls on one set of weights (streaming rounds, tool-use waves, a
  benchmark's repeated calls): `run_engine` lays out what it is given on every call, and on
  weights already laid out that pass changes nothing, so the cost is paid once. On CPU it is a
  second copy of every projection kernel, held as long as the caller holds the result (~0.5 s
  for a Qwen2.5-0.5B shape). Where the platform has no decode layout, and for an FP8 sampler
  state (dequantised inside the engine, then laid out), the weights come back as they are."""
  leaves = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, fp8.QuantizedWeight))
  if any(isinstance(x, fp8.QuantizedWeight) for x in leaves):
    return graphdef, state
  lay_out, laid = _decode_layout(graphdef)
  if "graphdef" not in laid:
    jax.eval_shape(lay_out, state)  # traces once: learns the laid-out graphdef
  if laid["graphdef"] == graphdef:
    return graphdef, state
  return laid["graphdef"], lay_out(state)


@functools.lru_cache(maxsize=16)
def _decode_layout(graphdef):
  """A jitted state -> laid-out state for `graphdef` (one XLA program: ~2x faster than the
  same transposes run one by one), and a dict that receives the laid-out graphdef when traced."""
  laid = {}

  def lay_out(state):
    laid["graphdef"], out = ops.sampler_layout(graphdef, state)
    return out
  return jax.jit(lay_out), laid


def run_engine(graphdef, state, context_ids: np.ndarray, context_lens: np.ndarray, rng,
               cfg: RolloutConfig, *, uids: np.ndarray | None = None,
               generated_before: np.ndarray | None = None, max_new: np.ndarray | None = None,
               new_tokens: int | None = None, rows: int | None = None,
               stop_ids: Sequence[Sequence[int]] | None = None, mesh=None,
               group_size: int = 1) -> dict[str, Any]:
  """Generates continuations of N right-padded contexts [N, P]; the low-level entry point.

  Args:
    context_ids, context_lens: int32 [N, P] and [N]; each row is continued after its context.
    rng: PRNG key; sequence n draws with fold_in(rng, uids[n]) (default uids = 0..N-1).
    generated_before: [N] response tokens already inside the context (resumed partial
      generations): the RNG stream continues at that index.
    max_new: [N] tokens this call may add per row (default `new_tokens`).
    new_tokens: M, the output width past the context (default cfg.max_new_tokens).
    rows: pad the sequence count to at least this (a fixed bucket: one compiled shape).
    stop_ids: per-row extra stop ids, on top of cfg.stop_ids (a traced table, bucketed to a
      multiple of 8 ids: other stop sets do not recompile).
    mesh: shard slots and sequences over the mesh's batch axes (state placed by the caller).
    group_size: G > 1 when rows [g*G, (g+1)*G) share one context (a prompt's samples, with the
      same generated_before): each context is prefilled once and its KV rows and logits are
      copied to the group's slots (G times fewer prefill FLOPs; samples unchanged).

  Returns a dict of arrays, rows as given: tokens [N, P+M], response_mask, logp_old, new_count,
  stopped [N] (hit a stop id), routing / kept_ids when asked, the loop's decode_steps and
  prefill_calls, and the slot count used.
  """
  n = context_ids.shape[0]
  if n == 0:
    raise ValueError("run_engine needs at least one sequence")
  if np.any(np.asarray(context_lens) <= 0):
    raise ValueError("every context needs at least one token (a bos or chat-template prefix)")
  if max_new is not None and np.any(np.asarray(max_new) <= 0):
    raise ValueError("max_new must be >= 1 for every row (finished rows are not resubmitted)")
  new_tokens = int(new_tokens or cfg.max_new_tokens)
  spec, n_padded = _engine_spec(cfg, n, new_tokens, rows, mesh, group_size)
  if group_size > 1:
    key = np.concatenate([np.asarray(x).reshape(n, -1) for x in (
        context_ids, context_lens, np.zeros(n) if generated_before is None else generated_before)],
        axis=1).reshape(n // group_size, group_size, -1)
    differ = (key != key[:, :1]).any(axis=(1, 2))
    if differ.any():
      raise ValueError(f"group_size={group_size}: the rows of group(s) "
                       f"{np.flatnonzero(differ)[:5].tolist()} do not "
                       "share one context (ids, length and generated_before)")
  row_sharding, slots = spec.row_sharding, spec.slots

  def padded_rows(x, fill, dtype):
    x = np.asarray(x, dtype)
    padded = np.full((n_padded, *x.shape[1:]), fill, dtype)
    padded[:n] = x
    return padded if row_sharding is None else sharding_lib.put_global(padded, row_sharding)

  stop_sets = [list(cfg.stop_ids) + list(extra or ()) for extra in (stop_ids or [()] * n)]
  if len(stop_sets) != n:
    raise ValueError(f"stop_ids has {len(stop_sets)} rows for {n} sequences")
  stop_table = np.full((n, round_up(max(1, *map(len, stop_sets)), 8)), -1, np.int32)
  for row, ids in enumerate(stop_sets):
    stop_table[row, :len(ids)] = ids
  zeros = np.zeros((n,), np.int32)
  inputs = (
      padded_rows(context_ids, cfg.pad_id, np.int32),
      padded_rows(context_lens, 1, np.int32),
      padded_rows(np.arange(n) if uids is None else uids, 0, np.int32),
      padded_rows(zeros if generated_before is None else generated_before, 0, np.int32),
      padded_rows(np.full((n,), new_tokens) if max_new is None
                  else np.minimum(max_new, new_tokens), 1, np.int32),
      padded_rows(stop_table, -1, np.int32),
  )
  engine = _compiled_engine(graphdef, spec)
  out = engine(state, rng, *inputs, jnp.asarray(n, jnp.int32))
  out = {k: sharding_lib.to_host(v) for k, v in out.items()}  # several processes: gathered
  if n_padded != n:
    out = {k: v if v.ndim == 0 else v[:n] for k, v in out.items()}
  out["slots"] = slots
  return out
