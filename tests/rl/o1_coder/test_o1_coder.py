"""Tests of rl/o1_coder: MCTS on a toy problem (finds the known best path; UCT invariants), the
generated tasks and the path format, D_process and sibling pairs, the PRM, the test-case
generator's data and metric, the aggregated reward, and the model-backed search problem."""

import functools
import math

import jax
import numpy as np
import pytest
from flax import nnx

from models.config import get_config
from models.tokenizer import load_tokenizer
from models.transformer import Transformer
from rl.rewards import sandbox
from rl.rewards.genrm import BradleyTerryRM
from rl.o1_coder import mcts, prm as prm_lib, reasoning, selfplay, tasks as tasks_lib, tcg

needs_sandbox = pytest.mark.skipif(
    sandbox.bwrap_path() is None,
    reason="bubblewrap (bwrap) is not installed; run `bash launch/setup_sandbox.sh` as root")

# ----------------------------------------------------------------------------- Toy problem


class DigitsProblem:
  """States are strings over `alphabet`, terminal at `length` characters; the value of a
  terminal string is the fraction of positions that match `target`. A dead end (no children)
  can be planted at `dead_end`."""

  def __init__(self, target="cab", alphabet="abc", dead_end=None):
    self.target, self.alphabet, self.dead_end = target, alphabet, dead_end
    self.expansions = 0

  def expand(self, state):
    self.expansions += 1
    if state == self.dead_end:
      return []
    return [(ch, state + ch) for ch in self.alphabet]

  def is_terminal(self, state):
    return len(state) >= len(self.target)

  def rollout(self, state, rng):
    while not self.is_terminal(state):
      state += self.alphabet[rng.integers(len(self.alphabet))]
    return state

  def evaluate(self, state):
    return sum(a == b for a, b in zip(state, self.target)) / len(self.target)


def test_mcts_finds_the_known_best_path():
  """Following the most visited child from the root spells the target; the target is among
  the correct paths and every correct path has value 1."""
  problem = DigitsProblem()
  result = mcts.search(problem, "", mcts.SearchConfig(simulations=150, exploration=0.7))
  assert [node.step for node in result.best_path()[1:]] == ["c", "a", "b"]
  assert result.correct_paths() == ["cab"]
  assert all(s.value == 1.0 for s in result.simulations if s.terminal_state == "cab")


def test_mcts_visit_and_value_invariants():
  """N = rollouts started here + sum of children's N; Q is the mean of the returns backed up
  through the node; the root's N is the simulation count; paths run parent to child."""
  config = mcts.SearchConfig(simulations=40, exploration=1.0, seed=3)
  result = mcts.search(DigitsProblem(), "", config)
  root = result.root
  assert root.visits == config.simulations and root.rollouts == 0
  returns = {}
  for simulation in result.simulations:
    assert simulation.path[0] is root
    for parent, child in zip(simulation.path, simulation.path[1:]):
      assert child.parent is parent and child in parent.children
    for node in simulation.path:
      returns.setdefault(id(node), []).append(simulation.value)
  for node in root.walk():
    assert node.visits == node.rollouts + sum(child.visits for child in node.children)
    if node.visits:
      assert node.value == pytest.approx(np.mean(returns[id(node)]))
      assert len(returns[id(node)]) == node.visits
    else:
      assert id(node) not in returns and node.value == 0.0
  # One rollout per simulation, each from a fresh child or a terminal node.
  assert sum(node.rollouts for node in root.walk()) == config.simulations


def test_mcts_selection_is_argmax_uct(monkeypatch):
  """Every selection the search makes picks argmax Q + c sqrt(ln N_parent / N_child), with
  unvisited children first (and the first on ties)."""
  exploration = 1.3
  original = mcts.select_child
  checked = []

  def checking_select(node, c):
    expected = []
    for child in node.children:
      if child.visits == 0:
        expected.append(math.inf)
      else:
        expected.append(child.value_sum / child.visits
                        + exploration * math.sqrt(math.log(node.visits) / child.visits))
    chosen = original(node, c)
    assert c == exploration
    assert node.children.index(chosen) == int(np.argmax(expected))
    checked.append(chosen)
    return chosen

  monkeypatch.setattr(mcts, "select_child", checking_select)
  mcts.search(DigitsProblem(), "", mcts.SearchConfig(simulations=30, exploration=exploration))
  assert len(checked) > 30  # deeper simulations select more than once


def test_uct_score_by_hand():
  """Hand-computed UCT scores; an unvisited child is +inf; c = 0 is greedy in Q."""
  parent = mcts.Node("", None, None, terminal=False, visits=10)
  a = mcts.Node("a", "a", parent, terminal=False, visits=4, value_sum=3.0)
  b = mcts.Node("b", "b", parent, terminal=False, visits=1, value_sum=0.5)
  parent.children = [a, b]
  assert mcts.uct_score(a, 10, 1.0) == pytest.approx(0.75 + math.sqrt(math.log(10) / 4))
  assert mcts.uct_score(b, 10, 1.0) == pytest.approx(0.5 + math.sqrt(math.log(10)))
  assert mcts.select_child(parent, 1.0) is b
  assert mcts.select_child(parent, 0.0) is a
  parent.children.append(mcts.Node("c", "c", parent, terminal=False))
  assert mcts.uct_score(parent.children[2], 10, 1.0) == math.inf
  assert mcts.select_child(parent, 0.0) is parent.children[2]


def test_dead_end_rolls_out_from_itself():
  """A node with no children is rolled out from itself and keeps the invariants."""
  result = mcts.search(DigitsProblem(dead_end="a"), "", mcts.SearchConfig(simulations=30))
  dead = next(node for node in result.root.children if node.step == "a")
  assert dead.visits >= 2 and dead.expanded and not dead.children
  assert dead.rollouts == dead.visits
  for node in result.root.walk():
    assert node.visits == node.rollouts + sum(child.visits for child in node.children)


def test_process_records_and_normalisation():
  """D_process: one record per visited non-root node, Q and the tree-normalised value, siblings
  grouped by parent."""
  result = mcts.search(DigitsProblem(), "", mcts.SearchConfig(simulations=40))
  records = result.process_records()
  visited = [node for node in result.root.walk() if node.parent is not None and node.visits]
  assert len(records) == len(visited)
  values = np.array([r.value for r in records])
  normalised = np.array([r.normalised_value for r in records])
  np.testing.assert_allclose(normalised, (values - values.min()) / (values.max() - values.min()))
  for r in records:
    assert r.state == r.parent_state + r.step
  groups = {}
  for r in records:
    groups.setdefault(r.sibling_group, set()).add(r.parent_state)
  assert all(len(parents) == 1 for parents in groups.values())
  np.testing.assert_allclose(mcts.normalise_values([0.3, 0.3]), [0.3, 0.3])
  np.testing.assert_allclose(mcts.normalise_values([1.0, 3.0, 2.0]), [0.0, 1.0, 0.5])


def test_search_config_checks(tmp_path):
  with pytest.raises(ValueError, match="simulations"):
    mcts.SearchConfig(simulations=0)
  with pytest.raises(ValueError, match="exploration"):
    mcts.SearchConfig(exploration=-1.0)
  from configs import o1_coder
  config = o1_coder.get_config("test")
  config.o1.search_tasks = 10_000  # more than there are training tasks
  with pytest.raises(ValueError, match="config.o1.search_tasks=10000: must be in \\[1, "):
    selfplay.run(config, str(tmp_path))


def test_self_play_refuses_the_fields_it_would_ignore():
  """Self-play has no dynamic sampling, reference model, critic, mesh or prompt files: a config
  that sets any of them is refused naming each such field, before anything is built; the fields
  it reads pass."""
  from configs import o1_coder
  config = o1_coder.get_config("test")
  selfplay.refuse_unread(config)
  config.rl.clip_high = 0.28
  config.optim.lr = 1e-3
  selfplay.refuse_unread(config)
  for field, value in [("rl.dynamic_sampling", True), ("rl.kl_coef", 0.04),
                       ("rl.kl_coef_per_domain", "code=0.1"), ("mesh.shape.fsdp", 2),
                       ("optim.offload_state", True), ("rollout.streaming.enabled", True),
                       ("data.train_files", "x.jsonl"), ("init_hf_dir", "/ckpt"),
                       ("rollout.top_p", 0.9), ("train.micro_batches", 2)]:
    bad = o1_coder.get_config("test")
    section, _, key = field.rpartition(".")
    node = bad
    for part in filter(None, section.split(".")):
      node = node[part]
    node[key] = value
    with pytest.raises(ValueError, match=f"does not read config\\.{field}="):
      selfplay.refuse_unread(bad)


# ----------------------------------------------------------------------------- Tasks, paths


def test_task_split_and_paths():
  """Train and held-out tasks are disjoint; a templated path splits into plan, refine and
  code steps and back; distractors are well-formed but change the code."""
  train, heldout = tasks_lib.split_tasks(seed=0)
  assert not set(train) & set(heldout) and len(train) + len(heldout) == len(tasks_lib.all_tasks())
  rng = np.random.default_rng(0)
  for task in train[:10]:
    trace = tasks_lib.reasoning_trace(task)
    steps = tasks_lib.split_steps(trace)
    assert [tasks_lib.action_of(s) for s in steps] == list(tasks_lib.ACTIONS)
    assert tasks_lib.join_steps(steps) == trace
    assert tasks_lib.program_of(steps) == task.reference_solution
    wrong = tasks_lib.split_steps(tasks_lib.distractor_trace(task, rng))
    assert len(wrong) == 3 and tasks_lib.program_of(wrong) != task.reference_solution
  assert tasks_lib.program_of(["[plan] x"]) is None
  assert tasks_lib.split_steps("junk\n[plan] p\nignored\n[code]\nx=1\ny=2") == [
      "[plan] p", "[code]\nx=1\ny=2"]


@needs_sandbox
def test_reference_solutions_pass_and_distractors_fail():
  """Reference programs reproduce the trusted outputs in the sandbox; distractors do not."""
  rng = np.random.default_rng(1)
  tasks = [tasks_lib.CodingTask("int", "max", 3), tasks_lib.CodingTask("string", "suffix", 2)]
  grader = selfplay.Grader({t: t.test_cases(3, seed=0) for t in tasks}, compile_weight=0.2)
  paths = [tasks_lib.split_steps(tasks_lib.reasoning_trace(t)) for t in tasks]
  paths += [tasks_lib.split_steps(tasks_lib.distractor_trace(t, rng)) for t in tasks]
  paths.append(["[plan] nothing"])
  values, passed = grader.grade(tasks + tasks + tasks[:1], paths)
  assert passed.tolist() == [True, True, False, False, False]
  assert values[:2].tolist() == [1.0, 1.0] and values[4] == 0.0
  assert all(0.2 <= v < 1.0 for v in values[2:4])  # compiles, fails some tests


# ----------------------------------------------------------------------------- Reward


def test_aggregated_reward_by_hand():
  """phi = alpha R + (1 - alpha) (1/m) sum_j gamma^(j-1) r_j over each row's real steps."""
  outcome = np.array([1.0, 0.0, 0.5])
  scores, mask = selfplay.pad_scores([np.array([0.5, 1.0]), np.array([0.2]), np.zeros(0)])
  phi = np.asarray(selfplay.aggregated_reward(outcome, scores, mask, alpha=0.25, gamma=0.5))
  np.testing.assert_allclose(phi, [0.25 + 0.75 * (0.5 + 0.5 * 1.0) / 2, 0.75 * 0.2, 0.125],
                             rtol=1e-6)
  assert selfplay.alpha_schedule(0, 5, start=1.0, end=0.5) == 1.0
  assert selfplay.alpha_schedule(4, 5, start=1.0, end=0.5) == 0.5
  assert selfplay.alpha_schedule(2, 5, start=1.0, end=0.5) == pytest.approx(0.75)
  assert selfplay.alpha_schedule(9, 5, start=1.0, end=0.5) == 0.5


# ----------------------------------------------------------------------------- TCG


def test_tcg_format_and_preference_pairs():
  """Cases round-trip through the text format; rejected responses keep the inputs and move
  every output to another input."""
  task = tasks_lib.CodingTask("string", "reverse_repeat", 2)  # distinct inputs, distinct outputs
  cases = task.test_cases(3, seed=0)
  assert tcg.parse_cases(tcg.format_cases(cases) + "\nnoise\nin: 1") == cases
  pairs = tcg.preference_pairs([task], per_task=2, cases=3, seed=0)
  assert len(pairs) == 2
  for pair in pairs:
    chosen, rejected = tcg.parse_cases(pair.chosen), tcg.parse_cases(pair.rejected)
    assert [i for i, _ in chosen] == [i for i, _ in rejected]
    assert all(a != b for (_, a), (_, b) in zip(chosen, rejected))
    assert sorted(o for _, o in chosen) == sorted(o for _, o in rejected)
    assert all(task.expected_output(i) == o for i, o in chosen)
    assert pair.prompt == tcg.tcg_prompt(task) and task.reference_solution in pair.prompt
  assert tcg.shuffled_outputs([("1", "x"), ("2", "x")], np.random.default_rng(0)) is None


@needs_sandbox
def test_tcg_metric_in_sandbox():
  """The reference reproduces matched cases (metric 1) and no shuffled ones (metric 0). The
  wall-clock limit is generous: a loaded CI host once took over 2 s to start one case."""
  tasks = [tasks_lib.CodingTask("int", "product", 1), tasks_lib.CodingTask("string", "repeat", 2)]
  matched = [t.test_cases(2, seed=5) for t in tasks]
  shuffled = [tcg.shuffled_outputs(cases, np.random.default_rng(0)) for cases in matched]
  metric = functools.partial(tcg.tcg_metric, timeout_s=60.0)
  assert metric(tasks, matched) == {"tcg_pass_rate": 1.0, "cases_per_task": 2.0,
                                    "tasks_all_valid": 1.0}
  assert metric(tasks, shuffled)["tcg_pass_rate"] == 0.0
  assert metric(tasks, [[], matched[1]])["cases_per_task"] == 1.0


# ----------------------------------------------------------------------------- PRM


def _synthetic_process_rows(tasks):
  """One tree per task: the right plan (value 1) and plans with the product and the maximum
  instead (value 0)."""
  rows = []
  for tree, task in enumerate(tasks):
    for op in (task.op, "product", "max"):
      step = tasks_lib.split_steps(tasks_lib.reasoning_trace(task, wrong_op=op))[0]
      value = 1.0 if op == task.op else 0.0
      rows.append(reasoning.TaskProcessRecord(task, (), step, value, value, 1, (tree, 0)))
  return rows


@pytest.mark.parametrize("mode", ["pointwise",
                                  pytest.param("pairwise", marks=pytest.mark.slow)])
def test_prm_beats_chance_on_heldout_sibling_pairs(mode):
  """A tiny scalar-head PRM fitted on D_process ranks held-out sibling steps above chance."""
  tokenizer = load_tokenizer("byte")
  tasks = [tasks_lib.CodingTask("int", op, k) for op in ("sum", "min") for k in range(10)]
  rows = _synthetic_process_rows(tasks)
  train, heldout = prm_lib.split_by_tree(rows, 0.3, seed=0)
  assert {r.sibling_group[0] for r in train}.isdisjoint({r.sibling_group[0] for r in heldout})
  model = Transformer(get_config("tiny_dense", head="scalar", tie_embeddings=False),
                      rngs=nnx.Rngs(params=0))
  prm, metrics = prm_lib.train_prm(model, tokenizer, train, heldout, mode=mode, steps=60,
                                   batch_size=16, lr=3e-3)
  assert metrics["heldout_pairs"] == 2 * len({r.sibling_group for r in heldout})
  assert metrics["heldout_pair_accuracy"] > 0.75, metrics
  path = ["[plan] k=0; read a b; out sum + k", "[refine] x"]
  scores = prm.step_scores([tasks[0].prompt], [path])
  assert scores[0].shape == (2,) and np.all((scores[0] > 0) & (scores[0] < 1))


# ----------------------------------------------------------------------------- Policy, models


def test_policy_warm_start_fine_tunes_on_dplus(monkeypatch):
  """O1-Coder section 3.3: the policy is initialised by SFT on D+, the search's correct paths:
  the fine-tuning data is exactly D+ (prompt, path) pairs, the policy's loss on them falls and
  its parameters move; an empty D+ leaves the policy unchanged."""
  from configs import o1_coder
  config = o1_coder.get_config("test")
  tokenizer = load_tokenizer(config.tokenizer)
  policy = selfplay.SelfPlayPolicy(selfplay._model(config, head="lm", seed=0), tokenizer, config)
  train, _ = tasks_lib.split_tasks(config.seed)
  correct = [(task, tasks_lib.join_steps(tasks_lib.split_steps(tasks_lib.reasoning_trace(task))))
             for task in train[:3]]
  seen = []
  finetune = selfplay.supervised_finetune
  monkeypatch.setattr(selfplay, "supervised_finetune",
                      lambda model, tok, pairs, **kw: seen.append(list(pairs))
                      or finetune(model, tok, pairs, **kw))
  warm, metrics = selfplay.warm_start_on_dplus(policy, correct, config)
  assert seen == [[(task.prompt, path) for task, path in correct]]
  assert metrics["dplus_paths"] == 3 and metrics["steps"] == config.o1.dplus_sft_steps
  assert metrics["train_loss_end"] < metrics["train_loss_start"]
  before, after = (jax.tree.leaves(p.state.params) for p in (policy, warm))
  assert not all(np.array_equal(a, b) for a, b in zip(before, after))
  same, metrics = selfplay.warm_start_on_dplus(policy, [], config)
  assert same is policy and metrics == {"dplus_paths": 0} and len(seen) == 1


def test_saved_models_reload(tmp_path):
  """save_model / load_model: the TCG, the PRM and the policy written under
  <workdir>/models come back with the saved parameters (not a fresh init: the saved ones are
  from other seeds), the latest save of a name wins, and the reloaded PRM scores steps as the
  saved one did."""
  from configs import o1_coder
  config = o1_coder.get_config("test")
  tokenizer = load_tokenizer(config.tokenizer)
  saved = {"tcg": selfplay._model(config, head="lm", seed=3),
           "prm": selfplay._model(config, head="scalar", seed=4),
           "policy": selfplay._model(config, head="lm", seed=5)}
  selfplay.save_model(str(tmp_path), "policy", selfplay._model(config, head="lm", seed=6))
  for step, (name, model) in enumerate(saved.items(), start=1):
    selfplay.save_model(str(tmp_path), name, model, step=step)
  for name, model in saved.items():
    loaded = nnx.state(selfplay.load_model(config, str(tmp_path), name), nnx.Param)
    fresh = nnx.state(selfplay._model(config, head=selfplay.MODEL_HEADS[name], seed=0),
                      nnx.Param)
    want = nnx.state(model, nnx.Param)
    same = [np.array_equal(a, b) for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(want))]
    assert len(same) == len(jax.tree.leaves(want)) and all(same), name
    assert not np.array_equal(jax.tree.leaves(loaded)[0], jax.tree.leaves(fresh)[0]), name
  prm = prm_lib.ProcessRewardModel(BradleyTerryRM(saved["prm"], tokenizer))
  path = ["[plan] k=0; read a b; out sum + k", "[refine] x"]
  task = tasks_lib.CodingTask("int", "sum", 0)
  np.testing.assert_array_equal(
      selfplay.load_prm(config, str(tmp_path), tokenizer).step_scores([task.prompt], [path])[0],
      prm.step_scores([task.prompt], [path])[0])
  with pytest.raises(FileNotFoundError, match="no saved prm model"):
    selfplay.load_model(config, str(tmp_path / "elsewhere"), "prm")


# ----------------------------------------------------------------------------- Model-backed


@pytest.fixture(scope="module")
def tiny_sampler():
  tokenizer = load_tokenizer("byte")
  policy = Transformer(get_config("tiny_dense"), rngs=nnx.Rngs(params=0))
  return reasoning.PolicySampler(policy, tokenizer, max_prompt_len=128, max_new_tokens=24,
                                 seed=0)


def test_code_reasoning_problem_expands_by_action(tiny_sampler):
  """Children carry the action marker of their step in plan -> refine -> code order; a path
  without code is terminal after the allowed steps, or once its context outgrows the prompt
  width, and is worth 0."""
  task = tasks_lib.CodingTask("int", "sum", 2)
  problem = reasoning.CodeReasoningProblem(task, tiny_sampler, branching=2)
  root = problem.root()
  assert problem.actions(root) == ["[plan]"]
  children = problem.expand(root)
  assert 1 <= len(children) <= 2
  for step, state in children:
    assert step.startswith("[plan] ") and "\n" not in step and state.steps == (step,)
  plan_state = children[0][1]
  assert problem.actions(plan_state) == ["[refine]"]
  refined = reasoning.ReasoningState(task.prompt, plan_state.steps + ("[refine] r",))
  assert problem.actions(refined) == ["[code]"]
  assert problem.is_terminal(reasoning.ReasoningState(task.prompt, ("[plan] p", "[refine] r",
                                                                    "[code]\nprint(1)")))
  assert problem.evaluate(refined) == 0.0
  finished = problem.rollout(plan_state, np.random.default_rng(0))
  assert finished.steps[:1] == plan_state.steps
  too_long = reasoning.ReasoningState(task.prompt, ("[plan] " + "x" * 200,))
  assert problem.is_terminal(too_long) and problem.evaluate(too_long) == 0.0
  assert problem.rollout(too_long, np.random.default_rng(0)) == too_long
  with pytest.raises(ValueError, match="min_refines"):
    reasoning.CodeReasoningProblem(task, tiny_sampler, min_refines=2, max_refines=1)


@needs_sandbox
def test_code_reasoning_problem_scores_code_in_sandbox(tiny_sampler):
  """v = a * compiled + (1 - a) * pass_rate: 1 for the reference, a for compiling wrong code,
  0 for code that does not compile."""
  task = tasks_lib.CodingTask("string", "prefix", 2)
  problem = reasoning.CodeReasoningProblem(task, tiny_sampler, cases=task.test_cases(3, seed=0),
                                           compile_weight=0.2)

  def state(code):
    return reasoning.ReasoningState(task.prompt, ("[plan] p", "[refine] r", "[code]\n" + code))

  assert problem.evaluate(state(task.reference_solution)) == 1.0
  assert problem.evaluate(state("print('zzzzzzz')")) == pytest.approx(0.2)
  assert problem.evaluate(state("print(")) == 0.0


@pytest.mark.slow
def test_o1_coder_pipeline_smoke(tmp_path, monkeypatch):
  """configs/o1_coder.py:test runs every stage end to end and reports its numbers; the policy's
  initialisation fine-tunes on exactly the first search's correct paths D+ (O1-Coder section
  3.3), from the bootstrap policy; the run's TCG, PRM and policy are saved and reload."""
  if sandbox.bwrap_path() is None:
    pytest.skip("needs the sandbox")
  import importlib.util
  spec = importlib.util.spec_from_file_location("o1_config", "configs/o1_coder.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config("test")
  found, finetuned = [], []
  correct_paths, finetune = reasoning.correct_paths, selfplay.supervised_finetune
  monkeypatch.setattr(reasoning, "correct_paths",
                      lambda *a: found.append(correct_paths(*a)) or found[-1])
  monkeypatch.setattr(selfplay, "supervised_finetune",
                      lambda model, tok, pairs, **kw: finetuned.append((list(pairs), kw))
                      or finetune(model, tok, pairs, **kw))
  results = selfplay.run(config, str(tmp_path))
  summary = results["summary"]
  assert 0.0 <= summary["tcg_pass_rate"] <= 1.0
  assert set(summary["pass_rate_before"]) >= {"heldout_greedy", "train_sampled"}
  assert (tmp_path / "results.json").exists()
  dplus = selfplay.dplus_pairs(found[0])
  assert results["iteration_0/warm_start_on_dplus"]["dplus_paths"] == len(dplus)
  # Calls: the bootstrap on templated paths, then (when the search found any) D+ alone.
  assert len(finetuned) == 1 + bool(dplus)
  if dplus:
    assert finetuned[1] == (dplus, dict(steps=config.o1.dplus_sft_steps,
                                        batch_size=config.o1.batch_size, lr=config.sft.lr,
                                        seed=config.seed + 1))
  tokenizer = load_tokenizer(config.tokenizer)
  for name in ("tcg", "policy"):
    assert isinstance(selfplay.load_model(config, str(tmp_path), name), Transformer)
  task = tasks_lib.CodingTask("int", "sum", 0)
  scores = selfplay.load_prm(config, str(tmp_path), tokenizer).step_scores(
      [task.prompt], [tasks_lib.split_steps(tasks_lib.reasoning_trace(task))])
  assert np.all((scores[0] > 0) & (scores[0] < 1))
