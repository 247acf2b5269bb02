"""Prompt selection through rl/jobs/select_prompts.py with scripted responses, graded by an exact
boxed-answer check: one sampling pass reaches each rule of rl/data/selection.py and writes the
hand-computed records, as prompt records the trainer's reader loads back."""

import numpy as np
import pytest

from rl.data import sources
from rl.jobs import select_prompts

ANSWERS = {"q0": "5", "q1": "7", "q2": "2", "q3": "4", "q4": "2"}
RESPONSES = {
    "q0": ["\\boxed{5}"] * 4,  # always solved
    "q1": ["\\boxed{7}", "\\boxed{3}", "\\boxed{7}", "\\boxed{7}"],  # solved 3 of 4
    "q2": ["\\boxed{9}"] * 4,  # never solved; all samples agree on 9: the reference looks wrong
    "q3": ["\\boxed{1}", "\\boxed{2}", "no idea", "The answer is 1."],  # never solved; 1 at 50%
    "q4": ["print(1)"] * 4,  # a code record: its "1"s are not math answers, never audited
}


def records():
  rows = [{"prompt": p, "answer": a, "data_source": "unit", "domain": "math"}
          for p, a in ANSWERS.items()]
  rows[4]["domain"] = "code"
  return rows


def scripted_generate(batch, n):
  assert n == 4
  return [RESPONSES[r["prompt"]] for r in batch]


def boxed_verify(entries, responses):
  """Correct when the response boxes the reference answer (one flat batch, as the manager)."""
  return [float(response == f"\\boxed{{{entry['answer']}}}")
          for entry, response in zip(entries, responses)]


def run(tmp_path, rule, **options):
  out = str(tmp_path / f"{rule}.jsonl")
  stats, outcomes = select_prompts.select_prompts(records(), scripted_generate, boxed_verify, rule=rule,
                                          n=4, out_path=out, batch_size=2, **options)
  written, _ = sources.load_records(out)
  return written, stats, outcomes


def test_one_pass_gives_accuracies_and_math_answers(tmp_path):
  _, stats, outcomes = run(tmp_path, "worst_of_n")
  assert outcomes.accuracies.tolist() == [[1, 1, 1, 1], [1, 0, 1, 1], [0] * 4, [0] * 4, [0] * 4]
  assert outcomes.answers[:4] == [["5"] * 4, ["7", "3", "7", "7"], ["9"] * 4,
                                  ["1", "2", None, "1"]]
  assert outcomes.answers[4] == [None] * 4
  assert stats == {"prompts": 5, "samples": 20, "correct": 7, "prompts_with_correct": 2,
                   "prompts_all_correct": 1, "written": 4}


def test_rejection_writes_unique_verified_responses(tmp_path):
  written, stats, _ = run(tmp_path, "rejection")
  assert [(r["prompt"], r["response"]) for r in written] == [("q0", "\\boxed{5}"),
                                                             ("q1", "\\boxed{7}")]
  assert written[0]["answer"] == "5" and stats["written"] == 2


def test_worst_of_n_drops_the_always_solved_prompt(tmp_path):
  written, _, _ = run(tmp_path, "worst_of_n")
  assert [r["prompt"] for r in written] == ["q1", "q2", "q3", "q4"]
  assert "response" not in written[0]


def test_low_variance_keeps_only_prompts_whose_accuracy_varies(tmp_path):
  written, _, _ = run(tmp_path, "low_variance")
  assert [r["prompt"] for r in written] == ["q1"]


def test_audit_writes_confident_disagreements_with_their_answers(tmp_path):
  written, _, _ = run(tmp_path, "audit")
  assert [(r["prompt"], r["answer"], r["sampled_answers"]) for r in written] == [
      ("q2", "2", ["9"] * 4)]
  written, _, _ = run(tmp_path, "audit", audit_threshold=0.5)
  assert [r["prompt"] for r in written] == ["q2", "q3"]


def test_batches_agree_and_bad_shapes_fail():
  whole = select_prompts.sample_outcomes(records(), scripted_generate, boxed_verify, n=4)
  batched = select_prompts.sample_outcomes(records(), scripted_generate, boxed_verify, n=4, batch_size=3)
  assert whole.responses == batched.responses and whole.answers == batched.answers
  assert whole.accuracies.tolist() == batched.accuracies.tolist()

  def short_of_q2(batch, n):
    return [samples[:3] if r["prompt"] == "q2" else samples
            for r, samples in zip(batch, scripted_generate(batch, n))]

  with pytest.raises(ValueError, match="3 responses for prompt 2, expected 4"):
    select_prompts.sample_outcomes(records(), short_of_q2, boxed_verify, n=4, batch_size=2)
  with pytest.raises(ValueError, match="scores for 20 responses"):
    select_prompts.sample_outcomes(records(), scripted_generate, lambda e, r: [1.0], n=4)


def test_unknown_rule_is_one_line_naming_it_before_sampling(tmp_path):
  def must_not_sample(batch, n):
    raise AssertionError("sampled before the rule was checked")

  with pytest.raises(ValueError) as error:
    select_prompts.select_prompts(records(), must_not_sample, boxed_verify, rule="best_of_n",
                                  n=4, out_path=str(tmp_path / "x.jsonl"))
  message = str(error.value)
  assert "'best_of_n'" in message and "\n" not in message
  assert all(rule in message for rule in select_prompts.RULES)
  assert not (tmp_path / "x.jsonl").exists()
  # The model-loading entry point checks the rule before it reads the checkpoint.
  with pytest.raises(ValueError, match="unknown selection rule 'best_of_n'"):
    select_prompts.sample_and_select(None, str(tmp_path / "no_checkpoint"), rule="best_of_n", n=4,
                             out_path=str(tmp_path / "y.jsonl"))


# Pre-PPO: hand-computed per-domain z-scores. math 0.2..0.8: mean 0.5, std sqrt(0.05), z =
# -1.342, -0.447, 0.447, 1.342; general 50..100: mean 75, std 17.08, z = -1.464, -0.878, ...
PRE_PPO_SCORES = {"m0": 0.2, "m1": 0.4, "m2": 0.6, "m3": 0.8,
                  "g0": 50.0, "g1": 60.0, "g2": 70.0, "g3": 80.0, "g4": 90.0, "g5": 100.0}


def test_pre_ppo_keeps_the_per_domain_normalised_bottom_fraction_and_the_trainer_reads_it(
    tmp_path):
  """fraction 0.3 of 10 prompts keeps 3: by z-score g0, m0, g1 (raw scores would keep m0, m1,
  m2; a bottom fraction per domain would keep m0 and g0, g1). The file holds the original set
  and the kept prompts once more, and the trainer's loader (config.data.source=files) reads it."""
  from rl.config.defaults import base_config
  from rl.data.entries import load_entries
  rows = [{"prompt": p, "domain": "math" if p[0] == "m" else "general", "answer": "1"}
          for p in PRE_PPO_SCORES]

  def scored_verify(entries, responses):
    return [PRE_PPO_SCORES[e["prompt"]] for e in entries]

  out = tmp_path / "pre_ppo.jsonl"
  stats, outcomes = select_prompts.select_prompts(
      rows, lambda batch, n: [["a response"] * n for _ in batch], scored_verify, rule="pre_ppo",
      n=2, out_path=str(out), fraction=0.3)
  assert stats["written"] == 13
  written, _ = sources.load_records(str(out))
  assert [r["prompt"] for r in written[10:]] == ["m0", "g0", "g1"]
  assert all(r["pre_ppo"] for r in written[10:]) and "pre_ppo" not in written[0]
  z = select_prompts.selection.domain_z_scores(rows, [PRE_PPO_SCORES[r["prompt"]] for r in rows])
  np.testing.assert_allclose(z[:4], [-1.3416, -0.4472, 0.4472, 1.3416], atol=1e-4)
  np.testing.assert_allclose(z[4:6], [-1.4639, -0.8783], atol=1e-4)

  (tmp_path / "heldout.jsonl").write_text('{"prompt": "h0", "answer": "1"}\n')
  c = base_config()
  c.data.source, c.data.train_files = "files", str(out)
  c.data.heldout_files, c.reward.graders = str(tmp_path / "heldout.jsonl"), "general=genrm"
  train, _ = load_entries(c)
  assert [e["prompt"] for e in train] == [r["prompt"] for r in written]


def test_pre_ppo_fraction_out_of_range_fails():
  with pytest.raises(ValueError, match=r"fraction must be in \(0, 1\], got 0"):
    select_prompts.selection.pre_ppo_select([{"prompt": "q"}], [1.0], fraction=0)


def test_best_of_n_reference_writes_each_prompts_best_scored_sample(tmp_path):
  """The written reference is the sample the grader scored highest (the first of equal
  scores), whatever its position, replacing a record's old reference; every prompt is kept."""
  rows = [{"prompt": "p0", "domain": "general", "reference": "old"},
          {"prompt": "p1", "domain": "general"}]
  samples = {"p0": ["a", "b", "c"], "p1": ["x", "y", "z"]}
  score_of = {"a": 0.1, "b": 0.9, "c": 0.3, "x": 0.7, "y": 0.2, "z": 0.7}
  out = tmp_path / "references.jsonl"
  stats, _ = select_prompts.select_prompts(
      rows, lambda batch, n: [samples[r["prompt"]] for r in batch],
      lambda entries, responses: [score_of[r] for r in responses],
      rule="best_of_n_reference", n=3, out_path=str(out))
  written, _ = sources.load_records(str(out))
  assert stats["written"] == 2
  assert [(r["prompt"], r["reference"], r["reference_score"]) for r in written] == [
      ("p0", "b", pytest.approx(0.9)), ("p1", "x", pytest.approx(0.7))]
