"""Model configuration: one frozen dataclass for every architecture, and named presets.

A `ModelConfig` describes a decoder-only LM: GQA or MLA attention (optionally with DeepSeek
Sparse Attention on top of MLA), dense SwiGLU or MoE feed-forward blocks, an LM head or a scalar
head (value / reward / process-reward model). Every field is checked at construction; a bad
value raises `ValueError` naming the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import kernels
from models import remat as remat_lib

ATTENTION_KINDS = ("gqa", "mla")
ROUTERS = ("softmax", "sigmoid_noaux")
DISPATCHES = ("ragged", "dense")
HEADS = ("lm", "scalar")
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes and switches of one decoder-only language model."""

  vocab_size: int  # token ids the embedding and the output layer cover
  d_model: int  # hidden width
  n_layers: int  # decoder layers
  n_heads: int  # attention (query) heads
  # Dense feed-forward width (also used by the first `first_k_dense` layers of a MoE model).
  mlp_dim: int
  # --- GQA attention (Llama / Qwen2 / Qwen3) ---
  attention: str = "gqa"
  n_kv_heads: int = 0  # 0 means n_heads (plain multi-head attention)
  head_dim: int = 0  # 0 means d_model // n_heads
  qkv_bias: bool = False  # Qwen2 / Qwen2.5
  qk_norm: bool = False  # Qwen3: RMSNorm on each query / key head
  # --- MLA attention (DeepSeek-V3) ---
  q_lora_rank: int = 0  # 0: queries are projected directly from the hidden state
  kv_lora_rank: int = 0
  qk_nope_head_dim: int = 0
  qk_rope_head_dim: int = 0
  v_head_dim: int = 0
  # --- DeepSeek Sparse Attention (DeepSeek-V3.2) on top of MLA ---
  dsa: bool = False
  index_n_heads: int = 0
  index_head_dim: int = 0
  index_topk: int = 0
  # --- Positions ---
  rope_theta: float = 10000.0
  rope_interleave: bool = False  # DeepSeek checkpoints store MLA rope dims pair-interleaved
  # YaRN (DeepSeek-V3): factor > 1 turns it on.
  yarn_factor: float = 1.0
  yarn_original_max_len: int = 4096
  yarn_beta_fast: float = 32.0
  yarn_beta_slow: float = 1.0
  yarn_mscale: float = 1.0
  yarn_mscale_all_dim: float = 0.0
  # Llama 3.x rope scaling (HF rope_type "llama3"): factor > 1 turns it on. Wavelengths above
  # original_max_len / low_freq_factor are divided by the factor, those below
  # original_max_len / high_freq_factor kept, and the band between blended smoothly.
  llama3_factor: float = 1.0
  llama3_low_freq_factor: float = 1.0
  llama3_high_freq_factor: float = 4.0
  llama3_original_max_len: int = 8192
  max_seq_len: int = 4096  # context length in tokens (prompt and response)
  # --- MoE ---
  n_experts: int = 0  # 0: dense model
  n_experts_per_tok: int = 0
  moe_mlp_dim: int = 0
  n_shared_experts: int = 0
  first_k_dense: int = 0  # the first k layers use a dense MLP of width mlp_dim
  router: str = "softmax"
  norm_topk_prob: bool = True
  routed_scaling_factor: float = 1.0
  n_group: int = 1  # group-limited routing (sigmoid_noaux): experts split into n_group groups
  topk_group: int = 1  # ... of which the best topk_group groups may be chosen
  moe_dispatch: str = "ragged"  # "dense" is the one-hot reference path
  # Expert parallelism's capacity per (source, destination) device pair, as a multiple of the
  # balanced load (models/moe_ep.py); assignments past it are dropped and counted. 0: dropless
  # (receive buffers sized for the worst case).
  moe_capacity_factor: float = 0.0
  # Load balancing during training (rl/core/train_step.py, rl/jobs/sft.py). The auxiliary loss
  # alpha * sum_e f_e P_e is computed per sequence and averaged (DeepSeek-V3's sequence-wise
  # balance loss; HF's name for alpha); the bias rate is DeepSeek-V3's gamma: after every
  # optimiser step (every RL step), bias_e += gamma * sign(mean load - load_e), for the
  # "sigmoid_noaux" router's selection only (never trained by gradients).
  router_aux_loss_coef: float = 0.0
  router_bias_rate: float = 0.0
  # --- Misc ---
  rms_norm_eps: float = 1e-6
  tie_embeddings: bool = False
  head: str = "lm"
  dtype: str = "float32"  # activation / compute dtype
  param_dtype: str = "float32"
  init_std: float = 0.02
  # --- Training memory (models/remat.py) ---
  # What each decoder layer keeps for the backward pass: a `remat.REMAT_POLICIES` entry.
  remat: str = "none"
  # Comma-separated activation tags kept by remat="names" / moved to host by "offload_names".
  remat_names: str = "attn_out,mlp_out"
  # Training and scoring run each stack of identical layers as one `jax.lax.scan` (compile time
  # and program size do not grow with depth). False unrolls the scan: the same layers, params
  # and remat, one copy of the layer per depth in the program (XLA's cost analysis then counts
  # every layer's FLOPs; a scan's body counts once).
  scan_layers: bool = True
  # DSA kernels every forward uses unless the call names others (kernels.BACKENDS; "auto": the
  # Mosaic kernels on a TPU, Triton on a GPU, the pure-jnp reference on CPU).
  kernel_backend: str = "auto"

  def __post_init__(self):
    _validate(self)

  # Derived sizes -------------------------------------------------------------------------
  @property
  def kv_heads(self) -> int:
    return self.n_kv_heads or self.n_heads

  @property
  def gqa_head_dim(self) -> int:
    return self.head_dim or self.d_model // self.n_heads

  @property
  def qk_head_dim(self) -> int:
    """MLA query/key head width (nope + rope)."""
    return self.qk_nope_head_dim + self.qk_rope_head_dim

  @property
  def is_moe(self) -> bool:
    return self.n_experts > 0

  def is_moe_layer(self, layer: int) -> bool:
    return self.is_moe and layer >= self.first_k_dense

  @property
  def n_moe_layers(self) -> int:
    return sum(self.is_moe_layer(i) for i in range(self.n_layers))

  @property
  def layer_stacks(self) -> tuple[tuple[int, int], ...]:
    """(first layer, layer count) of each run of identical layers, in order: the dense prefix
    of a MoE model and its MoE layers, or all layers. Each run is one stack of parameters and
    one scan in models/transformer.py."""
    k = self.first_k_dense if self.is_moe else 0
    return tuple((start, count) for start, count in ((0, k), (k, self.n_layers - k)) if count)

  @property
  def softmax_scale(self) -> float:
    """Attention logit scale; MLA with YaRN multiplies in mscale^2 (DeepSeek-V3)."""
    if self.attention == "gqa":
      return self.gqa_head_dim**-0.5
    scale = self.qk_head_dim**-0.5
    if self.yarn_factor > 1.0 and self.yarn_mscale_all_dim:
      m = yarn_get_mscale(self.yarn_factor, self.yarn_mscale_all_dim)
      scale *= m * m
    return scale

  def replace(self, **changes: Any) -> "ModelConfig":
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def yarn_get_mscale(scale: float, mscale: float) -> float:
  if scale <= 1.0:
    return 1.0
  return 0.1 * mscale * math.log(scale) + 1.0


def _fail(field: str, value: Any, why: str) -> None:
  raise ValueError(f"ModelConfig.{field}={value!r}: {why}")


def _validate(c: ModelConfig) -> None:
  for name in ("vocab_size", "d_model", "n_layers", "n_heads", "mlp_dim"):
    if getattr(c, name) <= 0:
      _fail(name, getattr(c, name), "must be a positive integer")
  if c.attention not in ATTENTION_KINDS:
    _fail("attention", c.attention, f"must be one of {ATTENTION_KINDS}")
  if c.head not in HEADS:
    _fail("head", c.head, f"must be one of {HEADS}")
  if c.kernel_backend not in kernels.BACKENDS:
    _fail("kernel_backend", c.kernel_backend, f"must be one of {kernels.BACKENDS}")
  for name in ("dtype", "param_dtype"):
    if getattr(c, name) not in DTYPES:
      _fail(name, getattr(c, name), f"must be one of {DTYPES}")
  if c.attention == "gqa":
    if c.n_kv_heads < 0 or c.n_heads % c.kv_heads:
      _fail("n_kv_heads", c.n_kv_heads, f"must divide n_heads={c.n_heads}")
    if not c.head_dim and c.d_model % c.n_heads:
      _fail("n_heads", c.n_heads, f"must divide d_model={c.d_model} (or set head_dim)")
    if c.gqa_head_dim % 2:
      _fail("head_dim", c.gqa_head_dim, "must be even (RoPE rotates pairs)")
    if c.dsa:
      _fail("dsa", c.dsa, "DeepSeek Sparse Attention needs attention='mla'")
  else:
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
      if getattr(c, name) <= 0:
        _fail(name, getattr(c, name), "must be positive for attention='mla'")
    if c.qk_rope_head_dim % 2:
      _fail("qk_rope_head_dim", c.qk_rope_head_dim, "must be even (RoPE rotates pairs)")
    if c.q_lora_rank < 0:
      _fail("q_lora_rank", c.q_lora_rank, "must be >= 0 (0 disables the query low-rank path)")
  if c.dsa:
    if c.q_lora_rank <= 0:
      _fail("q_lora_rank", c.q_lora_rank, "must be positive when dsa=True (the indexer "
            "reads the query latent)")
    for name in ("index_n_heads", "index_head_dim", "index_topk"):
      if getattr(c, name) <= 0:
        _fail(name, getattr(c, name), "must be positive when dsa=True")
    if c.index_head_dim < c.qk_rope_head_dim:
      _fail("index_head_dim", c.index_head_dim,
            f"must be >= qk_rope_head_dim={c.qk_rope_head_dim} (its first dims carry RoPE)")
  if c.n_experts < 0:
    _fail("n_experts", c.n_experts, "must be >= 0 (0 means a dense model)")
  if c.is_moe:
    if not 0 < c.n_experts_per_tok <= c.n_experts:
      _fail("n_experts_per_tok", c.n_experts_per_tok,
            f"must be in [1, n_experts={c.n_experts}]")
    if c.moe_mlp_dim <= 0:
      _fail("moe_mlp_dim", c.moe_mlp_dim, "must be positive for a MoE model")
    if c.router not in ROUTERS:
      _fail("router", c.router, f"must be one of {ROUTERS}")
    if c.moe_dispatch not in DISPATCHES:
      _fail("moe_dispatch", c.moe_dispatch, f"must be one of {DISPATCHES}")
    if c.moe_capacity_factor < 0:
      _fail("moe_capacity_factor", c.moe_capacity_factor,
            "must be >= 0 (0: dropless; 1.0: the balanced load per device pair)")
    if c.n_group <= 0 or c.n_experts % c.n_group:
      _fail("n_group", c.n_group, f"must divide n_experts={c.n_experts}")
    if c.n_group > 1 and c.n_experts // c.n_group < 2:
      _fail("n_group", c.n_group, "group-limited routing scores a group by its top-2 experts: "
            "each group needs at least 2")
    if not 0 < c.topk_group <= c.n_group:
      _fail("topk_group", c.topk_group, f"must be in [1, n_group={c.n_group}]")
    if c.n_group > 1 and c.topk_group * (c.n_experts // c.n_group) < c.n_experts_per_tok:
      _fail("topk_group", c.topk_group,
            "the chosen groups hold fewer experts than n_experts_per_tok")
    if not 0 <= c.first_k_dense <= c.n_layers:
      _fail("first_k_dense", c.first_k_dense, f"must be in [0, n_layers={c.n_layers}]")
    if c.n_shared_experts < 0:
      _fail("n_shared_experts", c.n_shared_experts, "must be >= 0")
  for name in ("router_aux_loss_coef", "router_bias_rate"):
    value = getattr(c, name)
    if not (value >= 0 and math.isfinite(value)):
      _fail(name, value, "must be a finite number >= 0")
  if c.router_bias_rate and c.is_moe and c.router != "sigmoid_noaux":
    _fail("router_bias_rate", c.router_bias_rate,
          f"the aux-loss-free bias belongs to the 'sigmoid_noaux' router, not {c.router!r}")
  if c.yarn_factor < 1.0:
    _fail("yarn_factor", c.yarn_factor, "must be >= 1 (1 disables YaRN)")
  if c.llama3_factor < 1.0:
    _fail("llama3_factor", c.llama3_factor, "must be >= 1 (1 disables llama3 rope scaling)")
  if c.llama3_factor > 1.0:
    if c.yarn_factor > 1.0:
      _fail("llama3_factor", c.llama3_factor, "and yarn_factor > 1: pick one rope scaling")
    if not 0 < c.llama3_low_freq_factor < c.llama3_high_freq_factor:
      _fail("llama3_low_freq_factor", c.llama3_low_freq_factor,
            f"must be in (0, llama3_high_freq_factor={c.llama3_high_freq_factor})")
    if c.llama3_original_max_len <= 0:
      _fail("llama3_original_max_len", c.llama3_original_max_len, "must be positive")
  why = remat_lib.check_policy(c.remat, c.remat_names)
  if why:
    _fail("remat", c.remat, why)
  if c.tie_embeddings and c.head != "lm":
    _fail("tie_embeddings", c.tie_embeddings, "only an LM head can tie to the embedding")


# Named presets ---------------------------------------------------------------------------

_DEEPSEEK_V3 = dict(
    vocab_size=129280, d_model=7168, n_layers=61, n_heads=128, mlp_dim=18432,
    attention="mla", q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
    qk_rope_head_dim=64, v_head_dim=128, rope_theta=10000.0, rope_interleave=True,
    yarn_factor=40.0, yarn_original_max_len=4096, yarn_beta_fast=32.0, yarn_beta_slow=1.0,
    yarn_mscale=1.0, yarn_mscale_all_dim=1.0, max_seq_len=163840,
    n_experts=256, n_experts_per_tok=8, moe_mlp_dim=2048, n_shared_experts=1,
    first_k_dense=3, router="sigmoid_noaux", norm_topk_prob=True, routed_scaling_factor=2.5,
    n_group=8, topk_group=4, rms_norm_eps=1e-6, dtype="bfloat16", param_dtype="bfloat16",
    router_aux_loss_coef=1e-4, router_bias_rate=1e-3,  # DeepSeek-V3's alpha and gamma
)

PRESETS: dict[str, dict[str, Any]] = {
    # Tiny models for tests, the demo and CPU development.
    "tiny_dense": dict(
        vocab_size=264, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, mlp_dim=128,
        qkv_bias=True, max_seq_len=256, rope_theta=10000.0),
    "tiny_qwen3_moe": dict(
        vocab_size=264, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
        mlp_dim=128, qk_norm=True, n_experts=8, n_experts_per_tok=2, moe_mlp_dim=32,
        router="softmax", norm_topk_prob=True, max_seq_len=256, router_aux_loss_coef=1e-3),
    "tiny_mla": dict(
        vocab_size=264, d_model=64, n_layers=2, n_heads=4, mlp_dim=128, attention="mla",
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, max_seq_len=256),
    "tiny_moe_mla_dsa": dict(
        vocab_size=264, d_model=64, n_layers=2, n_heads=4, mlp_dim=128, attention="mla",
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, dsa=True, index_n_heads=2, index_head_dim=16, index_topk=8,
        n_experts=8, n_experts_per_tok=2, moe_mlp_dim=32, n_shared_experts=1,
        first_k_dense=1, router="sigmoid_noaux", n_group=4, topk_group=2,
        routed_scaling_factor=2.5, max_seq_len=256, router_aux_loss_coef=1e-4,
        router_bias_rate=1e-3),
    # Real shapes (published config.json values).
    "qwen2.5-0.5b": dict(
        vocab_size=151936, d_model=896, n_layers=24, n_heads=14, n_kv_heads=2, mlp_dim=4864,
        qkv_bias=True, rope_theta=1e6, tie_embeddings=True, max_seq_len=32768,
        dtype="bfloat16", param_dtype="bfloat16"),
    "qwen2.5-1.5b": dict(
        vocab_size=151936, d_model=1536, n_layers=28, n_heads=12, n_kv_heads=2, mlp_dim=8960,
        qkv_bias=True, rope_theta=1e6, tie_embeddings=True, max_seq_len=32768,
        dtype="bfloat16", param_dtype="bfloat16"),
    "qwen2.5-7b": dict(
        vocab_size=152064, d_model=3584, n_layers=28, n_heads=28, n_kv_heads=4, mlp_dim=18944,
        qkv_bias=True, rope_theta=1e6, tie_embeddings=False, max_seq_len=32768,
        dtype="bfloat16", param_dtype="bfloat16"),
    "qwen3-30b-a3b": dict(
        vocab_size=151936, d_model=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
        mlp_dim=6144, qk_norm=True, n_experts=128, n_experts_per_tok=8, moe_mlp_dim=768,
        router="softmax", norm_topk_prob=True, rope_theta=1e6, max_seq_len=40960,
        router_aux_loss_coef=1e-3,
        dtype="bfloat16", param_dtype="bfloat16"),
    "deepseek-v3-671b": dict(_DEEPSEEK_V3),
    "deepseek-v3.2-671b": dict(
        _DEEPSEEK_V3, dsa=True, index_n_heads=64, index_head_dim=128, index_topk=2048),
}

# Published parameter totals (billions) the presets are checked against.
PUBLISHED_PARAMS = {
    "qwen2.5-0.5b": dict(total=0.49),
    "qwen2.5-1.5b": dict(total=1.54),
    "qwen2.5-7b": dict(total=7.61),
    "qwen3-30b-a3b": dict(total=30.5, active=3.3),
    "deepseek-v3-671b": dict(total=671.0, active=37.0),
    "deepseek-v3.2-671b": dict(total=671.0, active=37.0),
}


def get_config(name: str, **overrides: Any) -> ModelConfig:
  """Returns the named preset with `overrides` applied (e.g. head="scalar")."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}")
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(overrides) - fields)
  if unknown:
    raise ValueError(f"unknown ModelConfig field(s) {unknown} for preset {name!r}")
  return ModelConfig(**{**PRESETS[name], **overrides})
