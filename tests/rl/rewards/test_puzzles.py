"""Tests for the puzzle tasks (rl/rewards/puzzles.py, puzzle_verifiers.py): generators, our
verifiers, their safety.

Where reasoning-gym's own scorer rewards a wrong answer, the test calls that scorer on the answer
to show it does (it is never called on malicious text: several of them eval() their input), then
checks that ours gives 0.
"""

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import reasoning_gym

from rl.rewards import extract, puzzle_verifiers, puzzles

REPO_ROOT = Path(__file__).resolve().parents[3]
REQUIRED_TASKS = ("arithmetic", "puzzle24", "countdown", "maze", "sudoku", "knights_knaves",
                  "zebra")
SEEDS = (0, 1, 2)


def _entries(task, difficulty, seed=0, size=3):
  return puzzles.make(task, size=size, seed=seed, difficulty=difficulty)


def _rg_score(name, answer, entry):
  """reasoning-gym's own scorer for `entry` (a dict in its format), on its default config."""
  return reasoning_gym.create_dataset(name, seed=0, size=1).score_answer(answer, entry)


# ---------------------------------------------------------------------------------------------
# Registry, generators, determinism
# ---------------------------------------------------------------------------------------------

def test_registry_describes_every_task():
  """TASKS holds the required tasks plus extras, each with >= 2 levels and a knob description."""
  assert set(REQUIRED_TASKS) < set(puzzles.TASKS)
  assert len(puzzles.TASKS) >= len(REQUIRED_TASKS) + 2
  for name, task in puzzles.TASKS.items():
    assert task.name == name and task.levels >= 2 and len(task.difficulty) > 20


def test_difficulty_outside_levels_is_an_error():
  """A difficulty past the last level fails loudly instead of silently clamping."""
  with pytest.raises(ValueError):
    puzzles.make("maze", size=1, seed=0, difficulty=puzzles.TASKS["maze"].levels)


@pytest.mark.parametrize("task", sorted(puzzles.TASKS))
def test_gold_answers_score_one(task):
  """Gold answers of entries from several seeds and two difficulties score 1, raw or wrapped."""
  for difficulty in (0, 2):
    for seed in SEEDS:
      for entry in _entries(task, difficulty, seed=seed, size=2):
        assert entry["task"] == task and entry["difficulty"] == difficulty
        assert entry["question"] and entry["answer"]
        entry = json.loads(json.dumps(entry))  # entries must survive a JSON round trip
        gold = entry["answer"]
        assert puzzles.score(entry, gold) == 1.0
        assert puzzles.score(entry, f"Some reasoning.\n\\boxed{{{gold}}}") == 1.0
        assert puzzles.score(entry, f"Thinking... Answer: 3\nso finally\nAnswer: {gold}") == 1.0


def test_same_seed_same_entries_different_seed_different():
  """make() is a function of its arguments; another seed gives other puzzles."""
  for task in puzzles.TASKS:
    first = _entries(task, 0, seed=5, size=2)
    assert first == _entries(task, 0, seed=5, size=2)
    assert first != _entries(task, 0, seed=6, size=2)


def test_neighbouring_seeds_share_no_items():
  """reasoning-gym seeds item i with seed + i; our hashed seeds keep seed 1 and 2 apart."""
  questions_1 = {e["question"] for e in _entries("maze", 1, seed=1, size=8)}
  questions_2 = {e["question"] for e in _entries("maze", 1, seed=2, size=8)}
  assert not questions_1 & questions_2


def test_entries_are_identical_in_another_process():
  """A fresh interpreter with another hash seed generates byte-identical entries."""
  code = ("import json; from rl.rewards import puzzles; print(json.dumps({t: puzzles.make(t, "
          "size=1, seed=3, difficulty=1) for t in puzzles.TASKS}, sort_keys=True))")
  env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(REPO_ROOT))
  result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, check=True,
                          capture_output=True, text=True, timeout=60)
  here = {t: puzzles.make(t, size=1, seed=3, difficulty=1) for t in puzzles.TASKS}
  assert json.loads(result.stdout) == json.loads(json.dumps(here, sort_keys=True))


def test_arithmetic_prompts_are_short_and_the_knob_grows_them():
  """arithmetic questions look like "12+7*3=", answers are plain integers, and level d has
  2 + d//2 operands of at most 1 + (d+1)//2 digits (only + at level 0, * from level 2)."""
  for level in range(puzzles.TASKS["arithmetic"].levels):
    for entry in _entries("arithmetic", level, size=20):
      question = entry["question"]
      assert question.endswith("=") and " " not in question
      int(entry["answer"])
      operands = question[:-1].replace("*", "+").replace("-", "+").split("+")
      assert len(operands) == 2 + level // 2
      assert max(len(o) for o in operands) <= 1 + (level + 1) // 2
      if level == 0:
        assert set(question[:-1]) <= set("0123456789+")
  assert puzzles.score(_entries("arithmetic", 2)[0], "") == 0.0
  assert any("*" in e["question"] for e in _entries("arithmetic", 2, size=20))


def test_addition_level_sets_the_operand_digits():
  """addition level d: "a+b=" with a, b of at most 2 + d digits, the worked solution the
  answer's digits from the ones place up."""
  for level in range(puzzles.TASKS["addition"].levels):
    entries = _entries("addition", level, size=50)
    for entry in entries:
      a, b = entry["question"][:-1].split("+")
      assert int(entry["answer"]) == int(a) + int(b)
      assert entry["solution"] == f"{entry['answer'][::-1]} Answer: {entry['answer']}"
    assert max(len(o) for e in entries for o in e["question"][:-1].split("+")) == 2 + level


def test_knights_knaves_solution_is_unique_under_our_own_evaluation():
  """Each knights_knaves entry has exactly one consistent assignment, and it is the gold."""
  for entry in _entries("knights_knaves", 3, size=5):
    assert puzzle_verifiers.knights_knaves_solutions(entry["statements"]) == [tuple(entry["solution"])]


# ---------------------------------------------------------------------------------------------
# Near-misses: reasoning-gym's scorer rewards them, ours does not
# ---------------------------------------------------------------------------------------------

def test_puzzle24_numbers_not_given_and_truncation():
  """"6*4*1*1" (numbers not given) and "7*7/2*1" (24.5, truncated by int()) pass reasoning-gym's
  puzzle24 scorer; ours wants the given four numbers and exactly 24."""
  entry = next(e for e in _entries("puzzle24", 2, size=5) if sorted(e["numbers"]) != [1, 1, 4, 6])
  for answer in ("6*4*1*1", "7*7/2*1"):
    assert _rg_score("puzzle24", answer, {"metadata": {"numbers": entry["numbers"]}}) == 1.0
    assert puzzles.score(entry, answer) == 0.0


def test_countdown_decimals_powers_and_factorials():
  """reasoning-gym's countdown reads "2.5" as the numbers 2 and 5 and evaluates **, ! with sympy;
  ours accepts only integer literals and + - * /."""
  base = _entries("countdown", 2, size=1)[0]
  for answer, numbers, target in (("2.5*4*100", [2, 5, 4, 100], 1000),
                                  ("10**3*2/2", [10, 3, 2, 2], 1000),
                                  ("4!*(3-2)", [4, 3, 2], 24)):
    rg_entry = {"metadata": {"numbers": numbers, "target": target}}
    assert _rg_score("countdown", answer, rg_entry) == 1.0
    assert puzzles.score(dict(base, numbers=numbers, target=target), answer) == 0.0


def test_countdown_rules_of_our_statement():
  """Countdown: a sub-multiset of the numbers is fine, reusing one or inventing one is not."""
  entry = dict(_entries("countdown", 2, size=1)[0], numbers=[25, 4, 3, 7, 7], target=100)
  assert puzzles.score(entry, "25*4") == 1.0
  assert puzzles.score(entry, "(7+7+3+4-21)+25*4") == 0.0  # 21 was not given
  assert puzzles.score(entry, "25*(3+7-3-3)") == 0.0  # 3 used twice
  assert puzzles.score(entry, "100") == 0.0


def test_expression_verifier_details():
  """Exact arithmetic: "= 24" suffix and unary minus accepted; floats, hex, //, division by
  zero, operators the level did not allow, and another right-hand side rejected."""
  entry = dict(_entries("puzzle24", 2, size=1)[0], numbers=[8, 3, 8, 3])
  assert puzzles.score(entry, "8/(3-8/3)") == 1.0  # 24 only through the fraction 1/3
  assert puzzles.score(entry, "8/(3-8/3) = 24") == 1.0
  assert puzzles.score(entry, "-(8/(8/3-3))") == 1.0
  for wrong in ("8/(3-8/3) = 25", "8//(3-8//3)", "8/(3-8/3)+0*3.0", "0x18", "24.0",
                "8*3/(3-3)+8", "8*3+8-8*3/3*3/3*3", "8/(3-8/3)=24=24"):
    assert puzzles.score(entry, wrong) == 0.0, wrong
  no_division = dict(entry, operators=["+", "-", "*"])
  assert puzzles.score(no_division, "8/(3-8/3)") == 0.0


def test_maze_substring_partial_credit():
  """reasoning-gym's maze scorer gives len(gold)/len(answer) when the gold is a substring
  ("7" inside "17"); ours compares the integer with its own BFS."""
  entry = _entries("maze", 2, size=1)[0]
  wrong = "1" + entry["answer"]
  assert _rg_score("maze", wrong, {"answer": entry["answer"]}) > 0.3
  assert puzzles.score(entry, wrong) == 0.0
  assert puzzles.score(entry, str(int(entry["answer"]) + 1)) == 0.0
  assert puzzles.score(entry, entry["answer"] + " steps or more") == 0.0


@pytest.mark.parametrize("task", ["sudoku", "mini_sudoku"])
def test_sudoku_partial_credit_for_broken_grid(task):
  """Swapping two cells of one row breaks the grid; reasoning-gym still pays ~0.8, ours 0."""
  entry = _entries(task, 1, size=1)[0]
  rows = [row.split() for row in entry["answer"].splitlines()]
  rg_entry = {"answer": entry["answer"],
              "metadata": {"solution": [[int(x) for x in row] for row in rows]}}
  rows[0][0], rows[0][1] = rows[0][1], rows[0][0]
  wrong = "\n".join(" ".join(row) for row in rows)
  assert _rg_score(task, wrong, rg_entry) > 0.7
  assert puzzles.score(entry, wrong) == 0.0
  assert puzzles.score(entry, entry["question"]) == 0.0  # the unsolved puzzle itself


def test_sudoku_rejects_a_valid_grid_that_ignores_the_clues():
  """A valid sudoku grid that contradicts a clue is wrong."""
  entry = _entries("sudoku", 0, size=1)[0]
  relabel = {str(d): str(d % 9 + 1) for d in range(1, 10)}  # still a valid grid, other digits
  other = "".join(relabel.get(ch, ch) for ch in entry["answer"])
  assert puzzles.score(entry, other) == 0.0


def test_knights_knaves_partial_credit_and_hedges():
  """One wrong role earns reasoning-gym's partial credit (0.3 + 0.7 * right/all); ours gives 0,
  also to hedges, missing inhabitants and contradictions."""
  entry = _entries("knights_knaves", 1, size=1)[0]
  knight, knave = entry["roles"]
  names, solution = entry["names"], entry["solution"]

  def says(roles):
    return ", ".join(f"{n} is a {r}" for n, r in zip(names, roles))

  right = [knight if s else knave for s in solution]
  flipped = [knave if right[0] == knight else knight] + right[1:]
  assert puzzles.score(entry, says(right)) == 1.0
  assert puzzles.score(entry, says(right).upper()) == 1.0
  rg_entry = {"answer": entry["answer"]}
  assert _rg_score("knights_knaves", says(flipped), rg_entry) > 0.5
  assert puzzles.score(entry, says(flipped)) == 0.0
  hedge = says(right).replace(f"is a {right[0]}", f"is a {knight} or a {knave}", 1)
  assert puzzles.score(entry, hedge) == 0.0
  assert puzzles.score(entry, says(right[:-1])) == 0.0
  assert puzzles.score(entry, says(right) + ", or the other way round") == 0.0
  assert puzzles.score(entry, says(right) + f", {names[0]} is a {flipped[0]}") == 0.0
  assert puzzles.score(entry, says(right).replace(" is a ", " is not a ", 1)) == 0.0


def test_zebra_other_names_and_hedges():
  """Zebra: only the gold name (any case) scores; another name or a list of names does not."""
  entry = _entries("zebra", 1, size=1)[0]
  gold = entry["answer"]
  assert puzzles.score(entry, gold.upper() + ".") == 1.0
  for wrong in (gold + " or bob", "bob" if gold != "bob" else "alice", f"{gold}, {gold}x"):
    assert puzzles.score(entry, wrong) == 0.0


def test_n_queens_scorer_executes_model_output():
  """reasoning-gym's n_queens scorer eval()s the answer: a list comprehension that rebuilds the
  board earns 0.5 there. Ours never runs it and scores 0; moved given queens, a missing row and
  queens sharing a diagonal score 0."""
  entry = _entries("n_queens", 2, size=1)[0]
  code = f"[row.split() for row in {entry['answer']!r}.splitlines()]"
  rg_entry = {"metadata": {"valid_answers": [entry["answer"]]}}
  assert _rg_score("n_queens", code, rg_entry) == 0.5
  assert puzzles.score(entry, code) == 0.0
  rows = entry["answer"].splitlines()
  assert puzzles.score(entry, "\n".join(rows[1:] + rows[:1])) == 0.0  # shifted: attacks/loses clue
  assert puzzles.score(entry, "\n".join(rows[:-1])) == 0.0
  n = len(rows)
  empty = dict(entry, puzzle=["_" * n] * n)
  assert puzzles.score(empty, entry["answer"]) == 1.0
  for diagonal in (lambda r: r, lambda r: n - 1 - r):  # one queen per row and column, same diagonal
    board = "\n".join(" ".join("Q" if c == diagonal(r) else "_" for c in range(n))
                      for r in range(n))
    assert puzzles.score(empty, board) == 0.0


def test_graph_color_wrong_colourings():
  """A monochrome edge, a missing or extra vertex, a colour outside the options or JSON true
  score 0 (reasoning-gym pays 0.01 for any parsable wrong colouring)."""
  entry = next(e for e in _entries("graph_color", 1, size=5) if e["edges"])
  coloring = json.loads(entry["answer"])
  u, v = entry["edges"][0]
  clash = dict(coloring, **{str(u): coloring[str(v)]})
  rg_entry = {"metadata": {"puzzle": {"vertices": entry["vertices"], "edges": entry["edges"],
                                      "color_options": entry["colors"]}}}
  assert _rg_score("graph_color", json.dumps(clash), rg_entry) > 0
  assert puzzles.score(entry, json.dumps(clash)) == 0.0
  missing = {k: c for k, c in coloring.items() if k != str(u)}
  for wrong in (missing, dict(coloring, extra=1), dict(coloring, **{str(u): 7}),
                dict(coloring, **{str(u): True})):
    assert puzzles.score(entry, json.dumps(wrong)) == 0.0


def test_arithmetic_near_misses():
  """Arithmetic: off by one, a decimal, an extra digit and an expression all score 0."""
  entry = _entries("arithmetic", 3, size=1)[0]
  gold = int(entry["answer"])
  for wrong in (str(gold + 1), str(gold - 1), f"{gold}.0", f"{gold}0" if gold else "1",
                entry["question"] + str(gold), entry["question"][:-1]):
    assert puzzles.score(entry, wrong) == 0.0


# ---------------------------------------------------------------------------------------------
# Malicious input
# ---------------------------------------------------------------------------------------------

def test_malicious_inputs_score_zero_quickly_without_running(tmp_path):
  """Code, huge powers, deep nesting and huge unbalanced text score 0 in well under a second for
  every task, and the code is never executed."""
  marker = tmp_path / "pwned"
  hostile = [
      f"__import__('os').system('touch {marker}')",
      f"\\boxed{{__import__('os').system('touch {marker}')}}",
      f"Answer: (lambda: open('{marker}', 'w'))()",
      "9**9**9", "2**2**2**2**2**2**2", "(" * 100 + "24" + ")" * 100,
      "(" * 50_000 + "24" + ")" * 50_000, "-" * 150 + "24", "[" * 100_000, "{" * 100_000,
      "\\boxed{" * 30_000, "9" * 199 + "/" + "9" * 199, "1e99999", "24" + " " * 100_000,
  ]
  for task in puzzles.TASKS:
    entry = _entries(task, 0, size=1)[0]
    # The garbage collector is off while timing the scorer: late in the full suite this loop
    # once took 1.73 s for arithmetic (0.21 s alone), most likely a collection of the other
    # tests' heap landing inside it.
    gc.collect()
    gc.disable()
    try:
      start = time.perf_counter()
      for text in hostile:
        assert puzzles.score(entry, text) == 0.0, (task, text[:40])
      elapsed = time.perf_counter() - start
    finally:
      gc.enable()
    assert elapsed < 1.0, task
  assert not marker.exists()


def test_expression_evaluator_rejects_before_evaluating():
  """evaluate_expression returns None for powers and calls without computing them."""
  start = time.perf_counter()
  for text in ("9**9**9", "10**10**10", "abs(-24)", "(24).real", "24 if 1 else 0", "[24][0]"):
    assert puzzle_verifiers.evaluate_expression(text) is None
  assert time.perf_counter() - start < 0.1
  assert puzzle_verifiers.evaluate_expression("1/0") is None
  assert puzzle_verifiers.evaluate_expression("8/(3-8/3)").value == 24


# ---------------------------------------------------------------------------------------------
# Answer extraction
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("response, expected", [
    ("so \\boxed{1} then \\boxed{ {2} }", "{2}"),
    ("\\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
    ("\\boxed{7} and an unclosed \\boxed{8", "7"),
    ("Answer: 3\nmore thought\n**Answer:** 5 ", "5"),
    ("answer: `4*6`", "4*6"),
    ("  42\n", "42"),
    ("\\boxed {3} then \\fbox{4}", "4"),  # the math reward's box reader
])
def test_puzzle_answer(response, expected):
  """Last complete \\boxed{}, else after the last "Answer:", else the whole response, stripped."""
  assert extract.puzzle_answer(response) == expected


def test_carry_slips_forget_carries_only_where_there_are_some():
  """The imperfect teacher of the demo's SFT data: column arithmetic with every carry and
  borrow forgotten, on a `rate` fraction of the problems that need one; questions and gold
  answers stay true (the verifier checks the true value)."""
  assert [puzzles._uncarried(x, y, op) for x, op, y in [
      (58, "+", 67), (52, "-", 17), (17, "-", 52), (99, "+", 1), (3, "-", 10), (40, "+", 60),
      (12, "+", 13), (7, "-", 7)]] == [115, 45, -45, 90, -17, 100, 25, 0]
  entries = puzzles.make("arithmetic", size=2000, seed=0, difficulty=1)
  slipped = puzzles.with_carry_slips(entries, 0.7, seed=0)
  assert puzzles.with_carry_slips(entries, 0.7, seed=0) == slipped  # deterministic
  changed = [a != b for a, b in zip(entries, slipped)]
  carrying = [puzzles._uncarried(*map(int, e["expression"].replace("-", " - ").replace(
      "+", " + ").split()[::2]), "+" if "+" in e["expression"] else "-") != int(e["answer"])
      for e in entries]
  assert not any(c and not need for c, need in zip(changed, carrying))
  assert 0.6 < sum(changed) / sum(carrying) < 0.8
  for before, after in zip(entries, slipped):
    assert {k: v for k, v in after.items() if k != "solution"} == {
        k: v for k, v in before.items() if k != "solution"}
    assert puzzles.score(after, after["answer"]) == 1.0
  assert puzzles.with_carry_slips(entries, 0.0, seed=0) == entries
  with pytest.raises(ValueError, match="two-operand"):
    puzzles.with_carry_slips(puzzles.make("arithmetic", size=50, seed=0, difficulty=4), 0.5, 0)
