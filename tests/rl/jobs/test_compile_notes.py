"""The first step of a run compiles for seconds to minutes: the trainer and SFT say what they
are compiling before they compile it (one line each, only the first time)."""

import ml_collections
import numpy as np

from configs import demo
from rl.config.validation import validate
from rl.jobs import sft
from rl.jobs import trainer as trainer_lib
from rl.jobs.checkpoint import PreemptionGuard


def _tiny(**overrides) -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict(demo.get_config().to_dict())
  c.data.train_size, c.data.heldout_size = 48, 16
  c.rollout.max_new_tokens = 8
  c.train.prompts_per_step, c.train.samples_per_prompt = 4, 4
  c.mesh.devices = 1
  for key, value in overrides.items():
    section, _, field = key.rpartition(".")
    c[section][field] = value
  validate(c)
  return c


def _record_info(monkeypatch, module, events: list) -> None:
  monkeypatch.setattr(module.logging, "info",
                      lambda msg, *args, **_: events.append(str(msg) % args if args else str(msg)))


def test_trainer_says_it_compiles_the_rollout_update_and_eval_before_each(tmp_path,
                                                                           monkeypatch):
  """Over 3 steps with an evaluation every step: the rollout, the update and the evaluation are
  each announced once, just before their first call."""
  t = trainer_lib.Trainer(_tiny(**{"train.steps": 3, "train.eval_every": 1}), str(tmp_path))
  events = []
  _record_info(monkeypatch, trainer_lib, events)
  traj = np.ones((4, 4))
  stats = {"gen_batches": 1, "groups_seen": 1, "groups_kept": 1, "filled_groups": 0,
           "t_rollout": 1.0, "t_reward": 0.0, "raw_acc": 0.0, "raw_len_mean": 1.0,
           "domain_acc": {},
           "curriculum": {}, "source": {}}

  def call(name, result):
    return lambda *args: events.append(name) or result

  monkeypatch.setattr(t, "collect", call("rollout", (
      type("Traj", (), {"response_mask": traj, "truncated": traj, "kept_ids": None})(),
      {"scores": np.zeros(4), "acc": np.zeros(4)}, stats)))
  monkeypatch.setattr(t, "advantages", call("advantages", {}))
  monkeypatch.setattr(t, "build_batch", call("batch", {}))
  monkeypatch.setattr(t, "update", call("update", {"skipped": 0.0}))
  monkeypatch.setattr(t, "evaluate", call("evaluate", 0.0))
  monkeypatch.setattr(t, "save", lambda *a, **k: None)
  with PreemptionGuard() as guard:
    t._run(guard)
  compiles = [e for e in events if e.startswith("compiling")]
  assert [e.split(" (")[0] for e in compiles] == [
      "compiling the rollout", "compiling the policy update", "compiling the held-out evaluation"]
  for note, call_name in zip(compiles, ("rollout", "update", "evaluate")):
    assert events[events.index(note) + 1:].index(call_name) <= 2  # the call follows the note
  assert events.count("rollout") == events.count("update") == events.count("evaluate") == 3


def test_sft_says_it_compiles_the_evaluation_and_each_stage(tmp_path, monkeypatch):
  """A 3-step DSA SFT run (a dense step, a dense warm-up step, a sparse one): the held-out loss
  and each stage's step are announced once, before the stage's first step."""
  c = _tiny(**{"sft.epochs": 1, "sft.batch_size": 16, "sft.dense_steps": 1,
               "sft.dense_warmup_steps": 1, "sft.log_every": 1})
  events = []
  _record_info(monkeypatch, sft, events)
  sft.run(c, str(tmp_path))
  compiles = [e for e in events if e.startswith("compiling")]
  assert compiles == ["compiling the SFT evaluation (held-out loss before training)...",
                      "compiling the SFT step (dense)...",
                      "compiling the SFT step (dense_warmup)...",
                      "compiling the SFT step (sparse)..."]
  steps = [e for e in events if e.startswith("sft step")]
  assert len(steps) == 3
  for i, stage in enumerate(("dense", "dense_warmup", "sparse")):
    assert f"[{stage}]" in steps[i]
    assert events.index(steps[i - 1] if i else compiles[0]) < events.index(compiles[i + 1])
    assert events.index(compiles[i + 1]) < events.index(steps[i])
