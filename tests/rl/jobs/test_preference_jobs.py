"""The preference jobs from the launcher (launch/jobs.py run_job, as launch/train.py calls it):
on the planted-preference pairs the Bradley-Terry and generative RM jobs reach a held-out
pairwise accuracy well above chance in seconds on tiny_dense, and their workdirs load as
config.reward's reward models; DPO resumes to the uninterrupted parameters; bad rows and a
model of the wrong head fail at start on one line."""

import json

import jax
import numpy as np
import pytest

import launch.jobs
from rl.config.defaults import base_config
from rl.core.checks import InputError
from rl.jobs import checkpoint, preference, reward_models
from rl.rewards import manager

from tests.rl.jobs.test_resume import preempt_at_boundary, saved_params


def write_pairs(directory, *, train=256, heldout=64, shuffle_labels=False):
  """Planted pairs (training seed 0, held-out seed 1) as jsonl. `shuffle_labels` swaps chosen
  and rejected in a random half (exactly) of the training pairs: no label is left to learn."""
  pairs = preference.make_planted_preferences(train, 0)
  if shuffle_labels:
    swap = np.random.default_rng(0).permutation(len(pairs)) < len(pairs) // 2
    pairs = [preference.PreferencePair(p.prompt, p.rejected, p.chosen) if s else p
             for p, s in zip(pairs, swap)]
  preference.save_preferences(directory / "train.jsonl", pairs)
  preference.save_preferences(directory / "heldout.jsonl",
                              preference.make_planted_preferences(heldout, 1))
  return directory / "train.jsonl", directory / "heldout.jsonl"


def job_config(job, train, heldout, *, steps, **sft):
  c = base_config(preset="tiny_dense")
  c.job = job
  c.model.head = "scalar" if job == "bt_rm" else "lm"
  c.preference.train_files, c.preference.heldout_files = str(train), str(heldout)
  c.preference.steps = steps
  c.sft.batch_size = 16
  c.sft.log_every = 10
  for field, value in sft.items():
    c.sft[field] = value
  return c


def metrics_rows(workdir):
  with open(workdir / "metrics.jsonl") as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def bt_run(tmp_path_factory):
  root = tmp_path_factory.mktemp("bt")
  train, heldout = write_pairs(root)
  c = job_config("bt_rm", train, heldout, steps=40)
  launch.jobs.run_job(c, str(root / "work"))
  return root / "work", heldout


def test_planted_pairs_differ_only_in_the_planted_property():
  pairs = preference.make_planted_preferences(64, 0)
  assert pairs == preference.make_planted_preferences(64, 0)
  for pair in pairs:
    assert preference.has_planted_property(pair.chosen)
    assert not preference.has_planted_property(pair.rejected)
    assert len(pair.chosen) == len(pair.rejected)
    assert pair.chosen.split()[:-1] == pair.rejected.split()[:-1]


def test_bt_job_learns_the_planted_preference(bt_run):
  """40 steps of 16 pairs: held-out pairwise accuracy > 0.8 and held-out BT loss well under
  log 2 (chance), logged at step 0 and at the end. The accuracy alone is a weak witness on this
  task, where every held-out pair has the same contrast: a model tilted either way orders
  nearly all of them alike. Trained on labels swapped in a random half of the pairs, this run
  still reached accuracy 0.95 but held-out loss stays near log 2."""
  workdir, _ = bt_run
  rows = metrics_rows(workdir)
  assert rows[0]["step"] == 0 and "bt_rm/heldout_accuracy" in rows[0]
  assert rows[-1]["step"] == 40
  assert rows[-1]["bt_rm/heldout_accuracy"] > 0.8
  assert rows[-1]["bt_rm/heldout_loss"] < 0.3
  assert [r["step"] for r in rows] == [0, 10, 20, 30, 40]


def test_bt_job_workdir_is_config_reward_bt_dir(bt_run):
  """The job's workdir loads as config.reward.bt_dir: the RM orders held-out pairs as the job
  reported, and the "bt" grader scores a general record's chosen response above its
  reference (the rejected one, scored 0.5)."""
  workdir, heldout = bt_run
  c = base_config()
  c.reward.graders, c.reward.bt_dir = "general=bt", str(workdir)
  rm = reward_models.load_rm(c, "bt")
  pairs, _ = preference.load_preferences(heldout)
  assert preference.bt_accuracy(rm, pairs) == metrics_rows(workdir)[-1]["bt_rm/heldout_accuracy"]
  graders = reward_models.graders_from_config(c)
  records = [{"prompt": p.prompt, "domain": "general", "reference": p.rejected}
             for p in pairs[:8]]
  scores = manager.score_responses(records * 2, [p.chosen for p in pairs[:8]]
                                   + [p.rejected for p in pairs[:8]], graders=graders)
  np.testing.assert_allclose(scores[8:], 0.5, atol=1e-6)
  assert np.mean(scores[:8] > 0.5) >= 0.75


def test_genrm_job_learns_the_planted_preference_and_loads_as_genrm_dir(tmp_path):
  """The pairwise GenRM job (both orders of each pair, YES / NO): held-out accuracy > 0.8, and
  its workdir loads as config.reward.genrm_dir with the same held-out accuracy."""
  train, heldout = write_pairs(tmp_path)
  c = job_config("genrm", train, heldout, steps=60, lr=2e-3)
  launch.jobs.run_job(c, str(tmp_path / "work"))
  final = metrics_rows(tmp_path / "work")[-1]
  accuracy = final["genrm/heldout_accuracy"]
  assert accuracy > 0.8 and final["genrm/heldout_loss"] < 0.3
  r = base_config()
  r.reward.graders, r.reward.genrm_dir = "general=genrm", str(tmp_path / "work")
  rm = reward_models.load_rm(r, "genrm")
  pairs, _ = preference.load_preferences(heldout)
  assert preference.judge_accuracy(rm, pairs)["both_orders"] == accuracy


def test_dpo_job_preempted_resumes_to_the_uninterrupted_parameters(tmp_path):
  """A DPO job stopped after step 2 of 4 (a checkpoint only there) and rerun ends with the
  parameters and final metrics of a run that was not stopped; a finished job is not rerun."""
  train, heldout = write_pairs(tmp_path, train=32, heldout=16)
  c = job_config("dpo", train, heldout, steps=4, checkpoint_every=100, log_every=1)
  straight = tmp_path / "straight"
  launch.jobs.run_job(c, str(straight))
  stopped = tmp_path / "stopped"
  with preempt_at_boundary(2), pytest.raises(checkpoint.Preempted, match=r"after step 2/4"):
    launch.jobs.run_job(c, str(stopped))
  launch.jobs.run_job(c, str(stopped))
  (step_a, a), (step_b, b) = saved_params(straight / "checkpoints"), saved_params(
      stopped / "checkpoints")
  assert step_a == step_b == 4
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
  assert metrics_rows(straight) == metrics_rows(stopped)
  launch.jobs.run_job(c, str(stopped))  # done: returns without training or writing
  assert metrics_rows(stopped) == metrics_rows(straight)


def test_bad_preference_rows_fail_at_start_naming_the_row_and_field(tmp_path):
  """A jsonl row without "rejected" fails naming file:line; a parquet row whose "chosen" is not
  a string fails naming file row N; one line each, before any model is built."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  good = {"prompt": "Describe a river.", "chosen": "Calm, thanks", "rejected": "Calm, indeed"}
  jsonl = tmp_path / "train.jsonl"
  jsonl.write_text(json.dumps(good) + "\n" + json.dumps({"prompt": "q", "chosen": "a"}) + "\n")
  parquet = tmp_path / "train.parquet"
  pq.write_table(pa.Table.from_pylist([good, {**good, "chosen": None}]), parquet)
  heldout = tmp_path / "heldout.jsonl"
  heldout.write_text(json.dumps(good) + "\n")
  for path, where in ((jsonl, f"{jsonl}:2: field 'rejected'"),
                      (parquet, f"{parquet} row 2: field 'chosen'")):
    with pytest.raises(InputError) as e:
      launch.jobs.run_job(job_config("bt_rm", path, heldout, steps=1), str(tmp_path / "w"))
    assert str(e.value).startswith(where) and "\n" not in str(e.value)
  c = job_config("bt_rm", jsonl, heldout, steps=1)
  c.model.head = "lm"
  with pytest.raises(InputError, match=r"^config.model.head='lm' with config.job='bt_rm'"):
    launch.jobs.run_job(c, str(tmp_path / "w2"))
