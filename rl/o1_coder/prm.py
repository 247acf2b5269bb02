"""The process reward model (PRM): a scalar-head model that scores one reasoning step in its
context, trained on D_process from the search trees (spec section 9).

Input: the task prompt and the previous steps (`ReasoningState.context`) followed by the step;
the score is the model's value at the step's last token, r = sigmoid(value) in (0, 1). Two
objectives:

  * point-wise: binary cross-entropy of sigmoid(value) against the step's normalised value
    (a soft label in [0, 1]);
  * pair-wise: Bradley-Terry `bt_loss(r_chosen, r_rejected)` on sibling steps (same parent,
    values differing by more than `margin`), chosen = the sibling with the higher value. This
    is rl/jobs/preference.py's `train_bt_rm` on those pairs.

Steps whose input exceeds the model's max_seq_len are left out (counted). Held-out quality is
the pairwise accuracy on sibling pairs of trees never trained on: the fraction where the PRM
scores the better sibling strictly higher (chance: 0.5).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models.tokenizer import pad_batch
from rl.config.validation import PRM_MODES
from rl.jobs.fitting import fit_objective
from rl.jobs.preference import PreferencePair, bt_accuracy, padded_width, train_bt_rm
from rl.rewards.genrm import BradleyTerryRM, at_last_token
from rl.o1_coder.reasoning import ReasoningState, TaskProcessRecord


def step_context(record: TaskProcessRecord) -> str:
  return ReasoningState(record.task.prompt, record.previous_steps).context


def sibling_pairs(records: Sequence[TaskProcessRecord], *, margin: float = 0.05
                  ) -> list[PreferencePair]:
  """Every pair of siblings whose values differ by more than `margin`, better one chosen."""
  groups: dict[tuple[int, int], list[TaskProcessRecord]] = {}
  for record in records:
    groups.setdefault(record.sibling_group, []).append(record)
  pairs = []
  for siblings in groups.values():
    for a, b in itertools.combinations(siblings, 2):
      if abs(a.value - b.value) > margin:
        better, worse = (a, b) if a.value > b.value else (b, a)
        pairs.append(PreferencePair(step_context(a), better.step, worse.step))
  return pairs


def split_by_tree(records: Sequence[TaskProcessRecord], heldout_fraction: float, seed: int
                  ) -> tuple[list[TaskProcessRecord], list[TaskProcessRecord]]:
  """(train, held-out) records, whole trees on each side (a tree's siblings never straddle)."""
  trees = sorted({record.sibling_group[0] for record in records})
  rng = np.random.default_rng(seed)
  heldout_trees = set(rng.permutation(trees)[:max(1, int(round(heldout_fraction * len(trees))))]
                      .tolist())
  train = [r for r in records if r.sibling_group[0] not in heldout_trees]
  heldout = [r for r in records if r.sibling_group[0] in heldout_trees]
  return train, heldout


@dataclasses.dataclass
class ProcessRewardModel:
  """A trained PRM: `step_scores` gives r_j = sigmoid(value) for every step of a path."""

  reward_model: BradleyTerryRM

  def step_scores(self, prompts: Sequence[str], paths: Sequence[Sequence[str]]
                  ) -> list[np.ndarray]:
    """Per path, the score of each of its steps given the steps before it: [m_i] arrays."""
    contexts, steps = [], []
    for prompt, path in zip(prompts, paths):
      for j, step in enumerate(path):
        contexts.append(ReasoningState(prompt, tuple(path[:j])).context)
        steps.append(step)
    values = self.reward_model.rewards(contexts, steps) if steps else np.zeros(0, np.float32)
    scores = 1.0 / (1.0 + np.exp(-values.astype(np.float64)))
    bounds = np.cumsum([0] + [len(path) for path in paths])
    return [scores[bounds[i]:bounds[i + 1]] for i in range(len(paths))]

  def pair_accuracy(self, pairs: Sequence[PreferencePair]) -> float:
    return bt_accuracy(self.reward_model, pairs) if pairs else float("nan")


def _pointwise_objective(params, graphdef, rest, batch):
  values_BT = nnx.merge(graphdef, params, rest)(batch["tokens"])
  logits = at_last_token(values_BT, batch["lengths"])
  loss = jnp.mean(optax.sigmoid_binary_cross_entropy(logits, batch["labels"]))
  return loss, {"mean_abs_error": jnp.mean(jnp.abs(jax.nn.sigmoid(logits) - batch["labels"]))}


def train_prm(model, tokenizer, train: Sequence[TaskProcessRecord],
              heldout: Sequence[TaskProcessRecord], *, mode: str = "pointwise",
              steps: int = 200, batch_size: int = 16, lr: float = 1e-3,
              weight_decay: float = 0.01, margin: float = 0.05, seed: int = 0,
              log_every: int = 100) -> tuple[ProcessRewardModel, dict[str, float]]:
  """Fits a scalar-head `model` on D_process; metrics include the held-out sibling-pair
  accuracy before (`heldout_pair_accuracy_start`) and after (`heldout_pair_accuracy`), and
  the pair counts."""
  if mode not in PRM_MODES:
    raise ValueError(f"PRM mode {mode!r}: must be one of {PRM_MODES}")
  start = ProcessRewardModel(BradleyTerryRM(model, tokenizer, batch_size=2 * batch_size))

  def fits(record: TaskProcessRecord) -> bool:
    rm = start.reward_model
    return len(rm.encode(step_context(record), record.step)) <= rm.max_len

  dropped = sum(not fits(r) for r in [*train, *heldout])
  train, heldout = [r for r in train if fits(r)], [r for r in heldout if fits(r)]
  train_pairs = sibling_pairs(train, margin=margin)
  heldout_pairs = sibling_pairs(heldout, margin=margin)
  counts = {"train_steps": len(train), "train_pairs": len(train_pairs),
            "heldout_pairs": len(heldout_pairs), "dropped_too_long": dropped}
  if mode == "pairwise":
    if not train_pairs:
      raise ValueError("pair-wise PRM: the training trees hold no sibling steps whose values "
                       f"differ by more than margin={margin}")
    reward_model, metrics = train_bt_rm(model, tokenizer, train_pairs, heldout_pairs,
                                        steps=steps, batch_size=batch_size, lr=lr,
                                        weight_decay=weight_decay, seed=seed,
                                        log_every=log_every)
    return ProcessRewardModel(reward_model), {
        **counts, "heldout_pair_accuracy_start": metrics["heldout_accuracy_start"],
        "heldout_pair_accuracy": metrics["heldout_accuracy"],
        "train_loss_start": metrics["train_loss_start"],
        "train_loss_end": metrics["train_loss_end"]}
  if not train:
    raise ValueError("point-wise PRM: no training records")
  sequences = [start.reward_model.encode(step_context(r), r.step) for r in train]
  data = {}
  data["tokens"], data["lengths"] = pad_batch(sequences, length=padded_width(sequences),
                                              pad_id=tokenizer.pad_id)
  data["labels"] = np.array([r.normalised_value for r in train], np.float32)
  accuracy_start = start.pair_accuracy(heldout_pairs)
  params, metrics = fit_objective("prm", _pointwise_objective, model, data, steps=steps,
                                  batch_size=batch_size, lr=lr, weight_decay=weight_decay,
                                  grad_clip=1.0, seed=seed, log_every=log_every)
  reward_model = BradleyTerryRM((start.reward_model.graphdef, params, start.reward_model.rest),
                                tokenizer, batch_size=2 * batch_size)
  prm = ProcessRewardModel(reward_model)
  return prm, {**counts, "heldout_pair_accuracy_start": accuracy_start,
               "heldout_pair_accuracy": prm.pair_accuracy(heldout_pairs),
               "train_loss_start": metrics["train_loss_start"],
               "train_loss_end": metrics["train_loss_end"]}
