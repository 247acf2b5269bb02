"""config.model: the ModelConfig it names, the policy a run starts from, and (its section
check) that a local Hugging Face checkpoint in config.init_hf_dir has the same shapes."""

from __future__ import annotations

import os

import ml_collections
from flax import nnx

from models import hf
from models import sharding as sharding_lib
import kernels
from models.config import ModelConfig
from models.transformer import Transformer
from rl.core.checks import allowed

# Fields a checkpoint's config.json fixes; the rest (dtypes, context length, init, dispatch) a
# config may choose freely.
HF_FREE_FIELDS = ("dtype", "param_dtype", "init_std", "max_seq_len", "moe_dispatch",
                  "router_aux_loss_coef", "router_bias_rate", "head", "remat", "remat_names",
                  "scan_layers", "kernel_backend")


def model_config(c: ml_collections.ConfigDict) -> ModelConfig:
  """The ModelConfig named by config.model (its own checks name the field)."""
  fields = c.model.to_dict()
  if fields.pop("kernel_backend", "auto") != "auto":
    raise ValueError("config.model.kernel_backend is not read: set config.kernel_backend")
  fields["kernel_backend"] = c.get("kernel_backend", "auto")
  allowed("kernel_backend", fields["kernel_backend"], kernels.BACKENDS)
  try:
    return ModelConfig(**fields)
  except ValueError as e:
    raise ValueError(str(e).replace("ModelConfig.", "config.model.")) from None


def check_hf_dir(c: ml_collections.ConfigDict) -> None:
  """When config.init_hf_dir is present on this machine, its shapes must match config.model."""
  if not c.init_hf_dir or not os.path.exists(os.path.join(c.init_hf_dir, "config.json")):
    return

  def explicit(cfg: ModelConfig) -> dict:  # the 0 = "derived" defaults spelled out
    return cfg.replace(head_dim=cfg.gqa_head_dim, n_kv_heads=cfg.kv_heads).to_dict()
  theirs = explicit(hf.config_from_hf(hf.read_hf_config(c.init_hf_dir),
                                      source=os.path.join(c.init_hf_dir, "config.json")))
  ours = explicit(model_config(c))
  for field, value in ours.items():
    if field not in HF_FREE_FIELDS and theirs[field] != value:
      raise ValueError(f"config.model.{field}={value!r} but {c.init_hf_dir}/config.json "
                       f"(config.init_hf_dir) gives {theirs[field]!r}")


def build_policy(c: ml_collections.ConfigDict, mesh=None) -> Transformer:
  """The policy of a run: loaded from config.init_hf_dir (its shapes were checked against
  config.model by validate; with `mesh`, each tensor goes straight into its shards) or
  freshly initialised from config.model (built whole on the default device: big models
  start from a checkpoint)."""
  cfg = model_config(c)
  if c.init_hf_dir:
    return hf.load_pretrained(c.init_hf_dir, mesh=mesh,
                              rules=sharding_lib.make_rules(c.mesh.rules),
                              **{f: getattr(cfg, f) for f in HF_FREE_FIELDS})
  return Transformer(cfg, rngs=nnx.Rngs(params=c.seed))
