"""Verifiers of the puzzle tasks (puzzles.py): does an extracted answer solve an entry?

reasoning-gym's scorers are not used: several are lenient (puzzle24 accepts numbers that were not
given and truncates with int(); countdown reads "2.5" as the numbers 2 and 5 and allows `**`, `%`
and `!`; most give partial credit to wrong answers) and some run model output through sympy's
parse_expr or eval(). Ours, one `verify_<task>(entry, answer) -> bool` per task:

* Expressions (puzzle24, countdown): a character allow-list, then Python's `ast` with only integer
  literals written in decimal, + - * /, unary minus and parentheses allowed, a bounded length, and
  exact `fractions.Fraction` evaluation (division by zero is wrong; nothing is ever truncated).
  The literals used must be the given numbers: all four exactly once (puzzle24), a sub-multiset
  (countdown, whose question says "each at most once").
* maze: the integer answer against our own BFS of the grid. sudoku / mini_sudoku: a full grid,
  every row, column and box a permutation, every clue kept (any valid completion counts).
  knights_knaves: one role per inhabitant, equal to the solution, which `make` re-derives by brute
  force and checks is unique. zebra: the name, case-folded. n_queens: n non-attacking queens
  keeping the given ones. graph_color: a JSON map covering exactly the vertices, with allowed
  colours, no edge monochrome.

The generators use the same solvers (`evaluate_expression`, `maze_distance`,
`knights_knaves_solutions`) to compute or check their gold answers. Verifiers never raise on
model output, and the bounds below keep any answer to a few milliseconds.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import fractions
import itertools
import json
import re

MAX_EXPRESSION_CHARS = 200
MAX_JSON_CHARS = 4096

# ---------------------------------------------------------------------------------------------
# Exact arithmetic on an allow-listed expression tree
# ---------------------------------------------------------------------------------------------

# Characters an expression may contain at all: rejects names, calls, attributes, strings, floats
# and non-decimal literals (0x18) before Python's parser sees the text.
_EXPRESSION_CHARS = re.compile(r"[0-9+\-*/() ]*")
_BINARY_OPS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


@dataclasses.dataclass(frozen=True)
class Evaluation:
  """An expression's exact value and what it was built from."""

  value: fractions.Fraction
  literals: tuple[int, ...]  # the integers written in the expression, in order
  operators: frozenset[str]  # binary operators used


def evaluate_expression(text: str) -> Evaluation | None:
  """Exact value of an integer +-*/ expression, or None when it is not one (or divides by zero).

  Only decimal integer literals, the four binary operators, unary minus and parentheses are
  accepted; `**`, `//`, `%`, names and calls fail the tree walk without being evaluated.
  """
  text = text.replace("×", "*").replace("÷", "/").replace("−", "-").replace("\u00b7", "*")
  text = " ".join(text.split())
  if not text or len(text) > MAX_EXPRESSION_CHARS or not _EXPRESSION_CHARS.fullmatch(text):
    return None
  try:
    tree = ast.parse(text, mode="eval")
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    return None
  literals: list[int] = []
  operators: set[str] = set()

  def walk(node: ast.AST) -> fractions.Fraction | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
      literals.append(node.value)
      return fractions.Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
      operand = walk(node.operand)
      return None if operand is None else -operand
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
      left, right = walk(node.left), walk(node.right)
      if left is None or right is None:
        return None
      operators.add(_BINARY_OPS[type(node.op)])
      if isinstance(node.op, ast.Add):
        return left + right
      if isinstance(node.op, ast.Sub):
        return left - right
      if isinstance(node.op, ast.Mult):
        return left * right
      return None if right == 0 else left / right
    return None

  try:
    value = walk(tree.body)
  except RecursionError:
    return None
  if value is None:
    return None
  return Evaluation(value, tuple(literals), frozenset(operators))


def _split_target(text: str, target: int) -> str | None:
  """Drops a trailing "= target" (a common habit, and harmless); another right side is wrong."""
  if "=" not in text:
    return text
  left, _, right = text.rpartition("=")
  if "=" in left or right.strip() != str(target):
    return None
  return left


def verify_expression(entry: dict, answer: str, use_all: bool) -> bool:
  expression = _split_target(answer, entry["target"])
  if expression is None:
    return False
  result = evaluate_expression(expression)
  if result is None or result.value != entry["target"]:
    return False
  if not result.operators <= set(entry["operators"]):
    return False
  used, given = collections.Counter(result.literals), collections.Counter(entry["numbers"])
  return used == given if use_all else not used - given


# ---------------------------------------------------------------------------------------------
# Verifiers, one per task
# ---------------------------------------------------------------------------------------------

def _integer(answer: str) -> int | None:
  answer = answer.strip()
  return int(answer) if re.fullmatch(r"[+-]?\d{1,60}", answer) else None


def verify_arithmetic(entry: dict, answer: str) -> bool:
  return _integer(answer) == evaluate_expression(entry["expression"]).value


def maze_distance(grid: list[str], start: str, goal: str, wall: str) -> int | None:
  """Shortest 4-connected path length from `start` to `goal` avoiding `wall` cells (BFS)."""
  cells = {(r, c): char for r, row in enumerate(grid) for c, char in enumerate(row)}
  source = next(p for p, char in cells.items() if char == start)
  distance = {source: 0}
  queue = collections.deque([source])
  while queue:
    r, c = queue.popleft()
    if cells[(r, c)] == goal:
      return distance[(r, c)]
    for step in ((r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)):
      if step in cells and cells[step] != wall and step not in distance:
        distance[step] = distance[(r, c)] + 1
        queue.append(step)
  return None


def verify_maze(entry: dict, answer: str) -> bool:
  distance = maze_distance(entry["grid"], entry["start"], entry["goal"], entry["wall"])
  return distance is not None and _integer(answer) == distance


# Layout characters a grid answer may carry besides its digits (rows, separators, box rules).
_GRID_LAYOUT = re.compile(r"[\s,;|\[\]+\-]")


def _parse_grid(answer: str, n: int) -> list[list[int]] | None:
  digits = _GRID_LAYOUT.sub("", answer)
  if len(digits) != n * n or any(d not in "123456789"[:n] for d in digits):
    return None
  return [[int(d) for d in digits[r * n:(r + 1) * n]] for r in range(n)]


def verify_sudoku(entry: dict, answer: str) -> bool:
  puzzle = entry["puzzle"]
  n = len(puzzle)
  box = {9: 3, 4: 2}[n]
  grid = _parse_grid(answer, n)
  if grid is None:
    return False
  if any(clue and clue != value for clue_row, row in zip(puzzle, grid)
         for clue, value in zip(clue_row, row)):
    return False
  full = set(range(1, n + 1))
  rows = grid
  columns = [[grid[r][c] for r in range(n)] for c in range(n)]
  boxes = [[grid[r][c] for r in range(br, br + box) for c in range(bc, bc + box)]
           for br in range(0, n, box) for bc in range(0, n, box)]
  return all(set(group) == full for group in itertools.chain(rows, columns, boxes))


# Knights and knaves. Statements are reasoning-gym's trees: ("telling-truth", i), ("lying", i),
# ("not", s), ("and", s...), ("or", s...), ("->", p, q), ("<=>", p, q).
def _truth(statement: list, honest: tuple[bool, ...]) -> bool:
  kind, args = statement[0], statement[1:]
  if kind == "telling-truth":
    return honest[args[0]]
  if kind == "lying":
    return not honest[args[0]]
  if kind == "not":
    return not _truth(args[0], honest)
  if kind == "and":
    return all(_truth(s, honest) for s in args)
  if kind == "or":
    return any(_truth(s, honest) for s in args)
  if kind == "->":
    return not _truth(args[0], honest) or _truth(args[1], honest)
  if kind == "<=>":
    return _truth(args[0], honest) == _truth(args[1], honest)
  raise ValueError(f"unknown statement kind {kind!r}")


def knights_knaves_solutions(statements: list) -> list[tuple[bool, ...]]:
  """Every assignment (True = knight) under which each inhabitant's statement is true iff honest."""
  return [honest for honest in itertools.product((True, False), repeat=len(statements))
          if all(_truth(s, honest) == honest[i] for i, s in enumerate(statements))]


_CLAUSE_SPLIT = re.compile(r"[,;.\n]|\band\b", re.IGNORECASE)
_CLAUSE = re.compile(r"(\w+)(?:\s+is\s+|\s*[:=-]\s*|\s+)(?:an?\s+)?(\w+)", re.IGNORECASE)


def verify_knights_knaves(entry: dict, answer: str) -> bool:
  # Every clause must be one "<name> is a <role>": hedges ("a knight or a knave"), negations and
  # extra prose fail, instead of being read for the assignment they happen to contain.
  names = {name.casefold(): i for i, name in enumerate(entry["names"])}
  knight, knave = (role.casefold() for role in entry["roles"])
  honest: dict[int, bool] = {}
  for clause in _CLAUSE_SPLIT.split(answer):
    if not clause.strip():
      continue
    match = _CLAUSE.fullmatch(clause.strip())
    if not match or match[1].casefold() not in names or match[2].casefold() not in (knight, knave):
      return False
    person, is_knight = names[match[1].casefold()], match[2].casefold() == knight
    if honest.setdefault(person, is_knight) != is_knight:
      return False
  return [honest.get(i) for i in range(len(names))] == entry["solution"]


def verify_zebra(entry: dict, answer: str) -> bool:
  return answer.strip().strip("\"'.").strip().casefold() == entry["answer"].casefold()


def verify_n_queens(entry: dict, answer: str) -> bool:
  puzzle = entry["puzzle"]
  n = len(puzzle)
  rows = ["".join(line.split()) for line in answer.splitlines() if line.strip()]
  if len(rows) != n or any(len(row) != n or set(row) - {"Q", "_"} for row in rows):
    return False
  queens = [(r, c) for r, row in enumerate(rows) for c, cell in enumerate(row) if cell == "Q"]
  given = [(r, c) for r, row in enumerate(puzzle) for c, cell in enumerate(row) if cell == "Q"]
  return (len(queens) == n and set(given) <= set(queens)
          and len({r for r, _ in queens}) == n and len({c for _, c in queens}) == n
          and len({r + c for r, c in queens}) == n and len({r - c for r, c in queens}) == n)


def verify_graph_color(entry: dict, answer: str) -> bool:
  if len(answer) > MAX_JSON_CHARS:
    return False
  try:
    coloring = json.loads(answer)
  except (ValueError, RecursionError):
    return False
  if not isinstance(coloring, dict) or set(coloring) != {str(v) for v in entry["vertices"]}:
    return False
  # type() rather than isinstance: JSON true would otherwise pass as colour 1.
  if any(type(c) is not int or c not in entry["colors"] for c in coloring.values()):
    return False
  return all(coloring[str(u)] != coloring[str(v)] for u, v in entry["edges"])

