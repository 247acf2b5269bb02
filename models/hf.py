"""Hugging Face checkpoints: import and export of safetensors + config.json.

`load_pretrained(path, dtype=..., mesh=None, rules=None)` maps a local HF directory (qwen2,
qwen3, qwen3_moe, llama, deepseek_v3, deepseek_v32) to our ModelConfig and fills the model
tensor by tensor: each parameter is read from its safetensors shard, converted and placed with
its target sharding before the next is read, so host memory stays near one parameter (an MoE
layer's experts: one stacked expert tensor). `save_pretrained(model, path)` writes the same
format back, which transformers (and so vLLM / SGLang) load, just as frugally: tensor by
tensor into files laid out from the shapes alone, each sharded parameter gathered on its own.
Llama 3.x rope scaling (`rope_type="llama3"`) and YaRN map to ModelConfig fields both ways. A
reward model in transformers' form (`*ForSequenceClassification` with one label, its
`score.weight` the per-position reward) maps to our scalar head, and a scalar-head model
exports as one.

A broken directory fails with a CheckpointError naming the culprit: a config.json field that is
missing, a shard that is missing or not a readable safetensors file (e.g. truncated), a tensor
that is missing, of the wrong shape or holds NaN/inf. Tensors the model does not use (e.g.
`lm_head.weight` under tie_word_embeddings, layers beyond num_hidden_layers) are listed in a
warning.

HF Linear weights are [out, in]; ours are [in, *out] with heads as their own axis, so every
mapping below is a transpose plus a reshape.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import types
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec
from safetensors import safe_open

from models import sharding as sharding_lib
from models.attention import ATTENTION
from models.config import ModelConfig
from models.transformer import Transformer

# The files of an HF tokenizer that an export copies beside the weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "chat_template.jinja")


class CheckpointError(ValueError):
  """A checkpoint directory that cannot be loaded (names the file, tensor or field)."""


# ---------------------------------------------------------------------------------- Config

def _rope(hf: dict) -> dict:
  params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  out = {"rope_theta": float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))}
  kind = params.get("rope_type", params.get("type", "default"))
  if kind == "yarn":
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    both = bool(mscale and all_dim)
    out.update(yarn_factor=float(params["factor"]),
               yarn_original_max_len=int(params["original_max_position_embeddings"]),
               yarn_beta_fast=float(params.get("beta_fast") or 32),
               yarn_beta_slow=float(params.get("beta_slow") or 1),
               yarn_mscale=float(mscale) if both else 1.0,
               yarn_mscale_all_dim=float(all_dim) if both else 0.0)
  elif kind == "llama3":
    out.update(llama3_factor=float(params["factor"]),
               llama3_low_freq_factor=float(params["low_freq_factor"]),
               llama3_high_freq_factor=float(params["high_freq_factor"]),
               llama3_original_max_len=int(params["original_max_position_embeddings"]))
  elif kind != "default":
    raise CheckpointError(f"rope type {kind!r} is not supported (default, yarn or llama3)")
  return out


def config_from_hf(hf: dict, *, dtype: str = "bfloat16",
                   source: str = "config.json") -> ModelConfig:
  """Our ModelConfig for an HF config.json dict (read from `source`, named in errors)."""
  try:
    return _config_from_hf(hf, dtype)
  except KeyError as e:
    raise CheckpointError(f"{source}: field {e.args[0]!r} is missing (model_type "
                          f"{hf.get('model_type')!r} needs it)") from None


def _qwen3_moe_from_hf(hf: dict) -> dict:
  if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
    raise CheckpointError("qwen3_moe with mlp_only_layers / decoder_sparse_step != 1 is "
                          "not supported")
  return dict(n_experts=hf.get("num_experts") or hf["num_local_experts"],
              n_experts_per_tok=hf["num_experts_per_tok"],
              moe_mlp_dim=hf["moe_intermediate_size"],
              norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


def _qwen3_moe_to_hf(cfg: ModelConfig) -> dict:
  return dict(num_experts=cfg.n_experts, num_experts_per_tok=cfg.n_experts_per_tok,
              moe_intermediate_size=cfg.moe_mlp_dim, norm_topk_prob=cfg.norm_topk_prob,
              decoder_sparse_step=1, mlp_only_layers=[])


def _dsa_from_hf(hf: dict) -> dict:
  # HF's DeepSeek-V3.2 always lays the MLA rope dims out pair-interleaved.
  return dict(index_n_heads=hf["index_n_heads"], index_head_dim=hf["index_head_dim"],
              index_topk=hf["index_topk"], rope_interleave=True)


def _dsa_to_hf(cfg: ModelConfig) -> dict:
  # A half-split model's rope columns are interleaved on export (param_mapping).
  return dict(rope_interleave=True, index_n_heads=cfg.index_n_heads,
              index_head_dim=cfg.index_head_dim,
              index_topk=cfg.index_topk,
              mlp_layer_types=["dense" if i < cfg.first_k_dense else "sparse"
                               for i in range(cfg.n_layers)])


def _none(_) -> dict:
  return {}


@dataclasses.dataclass(frozen=True)
class Family:
  """One HF `model_type`. `switches` are the ModelConfig fields that identify it: an import sets
  them, and a model exports as the one family whose switches it matches (`moe`: whether it has
  experts). `read` / `write` carry the family's config.json fields beyond those of its attention
  kind (models.attention.ATTENTION) and the fields every family shares."""
  architecture: str
  switches: dict[str, Any]
  read: Callable[[dict], dict] = _none
  write: Callable[[ModelConfig], dict] = _none


_DENSE_GQA = dict(attention="gqa", moe=False, dsa=False)
_DEEPSEEK = dict(attention="mla", moe=True, router="sigmoid_noaux", qk_norm=False,
                 qkv_bias=False)
FAMILIES = {
    "llama": Family("LlamaForCausalLM", dict(_DENSE_GQA, qk_norm=False, qkv_bias=False)),
    "qwen2": Family("Qwen2ForCausalLM", dict(_DENSE_GQA, qk_norm=False, qkv_bias=True)),
    "qwen3": Family("Qwen3ForCausalLM", dict(_DENSE_GQA, qk_norm=True, qkv_bias=False)),
    "qwen3_moe": Family("Qwen3MoeForCausalLM",
                        dict(attention="gqa", moe=True, dsa=False, qk_norm=True, qkv_bias=False,
                             router="softmax", first_k_dense=0),
                        _qwen3_moe_from_hf, _qwen3_moe_to_hf),
    "deepseek_v3": Family("DeepseekV3ForCausalLM", dict(_DEEPSEEK, dsa=False)),
    "deepseek_v32": Family("DeepseekV32ForCausalLM", dict(_DEEPSEEK, dsa=True), _dsa_from_hf,
                           _dsa_to_hf),
}


SEQUENCE_CLASSIFICATION = "ForSequenceClassification"  # transformers' reward-model class suffix


def _switch(cfg: ModelConfig, name: str):
  return cfg.is_moe if name == "moe" else getattr(cfg, name)


def _config_from_hf(hf: dict, dtype: str) -> ModelConfig:
  family = FAMILIES.get(hf.get("model_type"))
  if family is None:
    raise CheckpointError(f"model_type {hf.get('model_type')!r} is not supported; supported: "
                          f"{', '.join(FAMILIES)}")
  if hf.get("hidden_act", "silu") != "silu":
    raise CheckpointError(f"hidden_act {hf['hidden_act']!r} is not supported (silu)")
  # qwen2's q/k/v biases are implied by its model_type; an attention_bias elsewhere is an
  # o_proj bias, which no model here has.
  if hf.get("attention_bias") and not family.switches["qkv_bias"]:
    raise CheckpointError("attention_bias=True (an o_proj bias) is not supported")
  fields = dict(vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
                n_layers=hf["num_hidden_layers"], n_heads=hf["num_attention_heads"],
                mlp_dim=hf["intermediate_size"], rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                max_seq_len=hf.get("max_position_embeddings", 4096), dtype=dtype,
                param_dtype=dtype, **_rope(hf))
  try:  # the attention kinds' readers raise ValueError (models/attention.py knows no files)
    fields.update(ATTENTION[family.switches["attention"]].hf_read(hf))
  except ValueError as e:
    raise CheckpointError(str(e)) from None
  fields.update(family.read(hf))
  fields.update({k: v for k, v in family.switches.items() if k != "moe"})
  if any(a.endswith(SEQUENCE_CLASSIFICATION) for a in hf.get("architectures") or ()):
    # A reward model: one score per position from `score.weight` (our scalar head), no LM head
    # to tie. HF writes one id2label entry per label.
    labels = len(hf.get("id2label") or {}) or hf.get("num_labels", 2)
    if labels != 1:
      raise CheckpointError(f"{hf['architectures'][0]} with {labels} labels: a reward model "
                            "(our scalar head) has one")
    fields.update(head="scalar", tie_embeddings=False)
  return ModelConfig(**fields)


def family_of(cfg: ModelConfig) -> str:
  """The HF model_type `cfg` exports as: the family whose switches it matches (CheckpointError
  naming what each family needs where none does)."""
  needs = {}
  for name, family in FAMILIES.items():
    differ = {k: v for k, v in family.switches.items() if _switch(cfg, k) != v}
    if not differ:
      return name
    needs[name] = differ
  closest = sorted(needs, key=lambda n: len(needs[n]))[:2]
  raise CheckpointError(
      "no HF family matches this model (attention, moe, dsa, qk_norm, qkv_bias, router, "
      "first_k_dense); the closest: "
      + "; ".join(f"{n} needs {', '.join(f'{k}={v}' for k, v in needs[n].items())}"
                  for n in closest))


def config_to_hf(cfg: ModelConfig) -> dict:
  """The config.json of `cfg` under its family (family_of)."""
  name = family_of(cfg)
  family = FAMILIES[name]
  rope: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
  if cfg.yarn_factor > 1:
    rope.update(rope_type="yarn", factor=cfg.yarn_factor,
                original_max_position_embeddings=cfg.yarn_original_max_len,
                beta_fast=cfg.yarn_beta_fast, beta_slow=cfg.yarn_beta_slow)
    if cfg.yarn_mscale_all_dim:
      rope.update(mscale=cfg.yarn_mscale, mscale_all_dim=cfg.yarn_mscale_all_dim)
  if cfg.llama3_factor > 1:
    rope.update(rope_type="llama3", factor=cfg.llama3_factor,
                low_freq_factor=cfg.llama3_low_freq_factor,
                high_freq_factor=cfg.llama3_high_freq_factor,
                original_max_position_embeddings=cfg.llama3_original_max_len)
  scalar = cfg.head == "scalar"  # a reward model, as transformers' sequence classifier
  architecture = family.architecture
  if scalar:
    architecture = architecture.replace("ForCausalLM", SEQUENCE_CLASSIFICATION)
  out = dict(
      model_type=name, architectures=[architecture], vocab_size=cfg.vocab_size,
      hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
      num_attention_heads=cfg.n_heads, intermediate_size=cfg.mlp_dim,
      rms_norm_eps=cfg.rms_norm_eps, tie_word_embeddings=cfg.tie_embeddings,
      max_position_embeddings=cfg.max_seq_len, hidden_act="silu", rope_parameters=rope,
      torch_dtype=cfg.param_dtype, attention_bias=False)
  if scalar:
    out.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
  out.update(ATTENTION[cfg.attention].hf_write(cfg))
  out.update(family.write(cfg))
  return out


# ---------------------------------------------------------------------------------- Mapping

def _t(x):  # HF Linear [out, in] -> ours [in, out]
  return np.ascontiguousarray(x.T)


def _rope_layout(x: np.ndarray, rope: int, *, interleave: bool) -> np.ndarray:
  """x with its last `rope` columns moved from the half-split order (i paired with i + rope/2)
  to the pair-interleaved one (2i with 2i + 1), or back."""
  head, tail = x[..., :-rope], x[..., -rope:]
  pairs = (2, rope // 2) if interleave else (rope // 2, 2)
  tail = tail.reshape(*tail.shape[:-1], *pairs).swapaxes(-1, -2).reshape(tail.shape)
  return np.concatenate([head, tail], axis=-1)


def param_mapping(cfg: ModelConfig) -> dict[tuple, tuple[list[str], Callable, Callable]]:
  """Our parameter path -> (HF tensor names, to_ours(*hf) -> array, to_hf(ours) -> list).

  to_hf only reshapes and transposes (numpy views, no copies), so it also gives the HF shapes
  of a parameter from a zero-strided stand-in without allocating it (`_hf_shapes`)."""
  m: dict[tuple, tuple[list[str], Callable, Callable]] = {}

  def linear(path, name, out_shape=None):
    def to_ours(w):
      w = _t(w)
      return w.reshape(w.shape[0], *out_shape) if out_shape else w
    def to_hf(k):
      return [k.reshape(k.shape[0], -1).T]
    m[path] = ([name], to_ours, to_hf)

  def out_proj(path, name, heads, head_dim):
    m[path] = ([name], lambda w: _t(w).reshape(heads, head_dim, -1),
               lambda k: [k.reshape(heads * head_dim, -1).T])

  def copy(path, name, shape=None):
    m[path] = ([name], (lambda w: w.reshape(shape)) if shape else (lambda w: w),
               lambda x: [x.reshape(-1) if shape else x])

  def rope_columns(path):
    """HF's DeepSeek-V3.2 reads the MLA rope dims (the last qk_rope_head_dim output columns of
    q and of kv_a) pair-interleaved; a half-split model of ours exports them interleaved, which
    is exact (q and k move alike)."""
    if not (cfg.dsa and not cfg.rope_interleave):
      return
    names, to_ours, to_hf = m[path]
    r = cfg.qk_rope_head_dim
    m[path] = (names, lambda w: _rope_layout(to_ours(w), r, interleave=False),
               lambda k: to_hf(_rope_layout(k, r, interleave=True)))

  to = types.SimpleNamespace(linear=linear, copy=copy, out_proj=out_proj,
                             rope_columns=rope_columns)

  def mlp(prefix, hf_prefix):
    for ours, theirs in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
      linear(prefix + (ours, "kernel"), f"{hf_prefix}.{theirs}.weight")

  copy(("embed", "embedding"), "model.embed_tokens.weight")
  copy(("final_norm", "scale"), "model.norm.weight")
  if cfg.head == "scalar":
    linear(("head", "kernel"), "score.weight")
  elif not cfg.tie_embeddings:
    linear(("head", "kernel"), "lm_head.weight")
  for i in range(cfg.n_layers):
    L, hp = ("layers", i), f"model.layers.{i}"
    copy(L + ("attn_norm", "scale"), f"{hp}.input_layernorm.weight")
    copy(L + ("mlp_norm", "scale"), f"{hp}.post_attention_layernorm.weight")
    ATTENTION[cfg.attention].hf_params(cfg, to, L + ("attn",), f"{hp}.self_attn")
    M, hm = L + ("mlp",), f"{hp}.mlp"
    if not cfg.is_moe_layer(i):
      mlp(M, hm)
      continue
    linear(M + ("router", "kernel"), f"{hm}.gate.weight")
    if cfg.router == "sigmoid_noaux":
      copy(M + ("router", "bias"), f"{hm}.gate.e_score_correction_bias")
    experts = range(cfg.n_experts)
    for ours, theirs in (("w_gate", "gate_proj"), ("w_up", "up_proj"), ("w_down", "down_proj")):
      names = [f"{hm}.experts.{e}.{theirs}.weight" for e in experts]
      m[M + (ours,)] = (names, lambda *ws: np.stack([_t(w) for w in ws]),
                        lambda k: [x.T for x in k])
    if cfg.n_shared_experts:
      mlp(M + ("shared",), f"{hm}.shared_experts")
  return _stack_layer_entries(cfg, m)


def _stack_layer_entries(cfg: ModelConfig, m: dict) -> dict:
  """Folds the per-layer entries ("layers", i, ...) into the model's stacked parameters
  ("stacks", g, ...) of cfg.layer_stacks: the HF tensors of each of the stack's layers in
  order; to_ours stacks their per-layer values; to_hf takes the stacked value (or the value
  of one layer, `layer=j`) to the layers' HF tensors."""
  out = {key: entry for key, entry in m.items() if key[0] != "layers"}
  for g, (first, count) in enumerate(cfg.layer_stacks):
    for key in [k for k in m if k[:2] == ("layers", first)]:
      entries = [m[("layers", first + j) + key[2:]] for j in range(count)]
      out[("stacks", g) + key[2:]] = _StackedEntry(entries)
  return out


class _StackedEntry(tuple):
  """(names, to_ours, to_hf) of a stacked parameter, also indexable per layer (`.layers`)."""

  def __new__(cls, entries):
    names = [name for names, _, _ in entries for name in names]

    def to_ours(*tensors):
      values, i = [], 0
      for names, one, _ in entries:
        values.append(one(*tensors[i:i + len(names)]))
        i += len(names)
      return np.stack(values)

    def to_hf(stacked):
      return [t for (_, _, one), value in zip(entries, stacked) for t in one(value)]
    self = super().__new__(cls, (names, to_ours, to_hf))
    self.layers = entries
    return self


# ---------------------------------------------------------------------------------- Load

class _Reader:
  """Finds each tensor's shard through model.safetensors.index.json (or by scanning)."""

  def __init__(self, path: str):
    self.path = path
    index = os.path.join(path, "model.safetensors.index.json")
    self.where: dict[str, str] = {}
    if os.path.exists(index):
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
      for name, shard in weight_map.items():
        full = os.path.join(path, shard)
        if not os.path.exists(full):
          raise CheckpointError(f"{index} lists shard {shard!r} (for tensor {name!r}), which "
                                f"is missing from {path}")
        self.where[name] = full
    else:
      shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
      if not shards:
        raise CheckpointError(f"no *.safetensors files in {path}")
      for shard in shards:
        with _open_shard(os.path.join(path, shard)) as f:
          for name in f.keys():
            self.where[name] = os.path.join(path, shard)

  def get(self, name: str) -> np.ndarray:
    if name not in self.where:
      raise CheckpointError(f"tensor {name!r} is missing from the checkpoint at {self.path}")
    with _open_shard(self.where[name]) as f:
      try:
        tensor = np.asarray(f.get_tensor(name))
      except Exception as e:  # noqa: BLE001  (safetensors' own error names no file)
        raise CheckpointError(f"{self.where[name]}: tensor {name!r} cannot be read ({e})") from None
    if not np.isfinite(tensor).all():
      raise CheckpointError(f"{self.where[name]}: tensor {name!r} holds NaN or inf values")
    return tensor


def _open_shard(file: str):
  """safe_open of one shard; a file that is not a complete safetensors file (e.g. truncated)
  is a CheckpointError naming it. The "flax" framework reads bf16 natively (no torch needed);
  numpy keeps it via ml_dtypes."""
  try:
    return safe_open(file, "flax")
  except Exception as e:  # noqa: BLE001  (safetensors' own error names no file)
    raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def read_hf_config(path: str) -> dict:
  config_path = os.path.join(path, "config.json")
  if not os.path.exists(config_path):
    raise CheckpointError(f"{config_path} does not exist")
  with open(config_path) as f:
    return json.load(f)


def load_pretrained(path: str, dtype: str = "bfloat16", mesh=None, rules=None,
                    **config_overrides) -> Transformer:
  """Builds our model from a local HF checkpoint directory (see module docstring)."""
  cfg = config_from_hf(read_hf_config(path), dtype=dtype,
                       source=os.path.join(path, "config.json"))
  if config_overrides:
    cfg = cfg.replace(**config_overrides)
  reader = _Reader(path)
  abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(params=0)))
  graphdef, state = nnx.split(abstract)
  shardings = None
  if mesh is not None:
    shardings = dict(sharding_lib.state_shardings(
        state, mesh, rules or sharding_lib.DEFAULT_RULES).flat_state())
  mapping = param_mapping(cfg)
  used: set[str] = set()
  for path_key, var in state.flat_state():
    key = tuple(path_key)
    if key not in mapping:
      raise CheckpointError(f"no HF tensor maps to parameter {'/'.join(map(str, key))}")
    names = mapping[key][0]
    used.update(names)
    expected, dtype = tuple(var.get_value().shape), var.get_value().dtype
    stacked = isinstance(mapping[key], _StackedEntry)  # read one layer at a time
    parts, per_layer = (mapping[key].layers, expected[1:]) if stacked else ([mapping[key]],
                                                                              expected)
    layer_sharding = put = None
    if shardings is not None:
      layer_sharding = shardings[path_key]
      if stacked:
        put = _LayerWriter(expected, dtype, layer_sharding)
        layer_sharding = NamedSharding(layer_sharding.mesh,
                                       PartitionSpec(*layer_sharding.spec[1:]))
    values = []
    for j, (part_names, to_ours, _) in enumerate(parts):
      value = to_ours(*[reader.get(n) for n in part_names])
      if tuple(value.shape) != per_layer:
        raise CheckpointError(
            f"shape mismatch for {part_names[0] + (' ...' if len(part_names) > 1 else '')} "
            f"in {path}: checkpoint gives {tuple(value.shape)} after mapping, config.json "
            f"implies {per_layer}")
      value = np.asarray(value).astype(dtype)
      if put is not None:  # straight into its shards (each process places its own slices)
        put(j, sharding_lib.put_global(value, layer_sharding))
      else:
        values.append(value)
    if put is not None:
      array = put.array
    elif layer_sharding is not None:
      array = sharding_lib.put_global(values[0], layer_sharding)
    else:
      array = jnp.asarray(np.stack(values) if stacked else values[0])
    var.set_value(array)
  unused = sorted(set(reader.where) - used)
  if unused:
    logging.warning("%s: %d tensor(s) in the checkpoint are not used by the model its "
                    "config.json describes (dropped): %s", path, len(unused),
                    ", ".join(unused[:20]) + (" ..." if len(unused) > 20 else ""))
  return nnx.merge(graphdef, state)


class _LayerWriter:
  """A stacked array of `sharding` filled one layer at a time (`writer(j, layer)`) in a donated
  buffer: the devices hold the stack plus one layer, the host one layer."""

  def __init__(self, shape: tuple[int, ...], dtype, sharding):
    self.array = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()
    self._put = jax.jit(lambda a, x, j: jax.lax.dynamic_update_index_in_dim(a, x, j, 0),
                        donate_argnums=0, out_shardings=sharding)

  def __call__(self, j: int, layer: jax.Array) -> None:
    self.array = self._put(self.array, layer, j)


# ---------------------------------------------------------------------------------- Save

SAFETENSORS_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}


def _hf_shapes(to_hf: Callable, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
  """The shapes of the HF tensors of one parameter of `shape`, without its values."""
  return [tuple(t.shape) for t in to_hf(np.broadcast_to(np.float32(0), shape))]


def _plan_shards(tensors: list[tuple[str, tuple[int, ...]]], itemsize: int,
                 max_shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
  """Consecutive runs of (name, shape), each run at most max_shard_bytes (or one tensor)."""
  shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
  size = 0
  for name, shape in tensors:
    nbytes = int(np.prod(shape)) * itemsize
    if size + nbytes > max_shard_bytes and shards[-1]:
      shards.append([])
      size = 0
    shards[-1].append((name, shape))
    size += nbytes
  return shards


def _safetensors_header(shard: list[tuple[str, tuple[int, ...]]], dtype: str,
                        itemsize: int) -> bytes:
  """The 8-byte length and JSON header of a safetensors file holding `shard` in order."""
  header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
  offset = 0
  for name, shape in shard:
    end = offset + int(np.prod(shape)) * itemsize
    header[name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape),
                    "data_offsets": [offset, end]}
    offset = end
  text = json.dumps(header, separators=(",", ":")).encode()
  text += b" " * (-(len(text) + 8) % 8)  # the data starts 8-byte aligned
  return len(text).to_bytes(8, "little") + text


def save_pretrained(model: Transformer, path: str, *, dtype: str | None = None,
                    tokenizer_dir: str | None = None, max_shard_bytes: int = 4 << 30) -> None:
  """Writes config.json + (sharded, indexed) model safetensors that transformers loads.

  Tensor by tensor: the layout of every file (names, shapes, offsets) is planned from the
  parameters' shapes alone; then each parameter is brought to the host, converted to `dtype`
  (default: the model's param_dtype) and appended to its file before the next is read. Host
  memory holds one parameter of one layer at a time (the largest: the embedding or one MoE
  layer's experts), never the whole model. A parameter sharded over several processes is gathered from
  their shards (every process takes part in each gather; process 0 writes the files), so a
  model that fits no single host's memory still exports as long as its largest parameter does.
  """
  from models.sharding import to_host
  cfg = model.cfg
  hf_cfg = config_to_hf(cfg)
  out_dtype = str(jnp.dtype(dtype or cfg.param_dtype))
  if out_dtype not in SAFETENSORS_DTYPES:
    raise ValueError(f"export dtype {out_dtype!r}: one of {sorted(SAFETENSORS_DTYPES)}")
  hf_cfg["torch_dtype"] = out_dtype
  itemsize = jnp.dtype(out_dtype).itemsize
  mapping = param_mapping(cfg)
  # (read the value, its HF names, to_hf, its shape): a stacked parameter one layer at a time.
  parts = []
  for key, var in nnx.state(model).flat_state():
    entry, shape = mapping[tuple(key)], tuple(var.get_value().shape)
    if isinstance(entry, _StackedEntry):
      parts += [(lambda var=var, j=j: var.get_value()[j], names, to_hf, shape[1:])
                for j, (names, _, to_hf) in enumerate(entry.layers)]
    else:
      parts.append((var.get_value, entry[0], entry[2], shape))
  tensors = [(name, shape) for _, names, to_hf, part_shape in parts
             for name, shape in zip(names, _hf_shapes(to_hf, part_shape))]
  shards = _plan_shards(tensors, itemsize, max_shard_bytes)
  files = (["model.safetensors"] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  writer = jax.process_index() == 0
  if writer:
    os.makedirs(path, exist_ok=True)
  ends = np.cumsum([len(s) for s in shards])  # tensors[:ends[i]] are in files[:i + 1]
  shard_index, written, out = -1, 0, None
  try:
    for read, _, to_hf, _ in parts:
      value = np.asarray(jax.device_get(to_host(read())))
      for tensor in to_hf(value):
        if not writer:
          continue
        if written == (ends[shard_index] if shard_index >= 0 else 0):
          if out is not None:
            out.close()
          shard_index += 1
          out = open(os.path.join(path, files[shard_index]), "wb")
          out.write(_safetensors_header(shards[shard_index], out_dtype, itemsize))
        np.ascontiguousarray(tensor.astype(out_dtype)).tofile(out)
        written += 1
      del value
  finally:
    if out is not None:
      out.close()
  if not writer:
    return
  if len(shards) > 1:
    weight_map = {name: files[i] for i, shard in enumerate(shards) for name, _ in shard}
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_cfg, f, indent=1)
  if tokenizer_dir:
    for name in TOKENIZER_FILES:
      if os.path.exists(os.path.join(tokenizer_dir, name)):
        shutil.copy(os.path.join(tokenizer_dir, name), os.path.join(path, name))
