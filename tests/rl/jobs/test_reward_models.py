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


def test_trainer_grader_calls_the_judge_only_where_rules_cannot_settle(tmp_path, monkeypatch):
  """math=rule_judge through the trainer's grader (ResponseGrader over a batch of sampled
  tokens, with the registry config.reward builds): the answers the rules settle (one right,
  one wrong) never reach the GenRM; the unparsable one does, in one batched call, and scores
  the judge's P(YES) of the equivalence prompt."""
  from types import SimpleNamespace

  from models.tokenizer import load_tokenizer
  from rl.jobs.batch import ResponseGrader
  from rl.rewards import genrm
  c = run_config(graders="math=rule_judge", genrm_dir=rm_workdir(tmp_path / "rm"))
  graders = reward_models.graders_from_config(c)
  calls = []
  real = genrm.GenerativeRM.p_yes

  def counted(self, prompts):
    calls.append(list(prompts))
    return real(self, prompts)

  monkeypatch.setattr(genrm.GenerativeRM, "p_yes", counted)
  tokenizer = load_tokenizer(c.tokenizer)
  record = {"prompt": "What is one half?", "answer": "\\frac{1}{2}", "domain": "math"}
  responses = ["\\boxed{\\frac{1}{2}}", "Answer: \\frac{1}{2", "\\boxed{3}"]
  ids = [tokenizer.encode(r) for r in responses]
  width = max(map(len, ids))
  traj = SimpleNamespace(
      tokens=np.array([x + [tokenizer.pad_id] * (width - len(x)) for x in ids]),
      response_mask=np.array([[1] * len(x) + [0] * (width - len(x)) for x in ids]))
  scored = ResponseGrader(tokenizer, graders).score(traj, [record] * 3)
  assert list(scored["response"]) == responses
  assert calls == [[genrm.equivalence_prompt("What is one half?", "\\frac{1}{2}",
                                             "\\frac{1}{2")]]
  expected = real(reward_models.load_rm(c, "genrm"), calls[0])[0]
  np.testing.assert_allclose(scored["acc"], [1.0, expected, 0.0], atol=1e-6)


@pytest.mark.parametrize("name,head", [("genrm", "lm"), ("bt", "scalar")])
def test_rm_on_the_runs_mesh_is_sharded_and_scores_as_on_one_device(tmp_path, name, head):
  """Given the run's mesh (fsdp x tensor over the test's 8 CPU devices), a reward model is
  restored into shards on it, not whole on one device, runs there under an ambient mesh as the
  trainer's grading does, and scores a batch as the one-device copy does."""
  import jax

  from models import sharding as sharding_lib
  c = run_config(graders=f"general={name}", **{f"{name}_dir": rm_workdir(tmp_path / name,
                                                                         head=head)})
  mesh = sharding_lib.mesh_from_config({"fsdp": -1, "tensor": 2}, jax.devices()[:8])
  rows = [({"prompt": f"Describe a {s}.", "domain": "general", "reference": "A pet, thanks"},
           f"A {s}: it is calm, {w}") for s in ("cat", "storm", "lake") for w in ("thanks", "sorry")]
  entries, responses = [r[0] for r in rows], [r[1] for r in rows]
  alone = manager.score_responses(entries, responses,
                                  graders=reward_models.graders_from_config(c))
  rm = reward_models.load_rm(c, name, mesh)
  params = jax.tree.leaves(rm.params)
  assert all(x.sharding.mesh == mesh for x in params)
  assert any(x.addressable_shards[0].data.size < x.size for x in params)  # split, not copied
  with jax.set_mesh(mesh):
    sharded = manager.score_responses(entries, responses,
                                      graders=reward_models.graders_from_config(c, mesh))
  np.testing.assert_allclose(sharded, alone, atol=1e-5)
  assert np.ptp(alone) > 0  # the scores differ, so agreeing is not trivial


def test_registry_loads_a_bt_rm_from_a_hugging_face_checkpoint(tmp_path):
  """general=bt with a Hugging Face reward-model directory (a sequence classifier with one
  label and its tokenizer, here exported from a scalar-head model): the registry loads it as
  a BT RM and scores as the model it was exported from."""
  from models import hf
  from models.padding import round_up
  from models.tokenizer import load_tokenizer
  from models.transformer import build
  from rl.rewards import rm_graders
  from rl.rewards.genrm import BradleyTerryRM
  from tiny_hf import train_bpe_tokenizer
  texts = ["Describe a storm. A storm: it is calm in the morning, thanks"] * 20
  size = train_bpe_tokenizer(tmp_path, texts, 300, ["<|endoftext|>"])
  model = build("tiny_dense", seed=0, head="scalar", vocab_size=round_up(size, 8),
                max_seq_len=512)
  hf.save_pretrained(model, str(tmp_path / "rm"), dtype="float32", tokenizer_dir=str(tmp_path))
  with open(tmp_path / "rm" / "config.json") as f:
    assert json.load(f)["architectures"] == ["Qwen2ForSequenceClassification"]
  entries = [{"prompt": "Describe a storm.", "domain": "general",
              "reference": "A storm: it is calm, thanks"}] * 3
  responses = ["A storm: it is calm, thanks", "A storm: it is calm, sorry", "A storm."]
  graders = reward_models.graders_from_config(run_config(graders="general=bt",
                                                         bt_dir=str(tmp_path / "rm")))
  scores = manager.score_responses(entries, responses, graders=graders)
  expected = rm_graders.BradleyTerry(BradleyTerryRM(model, load_tokenizer(str(tmp_path)))).grade(
      entries, responses, workers=1)
  np.testing.assert_allclose(scores, expected, atol=1e-5)
  assert np.ptp(scores) > 0
