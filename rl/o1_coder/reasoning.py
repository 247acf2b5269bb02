"""Reasoning-data synthesis with a policy model: the O1-Coder search problem over pseudocode
steps, sampled through the rollout engine and scored in the sandbox.

A state is the task plus the steps so far (`ReasoningState`). Expanding a state asks the policy
for `branching` continuations of each allowed action (the action marker is written into the
context and the policy writes the rest of the step): the first step is a plan, then a
refinement or the code (the code only after `min_refines` refinements, and no more than
`max_refines` of them). A plan or refinement step ends at its
newline; the code step ends at end-of-sequence. A rollout lets the policy write the rest of the
path in one go. The terminal value is O1-Coder's v = a * compiled + (1 - a) * pass_rate of the
code on the task's tests (`rl/rewards/code.py`, in the sandbox); a path without code is worth 0.

`synthesise` runs `rl/o1_coder/mcts.py` on each task and returns the trees, from which come
D_process (`TaskProcessRecord`s) and the correct full paths.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from rl.rollout import engine as rollout_lib
from rl.rollout import trajectories
from rl.rewards import code as code_reward
from rl.o1_coder import mcts
from rl.o1_coder.tasks import (CODE, PLAN, REFINE, CodingTask, action_of, join_steps,
                             program_of, split_steps)


_MARKER_TOKENS = 10  # room for an action marker after a context


@dataclasses.dataclass(frozen=True)
class ReasoningState:
  """The task's prompt and the steps written so far (hashable: paths are deduplicated)."""

  prompt: str
  steps: tuple[str, ...] = ()

  @property
  def context(self) -> str:
    """The text the policy continues: prompt, then each step on its own line(s)."""
    return self.prompt + "".join(step + "\n" for step in self.steps)

  def response(self) -> str:
    return join_steps(self.steps)


class PolicySampler:
  """Samples text continuations from a policy through the rollout engine.

  Every call uses one fixed prompt width (`max_prompt_len`), so the engine compiles once per
  row count; calls draw from successive RNG streams of `seed`.
  """

  def __init__(self, policy, tokenizer, *, max_prompt_len: int = 192, max_new_tokens: int = 96,
               max_line_tokens: int = 48, temperature: float = 1.0, seed: int = 0):
    self.graphdef, self.state = nnx.split(policy)
    self.tokenizer = tokenizer
    self.newline_id = tokenizer.encode("\n")[0]
    self.max_line_tokens = max_line_tokens
    self.config = rollout_lib.RolloutConfig(
        max_new_tokens=max_new_tokens, temperature=temperature, greedy=temperature == 0,
        stop_ids=tuple(tokenizer.stop_ids), max_prompt_len=max_prompt_len,
        pad_id=tokenizer.pad_id)
    self.rng = jax.random.key(seed)
    self.calls = 0

  def fits(self, context: str, reserve: int = 0) -> bool:
    """Whether `context` plus `reserve` more tokens fits the fixed prompt width."""
    return len(self.tokenizer.encode(context)) + reserve <= self.config.max_prompt_len

  def sample(self, contexts: Sequence[str], num_samples: int, *,
             one_line: Sequence[bool] | None = None) -> list[list[str]]:
    """`num_samples` continuations of each context (a one-line context stops at its newline,
    which is not returned, or after `max_line_tokens`): [len(contexts)][num_samples] strings.
    Every context must fit (`fits`)."""
    one_line = one_line or [False] * len(contexts)
    prompts = [self.tokenizer.encode(context) for context in contexts]
    stop_ids = [[self.newline_id] if line else [] for line in one_line]
    limits = [min(self.max_line_tokens, self.config.max_new_tokens) if line
              else self.config.max_new_tokens for line in one_line]
    rng = jax.random.fold_in(self.rng, self.calls)
    self.calls += 1
    traj = trajectories.generate(self.graphdef, self.state, prompts, rng, self.config,
                                 num_samples=num_samples, stop_ids=stop_ids,
                                 max_new_tokens=limits)
    tokens = np.asarray(traj.tokens)
    mask = np.asarray(traj.response_mask).astype(bool)
    texts = [self.tokenizer.decode(tokens[row][mask[row]]) for row in range(len(tokens))]
    texts = [text[:-1] if text.endswith("\n") else text for text in texts]
    return [texts[i * num_samples:(i + 1) * num_samples] for i in range(len(contexts))]


class CodeReasoningProblem:
  """`mcts.SearchProblem` for one coding task (see the module docstring); `cases` are the
  (stdin, expected stdout) tests of the terminal value (default: 4 trusted generator cases)."""

  def __init__(self, task: CodingTask, sampler: PolicySampler, *,
               cases: Sequence[tuple[str, str]] | None = None, compile_weight: float = 0.2,
               branching: int = 3,
               min_refines: int = 1, max_refines: int = 1, workers: int = 2):
    if not 0 <= min_refines <= max_refines:
      raise ValueError(f"need 0 <= min_refines ({min_refines}) <= max_refines ({max_refines})")
    self.task = task
    self.sampler = sampler
    cases = task.test_cases(4, seed=0) if cases is None else cases
    self.problem = code_reward.CodeProblem(tests=tuple(
        code_reward.StdioTest(stdin, expected) for stdin, expected in cases), timeout_s=2.0)
    self.compile_weight = compile_weight
    self.branching = branching
    self.min_refines = min_refines
    self.max_refines = max_refines
    self.workers = workers
    self.values: dict[str, float] = {}  # program -> terminal value (grading is deterministic)

  def root(self) -> ReasoningState:
    return ReasoningState(self.task.prompt)

  def is_terminal(self, state: ReasoningState) -> bool:
    """A code step ends a path; so do the step budget and a context too long to continue."""
    return bool(state.steps) and (action_of(state.steps[-1]) == CODE
                                  or len(state.steps) >= 2 + self.max_refines
                                  or not self.sampler.fits(state.context, _MARKER_TOKENS))

  def actions(self, state: ReasoningState) -> list[str]:
    if not state.steps:
      return [PLAN]
    refines = sum(action_of(step) == REFINE for step in state.steps)
    return ([REFINE] if refines < self.max_refines else []) + (
        [CODE] if refines >= self.min_refines else [])

  def expand(self, state: ReasoningState) -> list[tuple[str, ReasoningState]]:
    actions = self.actions(state)
    samples = self.sampler.sample([state.context + action + ("\n" if action == CODE else " ")
                                   for action in actions], self.branching,
                                  one_line=[action != CODE for action in actions])
    children: dict[str, ReasoningState] = {}
    for action, texts in zip(actions, samples):
      for text in texts:
        step = action + ("\n" if action == CODE else " ") + text
        children.setdefault(step, ReasoningState(state.prompt, state.steps + (step,)))
    return list(children.items())

  def rollout(self, state: ReasoningState, rng: np.random.Generator) -> ReasoningState:
    del rng  # the policy's own sampling is the randomness
    if not self.sampler.fits(state.context):
      return state
    completion = self.sampler.sample([state.context], 1)[0][0]
    return ReasoningState(state.prompt, state.steps + tuple(split_steps(completion)))

  def evaluate(self, state: ReasoningState) -> float:
    program = program_of(state.steps)
    if program is None:
      return 0.0
    if program not in self.values:
      result = code_reward.grade(program, self.problem, workers=self.workers)
      self.values[program] = result.reward(self.compile_weight)
    return self.values[program]


@dataclasses.dataclass(frozen=True)
class TaskProcessRecord:
  """A D_process row: the task, the steps before this one, the step, and its values."""

  task: CodingTask
  previous_steps: tuple[str, ...]
  step: str
  value: float
  normalised_value: float
  visits: int
  sibling_group: tuple[int, int]  # (tree index, group within the tree)


def synthesise(tasks: Sequence[CodingTask], sampler: PolicySampler,
               search_config: mcts.SearchConfig, *,
               cases: Mapping[CodingTask, Sequence[tuple[str, str]]] | None = None,
               **problem_kwargs) -> list[mcts.SearchResult]:
  """One MCTS tree per task (seeded by `search_config.seed` plus the task's index), graded on
  `cases[task]` where given; `problem_kwargs` go to `CodeReasoningProblem`."""
  results = []
  for index, task in enumerate(tasks):
    problem = CodeReasoningProblem(task, sampler, cases=(cases or {}).get(task),
                                   **problem_kwargs)
    config = dataclasses.replace(search_config, seed=search_config.seed + index)
    results.append(mcts.search(problem, problem.root(), config))
  return results


def process_dataset(tasks: Sequence[CodingTask], results: Sequence[mcts.SearchResult]
                    ) -> list[TaskProcessRecord]:
  """D_process of every tree, each record tagged with its task."""
  rows = []
  for tree, (task, result) in enumerate(zip(tasks, results)):
    for record in result.process_records():
      rows.append(TaskProcessRecord(task, record.parent_state.steps, record.step, record.value,
                                    record.normalised_value, record.visits,
                                    (tree, record.sibling_group)))
  return rows


def correct_paths(tasks: Sequence[CodingTask], results: Sequence[mcts.SearchResult]
                  ) -> list[tuple[CodingTask, str]]:
  """(task, full reasoning path text) for every distinct correct path found."""
  return [(task, state.response()) for task, result in zip(tasks, results)
          for state in result.correct_paths()]
