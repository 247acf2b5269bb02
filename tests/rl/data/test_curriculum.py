"""Curricula (rl/data/curriculum.py, schedules.py): schedules, adaptation, difficulty, the
prompt draw, and resume."""

import json

import numpy as np
import pytest

from rl.data import curriculum, schedules


def json_round_trip(state):
  return json.loads(json.dumps(state))


# ----------------------------------------------------------------------------- Staged schedule

def data_scaling_schedule():
  return schedules.StagedSchedule([
      (0, {"code": 1.0}),
      (200, {"code": 1.0, "math": 1.0}),
      (600, {"code": 2.0, "math": 2.0, "logic": 1.0, "general": 1.0}),
  ])


def test_staged_schedule_boundaries():
  """Each stage holds from its start step up to (not including) the next stage's start."""
  schedule = data_scaling_schedule()
  assert schedule.weights(0) == schedule.weights(199) == {"code": 1.0}
  assert schedule.weights(200) == schedule.weights(599) == {"code": 0.5, "math": 0.5}
  assert schedule.weights(600) == schedule.weights(10**6) == {
      "code": 1 / 3, "math": 1 / 3, "logic": 1 / 6, "general": 1 / 6}
  assert [schedule.stage_index(s) for s in (0, 199, 200, 599, 600)] == [0, 0, 1, 1, 2]


@pytest.mark.parametrize("stages, message", [
    ([], "at least one stage"),
    ([(5, {"code": 1.0})], "must start at step 0"),
    ([(0, {"code": 1.0}), (0, {"math": 1.0})], "not after stage 0"),
    ([(0, {"code": -1.0, "math": 2.0})], "must be finite and >= 0"),
    ([(0, {"code": 0.0})], "sum to zero"),
])
def test_staged_schedule_rejects_bad_stages(stages, message):
  """Misordered stages and bad weights fail at construction."""
  with pytest.raises(ValueError, match=message):
    schedules.StagedSchedule(stages)


def test_staged_schedule_state_round_trip():
  """A schedule restored from a checkpoint decides like the one that was saved."""
  saved = data_scaling_schedule()
  restored = schedules.StagedSchedule([(0, {"math": 1.0})])
  restored.load_state_dict(json_round_trip(saved.state_dict()))
  assert all(restored.weights(s) == saved.weights(s) for s in range(0, 800, 50))


# ----------------------------------------------------------------------------- Online adaptation

def test_adaptation_moves_weight_toward_improving_domain():
  """A domain whose accuracy rises gains weight over one that is flat at the same level."""
  adaptation = schedules.OnlineAdaptation(["math", "code"], floor=0.1)
  adaptation.update({"math": 0.5, "code": 0.5})
  assert adaptation.weights() == pytest.approx({"math": 0.5, "code": 0.5})
  adaptation = schedules.OnlineAdaptation(["math", "code"], floor=0.1)
  for accuracy in np.linspace(0.2, 0.5, 16):  # math climbs to where code has sat all along
    adaptation.update({"math": float(accuracy), "code": 0.5})
  weights = adaptation.weights()
  assert adaptation.fast["math"] < adaptation.fast["code"]  # no more learnable than code ...
  assert weights["math"] > weights["code"] + 0.1  # ... but improving
  assert sum(weights.values()) == pytest.approx(1.0)


def test_adaptation_floor_for_saturated_and_hopeless():
  """Saturated and hopeless domains fall to exactly the floor; the learnable one gets the rest."""
  adaptation = schedules.OnlineAdaptation(["math", "code", "logic"], floor=0.05)
  for _ in range(5):
    adaptation.update({"math": 1.0, "code": 0.0, "logic": 0.5})
  assert adaptation.weights() == pytest.approx({"math": 0.05, "code": 0.05, "logic": 0.9})
  for _ in range(15):
    adaptation.update({"logic": 1.0})
  assert adaptation.weights() == pytest.approx({d: 1 / 3 for d in ("math", "code", "logic")})
  with pytest.raises(ValueError, match="must be in \\[0, 1\\]"):
    adaptation.update({"math": 1.5})
  with pytest.raises(ValueError, match="floor"):
    schedules.OnlineAdaptation(["a", "b", "c"], floor=0.4)


def test_adaptation_unseen_domain_is_tried():
  """A domain with no accuracy yet gets the mid-range score, not the floor."""
  adaptation = schedules.OnlineAdaptation(["math", "code"], floor=0.05)
  for _ in range(3):
    adaptation.update({"math": 0.97})
  assert adaptation.weights() == pytest.approx({"math": 0.05, "code": 0.95})


# ----------------------------------------------------------------------------- Difficulty

def test_difficulty_rises_after_threshold_over_window_and_not_before():
  """The level rises only once a full window at this level averages >= threshold."""
  difficulty = schedules.DifficultyCurriculum({"maze": 3}, threshold=0.8, window=3)
  assert difficulty.update({"maze": 0.9}) == [] and difficulty.update({"maze": 0.9}) == []
  assert difficulty.level("maze") == 0  # window not yet full
  assert difficulty.update({"maze": 0.5}) == []  # mean 0.77 < 0.8
  assert difficulty.update({"maze": 0.9}) == []  # window 0.9, 0.5, 0.9: still 0.77
  assert difficulty.update({"maze": 0.9}) == []  # window 0.5, 0.9, 0.9: still 0.77
  assert difficulty.update({"maze": 0.8}) == ["maze"]  # window 0.9, 0.9, 0.8
  assert difficulty.level("maze") == 1
  assert difficulty.update({"maze": 1.0}) == []  # the window restarted at level 1
  for _ in range(2):
    difficulty.update({"maze": 1.0})
  assert difficulty.level("maze") == 2
  for _ in range(6):
    difficulty.update({"maze": 1.0})
  assert difficulty.level("maze") == 2  # the top level


def test_difficulty_for_puzzles_uses_task_levels():
  """for_puzzles reads level counts from the puzzle registry; bad inputs fail."""
  from rl.rewards import puzzles
  difficulty = schedules.DifficultyCurriculum.for_puzzles(["arithmetic", "maze"])
  assert difficulty.num_levels == {"arithmetic": puzzles.TASKS["arithmetic"].levels,
                                   "maze": puzzles.TASKS["maze"].levels}
  with pytest.raises(ValueError, match="must be in \\[0, 1\\]"):
    difficulty.update({"maze": 80.0})
  with pytest.raises(ValueError, match="level 99 outside"):
    schedules.DifficultyCurriculum({"maze": 3}, start={"maze": 99})


# ----------------------------------------------------------------------------- Domain counts

def test_domain_counts_follow_weights():
  """Counts sum to the batch, are floor/ceil of batch * w, and average to batch * w."""
  weights = {"math": 0.5, "code": 0.3, "logic": 0.2}
  domains = ["math", "code", "logic"]
  all_counts = np.array([[schedules.domain_counts(weights, domains, 7, rng_seed=[0, step])[d]
                          for d in domains] for step in range(3000)])
  assert np.all(all_counts.sum(1) == 7)
  exact = np.array([3.5, 2.1, 1.4])
  assert np.all((all_counts == np.floor(exact)) | (all_counts == np.ceil(exact)))
  np.testing.assert_allclose(all_counts.mean(0), exact, atol=0.05)
  with pytest.raises(ValueError, match="without records: \\['general'\\]"):
    schedules.domain_counts({"general": 1.0}, domains, 4, rng_seed=0)


# ----------------------------------------------------------------------------- Resume

def drive(adaptation, difficulty, schedule, steps):
  """Runs a few curriculum steps, returning every decision made."""
  decisions = []
  for step in steps:
    weights = {d: w * schedule.weights(step).get(d, 0.0) for d, w in adaptation.weights().items()}
    decisions.append((weights, dict(difficulty.levels)))
    accuracy = {d: (step * 0.07 + 0.1 * i) % 1.0 for i, d in enumerate(("math", "code", "logic"))}
    adaptation.update(accuracy)
    difficulty.update({"maze": accuracy["logic"]})
  return decisions


def make_curricula():
  return (schedules.OnlineAdaptation(["math", "code", "logic"]),
          schedules.DifficultyCurriculum({"maze": 5}, threshold=0.5, window=2),
          schedules.StagedSchedule([(0, {"code": 1.0, "logic": 1.0}),
                                     (4, {"code": 1.0, "math": 1.0, "logic": 1.0})]))


def test_state_round_trip_gives_identical_decisions():
  """Curricula restored from JSON state make exactly the decisions the originals go on to make."""
  original = make_curricula()
  drive(*original, steps=range(7))
  states = [json_round_trip(c.state_dict()) for c in original]
  expected = drive(*original, steps=range(7, 20))
  restored = make_curricula()
  for obj, state in zip(restored, states):
    obj.load_state_dict(state)
  assert drive(*restored, steps=range(7, 20)) == expected
  fresh = make_curricula()
  assert drive(*fresh, steps=range(7, 20)) != expected
  assert any(levels["maze"] > 0 for _, levels in expected)


# ----------------------------------------------------------------------------- PromptCurriculum

def data_section(**changes):
  from rl.config.defaults import base_config
  c = base_config()
  for key, value in changes.items():
    c.data[key] = value
  return c.data


def records_of(counts):
  return [{"prompt": f"{domain}{i}", "domain": domain} for domain, n in counts.items()
          for i in range(n)]


def test_uniform_draw_reads_every_entry_once_per_epoch():
  """No curriculum: each epoch (30 entries, drawn in batches that straddle epoch boundaries)
  holds every entry exactly once, each epoch in a new order, the same for the same seed; an
  i.i.d. draw (the trainer's former one) repeats and misses entries and fails this."""
  entries = records_of({"math": 30})

  def draws(seed):
    cur = curriculum.PromptCurriculum(data_section(), entries, seed=seed)
    return np.concatenate([cur.draw(step, b, 8) for step in range(5) for b in range(3)])

  drawn = draws(3)
  epochs = drawn[:90].reshape(3, 30)
  for epoch in epochs:
    assert sorted(epoch) == list(range(30))
  assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[0], np.arange(30))
  np.testing.assert_array_equal(draws(3), drawn)
  assert not np.array_equal(draws(4)[:30], epochs[0])


def test_uniform_draw_resumes_mid_epoch():
  """A curriculum restored from the state (through JSON) of one that drew 2.5 batches' worth
  draws exactly what the original draws next; a fresh one does not."""
  entries = records_of({"math": 20})
  cur = curriculum.PromptCurriculum(data_section(), entries, seed=0)
  for batch_index in range(3):
    cur.draw(0, batch_index, 6)
  restored = curriculum.PromptCurriculum(data_section(), entries, seed=0)
  restored.load_state_dict(json_round_trip(cur.state_dict()))
  expected = [cur.draw(1, b, 6) for b in range(4)]
  np.testing.assert_array_equal([restored.draw(1, b, 6) for b in range(4)], expected)
  fresh = curriculum.PromptCurriculum(data_section(), entries, seed=0)
  assert not np.array_equal(fresh.draw(1, 0, 6), expected[0])


def test_uniform_draws_of_different_seeds_are_not_shifted_copies():
  """Seeds are independent experiments: seed 0's second batch must not be seed 1's first (a
  key of [seed + batch_index, step] once made them equal)."""
  entries = records_of({"math": 1000})
  cur = {s: curriculum.PromptCurriculum(data_section(), entries, seed=s) for s in (0, 1)}
  first = {s: cur[s].draw(0, 0, 16) for s in (0, 1)}
  assert not np.array_equal(cur[0].draw(0, 1, 16), first[1])
  assert not np.array_equal(first[0], first[1])


def test_staged_curriculum_draws_by_stage_weights():
  entries = records_of({"code": 20, "math": 20, "logic": 20})
  cur = curriculum.PromptCurriculum(
      data_section(curriculum="staged", curriculum_stages="0:code=1; 10:code=1,math=3"),
      entries, seed=0)
  first = [entries[i]["domain"] for i in cur.draw(3, 0, 16)]
  assert first == ["code"] * 16
  later = [entries[i]["domain"] for i in cur.draw(12, 0, 16)]
  assert later.count("code") == 4 and later.count("math") == 12
  metrics = cur.observe(12, [entries[i] for i in cur.draw(12, 0, 16)], np.ones(16))
  assert metrics == {"curriculum/weight/code": 0.25, "curriculum/weight/math": 0.75}
  with pytest.raises(ValueError, match="names domains \\['general'\\]"):
    curriculum.PromptCurriculum(
        data_section(curriculum="staged", curriculum_stages="0:general=1"), entries, seed=0)


def test_online_curriculum_moves_weight_to_learnable_domains_and_resumes():
  entries = records_of({"code": 20, "math": 20})
  cur = curriculum.PromptCurriculum(data_section(curriculum="online"), entries, seed=0)
  batch = [entries[i] for i in range(0, 40, 2)]
  acc = np.array([1.0 if e["domain"] == "code" else (i % 2) for i, e in enumerate(batch)])
  cur.observe(0, batch, acc)  # code saturated (1.0), math at 0.5
  weights = cur.weights(1)
  assert weights["math"] > 0.9 and weights["code"] == pytest.approx(0.05)
  restored = curriculum.PromptCurriculum(data_section(curriculum="online"), entries, seed=0)
  restored.load_state_dict(json.loads(json.dumps(cur.state_dict())))
  np.testing.assert_array_equal(restored.draw(1, 0, 16), cur.draw(1, 0, 16))


def test_difficulty_curriculum_raises_the_level_and_regenerates_after_resume():
  from rl.data.templates import prompt_of
  from rl.rewards import puzzles
  data = data_section(curriculum="difficulty", difficulty=0, train_size=50,
                      curriculum_threshold=0.75, curriculum_window=2)
  heldout = {prompt_of(e) for e in puzzles.make("arithmetic", size=50, seed=99, difficulty=1)}
  entries = puzzles.make("arithmetic", size=50, seed=0, difficulty=0)
  cur = curriculum.PromptCurriculum(data, entries, seed=0, exclude=heldout)
  assert cur.observe(0, entries[:4], np.ones(4)) == {"curriculum/level": 0.0}
  assert cur.observe(1, entries[:4], np.array([1, 1, 0, 1])) == {"curriculum/level": 1.0}
  assert {e["difficulty"] for e in cur.entries} == {1}
  assert not {prompt_of(e) for e in cur.entries} & heldout
  restored = curriculum.PromptCurriculum(data, entries, seed=0, exclude=heldout)
  restored.load_state_dict(json.loads(json.dumps(cur.state_dict())))
  assert restored.entries == cur.entries
  np.testing.assert_array_equal(restored.draw(2, 0, 8), cur.draw(2, 0, 8))
  with pytest.raises(ValueError, match="curriculum is 'difficulty'"):
    curriculum.PromptCurriculum(data_section(), entries, seed=0).load_state_dict(cur.state_dict())
