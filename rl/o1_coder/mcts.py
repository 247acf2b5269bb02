"""Monte Carlo tree search over reasoning steps (O1-Coder's reasoning-data synthesis), generic
over the problem so that it runs the same on a toy problem and on a policy model.

A `SearchProblem` gives four operations on immutable states:

  expand(state) -> [(step, child state), ...]   the candidate next steps (empty: a dead end)
  is_terminal(state) -> bool                    a finished path (for code: the code step)
  rollout(state, rng) -> terminal state         finish a path quickly (the default policy)
  evaluate(terminal state) -> float in [0, 1]   the terminal value, e.g. O1-Coder's
                                                v = a * compiled + (1 - a) * pass_rate

One simulation:

  select     from the root, while the node is expanded and has children, move to the child
             with the largest UCT score  Q(child) + c * sqrt(ln N(parent) / N(child)),
             an unvisited child scoring +inf (ties: the first child);
  expand     a reached leaf that is neither terminal nor expanded gets its children, and the
             simulation moves to the first of them (all are unvisited);
  rollout    from that node to a terminal state (a terminal node is its own rollout);
  evaluate   v = evaluate(terminal state);
  backup     every node on the path from the root gets N += 1 and W += v.

So Q = W / N is the mean of the returns backed up through a node, and every node satisfies
N = rollouts started at the node + sum of its children's N (`Node.rollouts`); the root starts
none unless it is itself terminal or a dead end.

Outputs (`SearchResult`): the tree, every simulation's path and value, the process records
D_process (every visited non-root node: its parent's state, its step, its Q and that Q
normalised over the tree, see `process_records`) and the correct full paths (terminal states
whose value reached `correct_value`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import numpy as np


class SearchProblem(Protocol):
  def expand(self, state: Any) -> Sequence[tuple[str, Any]]: ...

  def is_terminal(self, state: Any) -> bool: ...

  def rollout(self, state: Any, rng: np.random.Generator) -> Any: ...

  def evaluate(self, state: Any) -> float: ...


@dataclasses.dataclass(eq=False)
class Node:
  """A search-tree node: the state reached by `step` from `parent`."""

  state: Any
  step: str | None  # None at the root
  parent: Node | None
  terminal: bool
  children: list[Node] = dataclasses.field(default_factory=list)
  expanded: bool = False
  visits: int = 0  # N
  value_sum: float = 0.0  # W
  rollouts: int = 0  # simulations whose rollout started here

  @property
  def value(self) -> float:
    """Q = W / N (0 before the first visit)."""
    return self.value_sum / self.visits if self.visits else 0.0

  @property
  def depth(self) -> int:
    return 0 if self.parent is None else self.parent.depth + 1

  def path(self) -> list[Node]:
    """Nodes from the root to this one, both included."""
    nodes = [self]
    while nodes[-1].parent is not None:
      nodes.append(nodes[-1].parent)
    return nodes[::-1]

  def walk(self):
    """This node and every descendant, parents before children."""
    stack = [self]
    while stack:
      node = stack.pop()
      yield node
      stack.extend(reversed(node.children))


def uct_score(child: Node, parent_visits: int, exploration: float) -> float:
  """Q(child) + c * sqrt(ln N(parent) / N(child)); +inf for an unvisited child."""
  if child.visits == 0:
    return math.inf
  return child.value + exploration * math.sqrt(math.log(parent_visits) / child.visits)


def select_child(node: Node, exploration: float) -> Node:
  """The child with the largest UCT score (the first one on ties)."""
  scores = [uct_score(child, node.visits, exploration) for child in node.children]
  return node.children[int(np.argmax(scores))]


@dataclasses.dataclass(frozen=True)
class SearchConfig:
  """simulations: select-expand-rollout-backup rounds; exploration: the UCT constant c;
  correct_value: terminal values at or above it make a path "correct"."""

  simulations: int = 32
  exploration: float = 1.0
  correct_value: float = 1.0
  seed: int = 0

  def __post_init__(self):
    if self.simulations <= 0:
      raise ValueError(f"SearchConfig.simulations={self.simulations}: must be positive")
    if self.exploration < 0:
      raise ValueError(f"SearchConfig.exploration={self.exploration}: must be >= 0")


@dataclasses.dataclass(frozen=True)
class Simulation:
  """One simulation: the tree nodes it backed up through (root first), the terminal state its
  rollout reached, and that state's value."""

  path: tuple[Node, ...]
  terminal_state: Any
  value: float


@dataclasses.dataclass(frozen=True)
class ProcessRecord:
  """One step of D_process: the state before the step, the step, the state after it, its
  mean backed-up value Q, Q normalised over the tree, its visit count, and `sibling_group`
  (records with one group share a parent: their steps are alternatives)."""

  parent_state: Any
  step: str
  state: Any
  value: float
  normalised_value: float
  visits: int
  sibling_group: int


@dataclasses.dataclass
class SearchResult:
  root: Node
  simulations: list[Simulation]
  config: SearchConfig

  def process_records(self) -> list[ProcessRecord]:
    return process_records(self.root)

  def correct_paths(self) -> list[Any]:
    """Distinct terminal states (in order of discovery) whose value >= correct_value."""
    seen: dict[Hashable, Any] = {}
    for simulation in self.simulations:
      if simulation.value >= self.config.correct_value:
        seen.setdefault(simulation.terminal_state, simulation.terminal_state)
    return list(seen.values())

  def best_path(self) -> list[Node]:
    """From the root, repeatedly the most visited child (ties: the higher Q, then the first)."""
    node, path = self.root, [self.root]
    while node.children and any(child.visits for child in node.children):
      node = max(node.children, key=lambda child: (child.visits, child.value))
      path.append(node)
    return path


def search(problem: SearchProblem, root_state: Any, config: SearchConfig) -> SearchResult:
  """Runs `config.simulations` MCTS simulations from `root_state` (see the module docstring)."""
  rng = np.random.default_rng(config.seed)
  root = Node(root_state, None, None, terminal=problem.is_terminal(root_state))
  terminal_values: dict[int, float] = {}  # id(node) -> value: terminal nodes evaluate once
  simulations = []
  for _ in range(config.simulations):
    node = root
    while node.expanded and node.children:
      node = select_child(node, config.exploration)
    if not node.terminal and not node.expanded:
      node.expanded = True
      node.children = [Node(state, step, node, terminal=problem.is_terminal(state))
                       for step, state in problem.expand(node.state)]
      if node.children:
        node = node.children[0]
    if node.terminal:
      if id(node) not in terminal_values:
        terminal_values[id(node)] = float(problem.evaluate(node.state))
      terminal_state, value = node.state, terminal_values[id(node)]
    else:
      terminal_state = problem.rollout(node.state, rng)
      value = float(problem.evaluate(terminal_state))
    node.rollouts += 1
    path = node.path()
    for visited in path:
      visited.visits += 1
      visited.value_sum += value
    simulations.append(Simulation(tuple(path), terminal_state, value))
  return SearchResult(root, simulations, config)


def normalise_values(values: Sequence[float]) -> np.ndarray:
  """Min-max normalisation to [0, 1] over one tree, so that every tree's best step is 1 and
  its worst 0 whatever the absolute difficulty of its question; a tree whose values are all
  equal keeps them (clipped to [0, 1]): it carries no ranking to stretch."""
  values = np.asarray(values, np.float64)
  if values.size == 0:
    return values
  low, high = values.min(), values.max()
  if high - low < 1e-9:
    return np.clip(values, 0.0, 1.0)
  return (values - low) / (high - low)


def process_records(root: Node) -> list[ProcessRecord]:
  """D_process of one tree: a record per visited non-root node, parents before children."""
  nodes = [node for node in root.walk() if node.parent is not None and node.visits]
  normalised = normalise_values([node.value for node in nodes])
  groups: dict[int, int] = {}
  return [ProcessRecord(node.parent.state, node.step, node.state, node.value, float(norm),
                        node.visits, groups.setdefault(id(node.parent), len(groups)))
          for node, norm in zip(nodes, normalised)]
