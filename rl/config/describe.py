"""Reading a config back: its dotted leaves, and the model preset and RL recipe it is closest to
(what the dry run, the plan and a run's results name)."""

from __future__ import annotations

import dataclasses

import ml_collections

from models.config import PRESETS, get_config as get_model_config
from rl.core import algorithms


def leaves(c: ml_collections.ConfigDict | dict, prefix: str = "") -> dict:
  """{dotted field name: value} of every leaf of a config ("rl.clip_high", "mesh.shape.data")."""
  out = {}
  for key, value in c.items():
    if isinstance(value, (dict, ml_collections.ConfigDict)):
      out.update(leaves(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = value
  return out


def closest(values: dict, named: dict[str, dict]) -> str:
  """The name in `named` whose fields `values` matches on most, with the fields that differ:
  "dapo" or "dapo (clip_high=0.3, kl_coef=0.01)"."""
  def changes(name):
    return [f"{k}={v!r}" for k, v in values.items() if named[name].get(k) != v]
  name = min(named, key=lambda n: len(changes(n)))
  return name + (f" ({', '.join(changes(name))})" if changes(name) else "")


def describe_model(c: ml_collections.ConfigDict) -> str:
  """config.model as the closest preset and the fields that differ from it."""
  presets = {p: dataclasses.asdict(get_model_config(p)) for p in sorted(PRESETS)}
  return closest(c.model.to_dict(), presets)


def describe_rl(c: ml_collections.ConfigDict) -> str:
  """config.rl as the closest recipe (rl/core/algorithms.py) and the fields that differ from it."""
  return closest(c.rl.to_dict(),
                 {r: algorithms.recipe(r) for r in sorted(algorithms.RECIPES)})
