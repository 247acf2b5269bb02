"""config.reward's registry at run start: reward models load from a reward-model job's workdir;
a checkpoint of another shape, an RM with the wrong head and records of a domain without a grader
each fail on one line naming the field; the registry then grades as rm_graders builds it."""

import json

import ml_collections
import numpy as np
import pytest
from flax import nnx

from rl.config.defaults import base_config
from rl.core.checks import InputError
from rl.core.policy import build_policy
from rl.data.entries import load_entries
from rl.jobs import reward_models
from rl.jobs.checkpoint import Checkpointer, save_run_config
from rl.rewards import manager


def rm_workdir(path, *, head="lm", seed=0, saved_overrides=None):
  """A reward-model job's workdir: config.json of the base model with `head`, and a checkpoint
  of that model (or, with `saved_overrides`, of a model with other fields)."""
  c = base_config()
  c.seed = seed
  c.model.head = head
  saved = ml_collections.ConfigDict(c.to_dict())
  for field, value in (saved_overrides or {}).items():
    saved.model[field] = value
  _, params, rest = nnx.split(build_policy(saved), nnx.Param, ...)
  ckpt = Checkpointer(path / "checkpoints")
  ckpt.save(0, {"params": params, "rest": rest}, {"step": 0}, force=True)
  ckpt.close()
  save_run_config(path, c, step=None)
  return str(path)


def run_config(**reward):
  c = base_config()
  for field, value in reward.items():
    c.reward[field] = value
  return c


def test_registry_loads_the_genrm_of_a_job_workdir(tmp_path):
  """general=genrm with a job workdir: general records are scored in [0, 1], math stays rule."""
  c = run_config(graders="general=genrm", genrm_dir=rm_workdir(tmp_path / "rm"))
  graders = reward_models.graders_from_config(c)
  general = {"prompt": "Describe a cat.", "domain": "general", "reference": "A pet."}
  math = {"prompt": "1+1?", "answer": "2", "domain": "math"}
  scores = manager.score_responses([general, math], ["A small pet.", "\\boxed{2}"],
                                   graders=graders)
  assert 0 <= scores[0] <= 1 and scores[1] == 1.0
  assert graders["math"] is manager.RULES["math"]


def test_rm_checkpoint_of_another_shape_fails_naming_the_field(tmp_path):
  c = run_config(graders="general=genrm",
                 genrm_dir=rm_workdir(tmp_path / "rm", saved_overrides={"d_model": 96}))
  with pytest.raises(InputError, match=r"config.reward.genrm_dir=.*holds another model: "
                                       r"parameter \S+ has shape") as e:
    reward_models.graders_from_config(c)
  assert "\n" not in str(e.value)


def test_rm_with_the_wrong_head_fails_naming_the_field(tmp_path):
  c = run_config(graders="general=genrm", genrm_dir=rm_workdir(tmp_path / "bt", head="scalar"))
  with pytest.raises(InputError, match="config.reward.genrm_dir=.*needs an LM head"):
    reward_models.graders_from_config(c)


def test_records_of_a_domain_without_a_grader_fail_at_load(tmp_path):
  """A general record in the prompt files fails at start naming the domain, unless
  config.reward.graders names a grader for it."""
  rows = [{"prompt": "What is 2 + 2?", "answer": "4"},
          {"prompt": "Write a haiku.", "domain": "general", "reference": "An old pond."}]
  (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (tmp_path / "heldout.jsonl").write_text(json.dumps({"prompt": "1+6?", "answer": "7"}) + "\n")
  c = base_config()
  c.data.source = "files"
  c.data.train_files = str(tmp_path / "train.jsonl")
  c.data.heldout_files = str(tmp_path / "heldout.jsonl")
  with pytest.raises(ValueError, match="config.reward.graders: no grader for domain 'general'"):
    load_entries(c)
  c.reward.graders = "general=genrm"
  train, _ = load_entries(c)
  assert np.array([e["domain"] for e in train]).tolist() == ["math", "general"]
