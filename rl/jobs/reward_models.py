"""The run's grading registry from config.reward: the reward models its graders read, loaded
once at start from their checkpoints, and the registry (rl/rewards/rm_graders.build_graders)
that the trainer's ResponseGrader and prompt selection score with.

A reward model's directory is either a workdir of ours (its config.json, a run config, names the
model and tokenizer; checkpoints/ holds {"params", "rest"} as SFT saves them) or a local Hugging
Face checkpoint (config.json + safetensors + tokenizer). A
checkpoint whose parameters do not fit the model its config describes, or a model with the
wrong head (a GenRM needs the LM head, a BT RM the scalar one), fails at start on one line
naming the field.

Given the run's mesh (the trainer passes its own when it has more than one device), a reward
model is restored straight into shards on it, each parameter by its logical axes (the RM's own
config.mesh.rules, or the default rules for an HF checkpoint), and its forwards run there as
the policy's do; without one it lives on the first device.
"""

from __future__ import annotations

import functools
import json
import os

import ml_collections

from rl.core.checks import InputError
from rl.rewards import manager, rm_graders
from rl.rewards.genrm import BradleyTerryRM, GenerativeRM


def is_job_workdir(directory: str) -> bool:
  """Whether `directory` is one of our jobs' workdirs (its config.json is a run config)."""
  with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
    return "model" in json.load(f)


@functools.cache
def load_model(directory: str, mesh=None):
  """(model, tokenizer) of a reward-model directory (see the module docstring), loaded once per
  process and mesh."""
  from models import hf
  from models.tokenizer import load_tokenizer
  from rl.jobs import evaluation
  if is_job_workdir(directory):
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
      config = ml_collections.ConfigDict(json.load(f))
    model, _ = evaluation.load_policy_checkpoint(config, directory, mesh=mesh)
    return model, load_tokenizer(config.tokenizer)
  return hf.load_pretrained(directory, dtype="float32", mesh=mesh), load_tokenizer(directory)


def load_rm(c: ml_collections.ConfigDict, name: str, mesh=None):
  """The GenerativeRM ("genrm") or BradleyTerryRM ("bt") of config.reward.<name>_dir, on
  `mesh` (None: the first device)."""
  field = f"config.reward.{name}_dir"
  directory = c.reward[f"{name}_dir"]
  try:
    model, tokenizer = load_model(directory, mesh)
    return (GenerativeRM if name == "genrm" else BradleyTerryRM)(model, tokenizer)
  except (ValueError, FileNotFoundError) as e:
    raise InputError(f"{field}={directory!r}: {' '.join(str(e).split())}") from None


def graders_from_config(c: ml_collections.ConfigDict, mesh=None
                        ) -> dict[str, manager.RecordGrader]:
  """The run's registry: the rule graders, with config.reward.graders' domains on the graders
  it names and the reward models they read (placed on `mesh`, see the module docstring)."""
  spec = rm_graders.parse_graders(c.reward.graders)
  models = {name: load_rm(c, name, mesh)
            for name in sorted(rm_graders.rms_needed(spec, c.reward.hybrid_rm))}
  return rm_graders.build_graders(spec, genrm=models.get("genrm"), bt=models.get("bt"),
                                  hybrid_rm=c.reward.hybrid_rm,
                                  hybrid_weight=c.reward.hybrid_weight)
