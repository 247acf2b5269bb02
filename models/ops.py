"""Host-specific compute behind one seam.

The model files call these ops and ask no platform questions. Each op dispatches once on
`kernels.platform()`: the platform the program is traced for, which is jax's backend, or the
target of an ahead-of-time compile (`kernels.target_platform`), the way `kernels/` dispatches
DSA. TPU and GPU run the portable XLA bodies written here. CPU runs the bodies in
`models/ops_cpu.py`, measured faster on XLA:CPU, with the figures beside each. The two compute
the same function and agree to rounding.

- `matmul_out_in`: a product with the weight stored output-major (tied LM head, decode).
- `swiglu`: the MLP's silu(gate(x)) * up(x).
- `grouped_attention`: GQA / MLA-MHA attention over head-major keys; one-row decode on CPU is a
  fused multiply-and-reduce.
- `expert_ffn`: the dropless local expert FFN (grouped ragged_dot; on CPU each expert on its own
  tokens in tiles, `ops_cpu.experts`).
- `expert_exchange`: how expert parallelism exchanges tokens (models/moe_ep.py).
- `write_slots`: a KV cache write (scatter; one 16-bit row on CPU, a select).
- `sampler_layout`: the rollout engine's weight layout, a pure (graphdef, state) step; on CPU,
  layers unstacked, product kernels stored output-major for `matmul_out_in`'s blocked decode,
  and routed experts' weights held per expert for `expert_ffn`.
- `decode_phases`: how many cache widths one engine call decodes through.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import kernels
from models import ops_cpu


def on_cpu() -> bool:
  """Whether the program being traced is for XLA:CPU."""
  return kernels.platform() == "cpu"


def matmul_out_in(x: jax.Array, w: jax.Array, dtype=None) -> jax.Array:
  """x [..., in] times w [out, in] (the weight stored output-major) -> [..., out], in `dtype`
  (default x's dtype; the LM head asks for fp32 logits, accumulated and not rounded to bf16)."""
  if on_cpu():
    return ops_cpu.matmul_out_in(x, w, dtype)
  return jnp.einsum("...i,oi->...o", x, w, preferred_element_type=dtype)


def swiglu(x: jax.Array, gate, up) -> jax.Array:
  """silu(gate(x)) * up(x) for the projections `gate` and `up` (models.layers.Dense: called as
  f(x) or f(x, dtype), with a `compute_dtype`), in their compute dtype."""
  if on_cpu():
    return ops_cpu.swiglu(x, gate, up)
  return jax.nn.silu(gate(x)) * up(x)


def masked_softmax(logits: jax.Array, mask: jax.Array) -> jax.Array:
  """Softmax in fp32 over the last axis; fully masked rows give zeros, not NaNs."""
  logits = jnp.where(mask, logits.astype(jnp.float32), -jnp.inf)
  peak = jnp.max(logits, axis=-1, keepdims=True)
  peak = jnp.where(jnp.isfinite(peak), peak, 0.0)
  weights = jnp.where(mask, jnp.exp(logits - peak), 0.0)
  return weights / jnp.maximum(jnp.sum(weights, axis=-1, keepdims=True), 1e-30)


def grouped_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                      scale: float) -> jax.Array:
  """q [B,T,H,D], head-major k [B,KVH,S,D] and v [B,KVH,S,Dv] (the KV cache's layout), mask
  [B,T,S] -> [B,T,H,Dv]."""
  batch, steps, heads, dim = q.shape
  if steps == 1 and on_cpu():
    return ops_cpu.decode_attention(q, k, v, mask, scale, masked_softmax)
  # Each KV head's query rows (its group's heads x steps) as one operand: one GEMM per (row, KV
  # head) instead of one per query head (XLA:CPU, Qwen2.5-0.5B shape, 128 x 64-token prompts,
  # bf16: 71 -> 45 ms per layer).
  kv_heads = k.shape[1]
  group = heads // kv_heads
  q = q.reshape(batch, steps, kv_heads, group, dim).transpose(0, 2, 3, 1, 4)
  q = q.reshape(batch, kv_heads, group * steps, dim)
  logits = jnp.einsum("bkqd,bksd->bkqs", q, k, preferred_element_type=jnp.float32) * scale
  logits = logits.reshape(batch, kv_heads, group, steps, -1)
  probs = masked_softmax(logits, mask[:, None, None]).astype(v.dtype)
  out = jnp.einsum("bkqs,bksv->bkqv", probs.reshape(batch, kv_heads, group * steps, -1), v)
  out = out.reshape(batch, kv_heads, group, steps, -1).transpose(0, 3, 1, 2, 4)
  return out.reshape(batch, steps, heads, v.shape[-1])


def ragged_experts(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, w_gate: jax.Array,
                   w_up: jax.Array, w_down: jax.Array) -> jax.Array:
  """Dropless grouped-matmul dispatch: x [N, D], ids/weights [N, k], w_* [E, D, F]/[E, F, D]."""
  n, k = expert_ids.shape
  n_experts = w_gate.shape[0]
  flat_ids = expert_ids.reshape(-1)
  order = jnp.argsort(flat_ids, stable=True)
  token_of = order // k
  group_sizes = jnp.bincount(flat_ids, length=n_experts).astype(jnp.int32)
  xs = x[token_of]
  hidden = (jax.nn.silu(jax.lax.ragged_dot(xs, w_gate, group_sizes))
            * jax.lax.ragged_dot(xs, w_up, group_sizes))
  out = jax.lax.ragged_dot(hidden, w_down, group_sizes)
  out = out * weights.reshape(-1)[order][:, None].astype(out.dtype)
  return jnp.zeros((n, x.shape[-1]), out.dtype).at[token_of].add(out)


def expert_ffn(x: jax.Array, expert_ids: jax.Array, weights: jax.Array, w_gate: jax.Array,
               w_up: jax.Array, w_down: jax.Array) -> jax.Array:
  """The dropless expert FFN on this device's tokens: `ragged_experts`, or on CPU
  `ops_cpu.experts` (XLA:CPU's ragged_dot has no grouped GEMM), which also takes the CPU
  sampler layout's per-expert weights."""
  body = ops_cpu.experts if on_cpu() else ragged_experts
  return body(x, expert_ids, weights, w_gate, w_up, w_down)


def expert_exchange() -> str:
  """"ragged" where the target platform has ragged_all_to_all (GPU, TPU), else "padded". The
  target platform, not the host's backend: a TPU program compiled ahead of time on a CPU host
  takes the path the TPU runs."""
  return "ragged" if kernels.platform() in ("gpu", "tpu", "cuda", "rocm") else "padded"


def write_slots(buffer: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
  """Writes new [B, T, ..., C] into buffer [B, ..., S, C] at slots start[b] + t (past S:
  dropped). `new` is token-major (as projections give it); the buffer's slot axis is -2."""
  batch, steps = new.shape[:2]
  new = new.astype(buffer.dtype)
  if steps == 1 and buffer.dtype.itemsize == 2 and on_cpu():
    return ops_cpu.write_one_slot(buffer, new, start)
  slots = start[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]
  rows = jnp.broadcast_to(jnp.arange(batch)[:, None], slots.shape)
  # Advanced indices split by slices put their [B, T] dims first: the indexed view is [B, T, ..., C].
  index = (rows,) + (slice(None),) * (buffer.ndim - 3) + (slots,)
  return buffer.at[index].set(new, mode="drop")


def sampler_layout(graphdef, state):
  """The rollout engine's weights: (graphdef, state) -> (graphdef, state), the inputs left as
  they were. Traced inside the engine's program, before its decode loop.

  On CPU the model's layer stacks become lists of layers (each decode step reads a layer's
  weights where they lie instead of slicing them out of the stack: d_model 512, 8 layers, 32
  rows x 256 tokens, 651 -> 798 tok/s), and every projection kernel that decode multiplies by
  is stored output-major, so each step takes `matmul_out_in`'s blocked product (XLA does not
  hoist a transpose out of the loop itself), and the routed experts' weights are held as one
  array per expert (`models.moe.MoE.store_per_expert`). That holds a second copy of those
  weights for the call. Elsewhere the weights are used as they are.
  """
  if not on_cpu():
    return graphdef, state
  model = nnx.merge(graphdef, state, copy=True)
  model.unstack_layers()
  for _, module in model.iter_modules():
    if getattr(module, "out_major", None) is False:  # a product's kernel, stored [in, *out]
      module.store_out_major()
    if getattr(module, "per_expert", None) is False:  # routed experts, stacked [E, ...]
      module.store_per_expert()
  return nnx.split(model)


def decode_phases(new_tokens: int) -> int:
  """How many cache widths one engine call decodes through (`rl.rollout.engine.cache_widths`):
  one except on CPU (`ops_cpu.decode_phases`). The gain is unmeasured on TPU / GPU and the
  compile cost of more is certain."""
  return ops_cpu.decode_phases(new_tokens) if on_cpu() else 1
