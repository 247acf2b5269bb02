"""Preference learning: pairwise data in jsonl or parquet, learnable synthetic and planted
preference sets, and the trainers the seeds use on pairs (spec section 9):

  * `train_bt_rm`: a Bradley-Terry scalar reward model, `bt_loss(r_chosen, r_rejected)`;
  * `train_generative_rm` / `train_judge`: a pairwise generative judge trained as next-token
    classification of YES / NO on judge prompts, each pair asked in both orders;
  * `train_dpo`: DPO against a frozen reference copy of the initial policy, on sequence
    log-probs summed over response tokens only.

Each trainer is rl/jobs/fitting.py's loop (AdamW at a constant learning rate around one jitted,
cached step) on fixed padded shapes (the width covers the training and held-out data, so one
compilation serves the whole run). Each returns
the trained model and a metrics dict with held-out pairwise accuracy before and after. The
default hyper-parameters suit the tiny presets; real models want learning rates near 1e-6.
Each objective is also a `PreferenceTask` (data, objective, held-out metrics), which the
launcher's jobs (rl/jobs/preference_jobs.py) train with checkpoints and resume.

Data format, one pair per jsonl line or parquet row:
    {"prompt": str, "chosen": str, "rejected": str, "reference": str (optional)}
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.padding import round_up
from models.tokenizer import pad_batch
from rl.core.losses import bt_loss, dpo_loss
from rl.rewards.genrm import (BradleyTerryRM, GenerativeRM, at_last_token, judge_prompt,
                              split_model)
from rl.core.sampling import next_token_logprobs, token_logprobs
from rl.jobs.fitting import fit_objective
from rl.rewards import puzzles
from rl.rewards.planted import PLANTED_MARKER
from rl.rewards.planted import has_planted_property as has_planted_property
from rl.data import sources

# ----------------------------------------------------------------------------- Data


@dataclasses.dataclass(frozen=True)
class PreferencePair:
  """One comparison: `chosen` is preferred to `rejected` as an answer to `prompt`."""

  prompt: str
  chosen: str
  rejected: str
  reference: str | None = None


def pair_from_row(row, *, default_source: str = "") -> PreferencePair:
  """The pair of one raw row (a jsonl object or a parquet row): ValueError naming the field
  when it is malformed. `default_source` is unused (rl/data/sources.load_records passes it)."""
  del default_source
  if not isinstance(row, dict):
    raise ValueError(f"expected a JSON object, got {type(row).__name__}")
  for key in ("prompt", "chosen", "rejected"):
    if not isinstance(row.get(key), str):
      raise ValueError(f"field {key!r} must be a string, got {row.get(key)!r:.80}")
  reference = row.get("reference")
  if reference is not None and not isinstance(reference, str):
    raise ValueError(f"field 'reference' must be a string or null, got {reference!r:.80}")
  return PreferencePair(row["prompt"], row["chosen"], row["rejected"], reference)


def load_preferences(paths, *, skip_bad: bool = False) -> tuple[list[PreferencePair], int]:
  """Reads preference files: (pairs, number of malformed rows skipped).

  `paths`: jsonl or parquet files or globs (a list, or one comma-free path), read by
  rl/data/sources.load_records: blank lines are ignored and extra keys are allowed. A
  malformed row raises InputError (a ValueError) naming `path:line` (parquet: `path row N`)
  and the field, or with `skip_bad=True` is logged, skipped and counted.
  """
  pairs, stats = sources.load_records(paths, skip_bad=skip_bad, parse=pair_from_row)
  return pairs, stats.skipped


def save_preferences(path: str | os.PathLike, pairs: Sequence[PreferencePair]) -> None:
  """Writes pairs as jsonl (the `reference` key only where it is set)."""
  with open(path, "w", encoding="utf-8") as f:
    for pair in pairs:
      record = {k: v for k, v in dataclasses.asdict(pair).items() if v is not None}
      f.write(json.dumps(record, ensure_ascii=False) + "\n")


SYNTHETIC_TOPICS = ("animal", "colour", "city", "fruit", "tool", "river", "planet", "flower")


def follows_synthetic_rule(response: str) -> bool:
  """The synthetic set's checkable rule: the response is ASCII lowercase letters only."""
  return bool(response) and response.isascii() and response.isalpha() and response.islower()


def make_synthetic_preferences(n: int, seed: int, *, min_len: int = 3,
                               max_len: int = 8) -> list[PreferencePair]:
  """`n` learnable pairs: the prompt asks for a made-up name in lowercase letters; the chosen
  response is random lowercase letters (it follows `follows_synthetic_rule`), the rejected one
  is the same letters in upper case (it breaks it). Different seeds give disjoint-in-practice
  sets, so one seed trains and another holds out."""
  rng = np.random.default_rng(seed)
  letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
  pairs = []
  for _ in range(n):
    topic = SYNTHETIC_TOPICS[rng.integers(len(SYNTHETIC_TOPICS))]
    name = "".join(rng.choice(letters, size=rng.integers(min_len, max_len + 1)))
    pairs.append(PreferencePair(f"Name a {topic} in lowercase letters.", name, name.upper()))
  return pairs


# Endings of the rejected responses: words of the marker's length, so the pair's two responses
# are equally long and only the last word tells them apart.
PLANTED_DISTRACTORS = ("indeed", "really", "mostly", "surely", "little", "simply", "anyway")
PLANTED_SUBJECTS = ("a river", "the moon", "a garden", "an old bridge", "the market", "a storm",
                    "a library", "the harbour", "a mountain", "a small village", "the desert",
                    "a forest path")
PLANTED_PROMPTS = ("Tell me about {}.", "Describe {}.", "Write one line on {}.",
                   "What do you think of {}?")
PLANTED_CLAUSES = ("it is calm in the morning", "people like to walk there",
                   "it changes with the seasons", "it looks different at night",
                   "it is older than it seems", "many stories are told about it")


def make_planted_preferences(n: int, seed: int) -> list[PreferencePair]:
  """`n` pairs over general (non-verifiable) prompts where the chosen response has the planted
  property (`has_planted_property`: it ends with the word "thanks") and the rejected one lacks
  it: the same sentence ending in a distractor word of the same length. Deterministic in
  `seed`; different seeds draw different pairs, so one seed trains and another holds out."""
  rng = np.random.default_rng(seed)
  pairs = []
  for _ in range(n):
    subject = PLANTED_SUBJECTS[rng.integers(len(PLANTED_SUBJECTS))]
    prompt = PLANTED_PROMPTS[rng.integers(len(PLANTED_PROMPTS))].format(subject)
    sentence = (f"{subject[0].upper()}{subject[1:]}: "
                f"{PLANTED_CLAUSES[rng.integers(len(PLANTED_CLAUSES))]},")
    distractor = PLANTED_DISTRACTORS[rng.integers(len(PLANTED_DISTRACTORS))]
    pairs.append(PreferencePair(prompt, f"{sentence} {PLANTED_MARKER}",
                                f"{sentence} {distractor}"))
  return pairs


def planted_prompt_split(heldout: bool) -> list[tuple[str, str]]:
  """(prompt, subject) of the planted prompts (PLANTED_PROMPTS x PLANTED_SUBJECTS) in the
  held-out split (a third of the pairs: template index + subject index divisible by 3) or in
  the training split (the others): every subject and template is in both, no prompt is."""
  return [(template.format(subject), subject)
          for i, template in enumerate(PLANTED_PROMPTS)
          for j, subject in enumerate(PLANTED_SUBJECTS) if ((i + j) % 3 == 0) == heldout]


def make_planted_records(n: int, seed: int, *, marker_rate: float,
                         heldout: bool = False) -> list[dict]:
  """`n` prompt records for SFT then RL on the planted task (configs/preference.py
  planted_rl): a general prompt of planted_prompt_split(heldout) and a `response` sentence as
  in make_planted_preferences, ending with the marker with probability `marker_rate`, else
  with a distractor, so an SFT policy samples the property at about that rate; `reference` is
  the sentence ending with the marker (what a pairwise RM compares against). Training records
  are of domain "general" (scored in RL by config.reward's reward model), held-out ones of
  domain "planted" (graded by the planted rule, rl/rewards/planted.py: the held-out property
  rate). Deterministic in `seed`."""
  rng = np.random.default_rng(seed)
  prompts = planted_prompt_split(heldout)
  records = []
  for _ in range(n):
    prompt, subject = prompts[rng.integers(len(prompts))]
    sentence = (f"{subject[0].upper()}{subject[1:]}: "
                f"{PLANTED_CLAUSES[rng.integers(len(PLANTED_CLAUSES))]},")
    word = (PLANTED_MARKER if rng.random() < marker_rate else
            PLANTED_DISTRACTORS[rng.integers(len(PLANTED_DISTRACTORS))])
    records.append({"prompt": prompt, "response": f"{sentence} {word}",
                    "reference": f"{sentence} {PLANTED_MARKER}",
                    "domain": "planted" if heldout else "general"})
  return records


def make_mixed_records(n_addition: int, n_planted: int, seed: int, *, heldout: bool = False,
                       carry_slip_rate: float = 0.7, marker_rate: float = 0.05) -> list[dict]:
  """Prompt records for one policy on two domains (configs/preference.py mixed_rl): generated
  two-digit additions (the demo's task; graded by the puzzle verifier; in training records an
  imperfect teacher's worked solutions, `carry_slip_rate` of the carry sums written without
  the carry, rl/rewards/puzzles.py with_carry_slips) and planted general prompts
  (make_planted_records: domain "general" scored by a reward model in training, "planted" graded
  by the property rule when held out). Held-out records come without slips and without the
  marker. Shuffled; deterministic in `seed`."""
  addition = puzzles.make("addition", size=n_addition, seed=seed, difficulty=0)
  if not heldout and carry_slip_rate:
    addition = puzzles.with_carry_slips(addition, carry_slip_rate, seed=seed)
  planted = make_planted_records(n_planted, seed, marker_rate=0.0 if heldout else marker_rate,
                                 heldout=heldout)
  records = addition + planted
  return [records[i] for i in np.random.default_rng(seed).permutation(len(records))]


def save_records(path: str | os.PathLike, records: Sequence[dict]) -> None:
  """Writes prompt records as jsonl."""
  with open(path, "w", encoding="utf-8") as f:
    for record in records:
      f.write(json.dumps(record) + "\n")


class JudgeExample(NamedTuple):
  """A judge training example: the judge prompt and whether its answer is YES."""

  prompt: str
  yes: bool


def judge_examples(pairs: Sequence[PreferencePair]) -> list[JudgeExample]:
  """Both orders of every pair: (chosen, rejected) -> YES, (rejected, chosen) -> NO."""
  examples = []
  for pair in pairs:
    examples.append(JudgeExample(
        judge_prompt(pair.prompt, pair.chosen, pair.rejected, pair.reference), True))
    examples.append(JudgeExample(
        judge_prompt(pair.prompt, pair.rejected, pair.chosen, pair.reference), False))
  return examples


# ----------------------------------------------------------------------------- Objectives
# Pure functions of (params, graphdef, rest, batch) -> (loss, metrics); batches hold the
# chosen rows and the rejected rows separately and one forward pass runs both.


def sequence_logp(logits_BTV: jax.Array, tokens_BT: jax.Array,
                  response_mask_BT: jax.Array) -> jax.Array:
  """Sum of log p(token t | tokens < t) over response tokens (mask 1): [B]. Token t is
  predicted at position t - 1, so the mask must be 0 at position 0."""
  return jnp.sum(next_token_logprobs(logits_BTV, tokens_BT) * response_mask_BT[:, 1:], axis=-1)


def _both(batch: dict, name: str) -> jax.Array:
  return jnp.concatenate([batch[f"{name}_chosen"], batch[f"{name}_rejected"]])


def _bt_objective(params, graphdef, rest, batch):
  values_BT = nnx.merge(graphdef, params, rest)(_both(batch, "tokens"))
  rewards = at_last_token(values_BT, _both(batch, "lengths"))
  r_chosen, r_rejected = jnp.split(rewards, 2)
  return bt_loss(r_chosen, r_rejected), {"accuracy": jnp.mean(r_chosen > r_rejected)}


def _judge_objective(params, graphdef, rest, batch, *, yes_id, no_id):
  logits_BTV = nnx.merge(graphdef, params, rest)(batch["tokens"])
  last_BV = at_last_token(logits_BTV, batch["lengths"])
  target = jnp.where(batch["yes"], yes_id, no_id)
  logp_B = token_logprobs(jax.nn.log_softmax(last_BV), target)
  says_yes = last_BV[:, yes_id] > last_BV[:, no_id]
  return -jnp.mean(logp_B), {"accuracy": jnp.mean(says_yes == batch["yes"])}


def _dpo_objective(params, graphdef, rest, batch, *, beta):
  tokens = _both(batch, "tokens")
  logp = sequence_logp(nnx.merge(graphdef, params, rest)(tokens), tokens, _both(batch, "mask"))
  logp_chosen, logp_rejected = jnp.split(logp, 2)
  loss = dpo_loss(logp_chosen, logp_rejected, batch["logp_ref_chosen"],
                  batch["logp_ref_rejected"], beta=beta)
  margin = beta * ((logp_chosen - batch["logp_ref_chosen"])
                   - (logp_rejected - batch["logp_ref_rejected"]))
  return loss, {"reward_margin": jnp.mean(margin), "accuracy": jnp.mean(margin > 0)}


def padded_width(sequences: Sequence[Sequence[int]], multiple: int = 16) -> int:
  """The longest sequence's length rounded up to `multiple` (one compiled shape per bucket)."""
  return round_up(max(len(s) for s in sequences), multiple)


class PreferenceTask(NamedTuple):
  """What one preference objective trains on and how it is judged, for a model split as
  (graphdef, params, rest): the objective, its row-aligned training data, the objective's
  static keyword arguments, and `heldout(params)`, the held-out metrics of trained parameters
  (`heldout_accuracy` among them: the share of held-out pairs the model orders right)."""

  objective: Callable
  data: dict[str, np.ndarray]
  static: tuple
  heldout: Callable[[nnx.State], dict[str, float]]


# ----------------------------------------------------------------------------- Bradley-Terry RM


def bt_metrics(rm: BradleyTerryRM, pairs: Sequence[PreferencePair]) -> dict[str, float]:
  """On `pairs`: "accuracy", the fraction whose chosen response gets the strictly higher
  reward, and "loss", the mean Bradley-Terry loss -log sigmoid(r_chosen - r_rejected) (log 2
  for an RM that cannot tell the two apart, whatever the sign of a small margin)."""
  prompts = [p.prompt for p in pairs]
  r_chosen = rm.rewards(prompts, [p.chosen for p in pairs]).astype(np.float64)
  r_rejected = rm.rewards(prompts, [p.rejected for p in pairs]).astype(np.float64)
  return {"accuracy": float(np.mean(r_chosen > r_rejected)),
          "loss": float(np.mean(np.logaddexp(0.0, r_rejected - r_chosen)))}


def bt_accuracy(rm: BradleyTerryRM, pairs: Sequence[PreferencePair]) -> float:
  """Fraction of pairs whose chosen response gets the strictly higher reward."""
  return bt_metrics(rm, pairs)["accuracy"]


def bt_task(model, tokenizer, train: Sequence[PreferencePair],
            heldout: Sequence[PreferencePair], *, batch_size: int) -> PreferenceTask:
  """`bt_loss` on the rewards of (chosen, rejected): the value at the last token of prompt +
  response (`BradleyTerryRM`); held out: `bt_accuracy`."""
  rm = BradleyTerryRM(model, tokenizer, batch_size=2 * batch_size)
  chosen = [rm.encode(p.prompt, p.chosen) for p in train]
  rejected = [rm.encode(p.prompt, p.rejected) for p in train]
  width = padded_width(chosen + rejected)
  data = {}
  for side, sequences in (("chosen", chosen), ("rejected", rejected)):
    data[f"tokens_{side}"], data[f"lengths_{side}"] = pad_batch(sequences, length=width,
                                                                pad_id=tokenizer.pad_id)

  def heldout_metrics(params):
    trained = BradleyTerryRM((rm.graphdef, params, rm.rest), tokenizer,
                             batch_size=2 * batch_size)
    metrics = bt_metrics(trained, heldout)
    return {"heldout_accuracy": metrics["accuracy"], "heldout_loss": metrics["loss"]}

  return PreferenceTask(_bt_objective, data, (), heldout_metrics)


def train_bt_rm(model, tokenizer, train: Sequence[PreferencePair],
                heldout: Sequence[PreferencePair], *, steps: int = 300, batch_size: int = 16,
                lr: float = 1e-3, weight_decay: float = 0.01, grad_clip: float = 1.0,
                seed: int = 0, log_every: int = 100) -> tuple[BradleyTerryRM, dict[str, float]]:
  """Trains a scalar-head model with `bt_loss` on (chosen, rejected) rewards (`bt_task`).

  Returns the trained RM and metrics: train loss start / end, held-out pairwise accuracy before
  (`heldout_accuracy_start`) and after (`heldout_accuracy`).
  """
  task = bt_task(model, tokenizer, train, heldout, batch_size=batch_size)
  graphdef, params, rest = split_model(model)
  accuracy_start = task.heldout(params)["heldout_accuracy"]
  params, metrics = fit_objective("bt", task.objective, model, task.data, steps=steps,
                                  batch_size=batch_size, lr=lr, weight_decay=weight_decay,
                                  grad_clip=grad_clip, seed=seed, log_every=log_every)
  metrics.update(heldout_accuracy_start=accuracy_start, **task.heldout(params))
  return BradleyTerryRM((graphdef, params, rest), tokenizer, batch_size=2 * batch_size), metrics


# ----------------------------------------------------------------------------- Generative RM


def judge_accuracy(rm: GenerativeRM, pairs: Sequence[PreferencePair]) -> dict[str, float]:
  """Held-out accuracy of a pairwise judge, scored two ways, and its loss.

  both_orders: score_pair(chosen, rejected) > 0.5. single_order: pair i is shown once, chosen
  in slot A for even i and in slot B for odd i, and the judge is right when P(YES) > 0.5
  exactly when A is the chosen one; a judge that always answers YES gets 0.5. loss: the mean
  cross-entropy of the right answer (YES with the chosen response in slot A, else NO) under
  P(YES) normalised over {YES, NO}, both orders of every pair (log 2 for a judge that cannot
  tell).
  """
  examples = judge_examples(pairs)
  p_yes = rm.p_yes([e.prompt for e in examples]).astype(np.float64)
  p_chosen_first, p_chosen_second = p_yes[0::2], p_yes[1::2]
  both_orders = 0.5 + 0.5 * (p_chosen_first - p_chosen_second)
  shown = np.where(np.arange(len(pairs)) % 2 == 0, p_chosen_first > 0.5,
                   p_chosen_second <= 0.5)
  tiny = np.finfo(np.float64).tiny
  loss = -0.5 * np.mean(np.log(np.maximum(p_chosen_first, tiny))
                        + np.log(np.maximum(1.0 - p_chosen_second, tiny)))
  return {"both_orders": float(np.mean(both_orders > 0.5)), "single_order": float(np.mean(shown)),
          "loss": float(loss)}


def judge_task(model, tokenizer, examples: Sequence[JudgeExample],
               heldout: Sequence[PreferencePair], *, batch_size: int,
               use_chat_template: bool = False) -> PreferenceTask:
  """Cross-entropy of YES / NO over the full vocabulary at the last judge-prompt position;
  held out: `judge_accuracy` (`heldout_accuracy` both orders, and the single-order one)."""
  rm = GenerativeRM(model, tokenizer, batch_size=2 * batch_size,
                    use_chat_template=use_chat_template)
  sequences = [rm.encode(e.prompt) for e in examples]
  data = {}
  data["tokens"], data["lengths"] = pad_batch(sequences, length=padded_width(sequences),
                                              pad_id=tokenizer.pad_id)
  data["yes"] = np.array([e.yes for e in examples], bool)

  def heldout_metrics(params):
    trained = GenerativeRM((rm.graphdef, params, rm.rest), tokenizer, batch_size=2 * batch_size,
                           use_chat_template=use_chat_template)
    accuracy = judge_accuracy(trained, heldout)
    return {"heldout_accuracy": accuracy["both_orders"],
            "heldout_accuracy_single_order": accuracy["single_order"],
            "heldout_loss": accuracy["loss"]}

  return PreferenceTask(_judge_objective, data, (("yes_id", rm.yes_id), ("no_id", rm.no_id)),
                        heldout_metrics)


def train_judge(model, tokenizer, examples: Sequence[JudgeExample],
                heldout: Sequence[PreferencePair], *, steps: int = 300, batch_size: int = 16,
                lr: float = 1e-3, weight_decay: float = 0.01, grad_clip: float = 1.0,
                seed: int = 0, log_every: int = 100, use_chat_template: bool = False
                ) -> tuple[GenerativeRM, dict[str, float]]:
  """Trains an LM-head model to answer each example's judge prompt with YES or NO
  (`judge_task`).

  Returns the trained judge and metrics: train loss start / end, held-out both-orders accuracy
  before and after (`heldout_accuracy_start`, `heldout_accuracy`) and the single-order one
  (`heldout_accuracy_single_order`), see `judge_accuracy`.
  """
  task = judge_task(model, tokenizer, examples, heldout, batch_size=batch_size,
                    use_chat_template=use_chat_template)
  graphdef, params, rest = split_model(model)
  accuracy_start = task.heldout(params)["heldout_accuracy"]
  params, metrics = fit_objective("judge", task.objective, model, task.data, steps=steps,
                                  batch_size=batch_size, lr=lr, weight_decay=weight_decay,
                                  grad_clip=grad_clip, seed=seed, log_every=log_every,
                                  static=task.static)
  metrics.update(heldout_accuracy_start=accuracy_start, **task.heldout(params))
  return GenerativeRM((graphdef, params, rest), tokenizer, batch_size=2 * batch_size,
                      use_chat_template=use_chat_template), metrics


def train_generative_rm(model, tokenizer, train: Sequence[PreferencePair],
                        heldout: Sequence[PreferencePair], **kwargs
                        ) -> tuple[GenerativeRM, dict[str, float]]:
  """`train_judge` on both orders of every training pair (YES when A is the chosen one)."""
  return train_judge(model, tokenizer, judge_examples(train), heldout, **kwargs)


# ----------------------------------------------------------------------------- DPO


@functools.lru_cache(maxsize=16)
def _sequence_logp_fn(graphdef: nnx.GraphDef) -> Callable:
  def logp(params, rest, tokens_BT, mask_BT):
    return sequence_logp(nnx.merge(graphdef, params, rest)(tokens_BT), tokens_BT, mask_BT)
  return jax.jit(logp)


def dpo_rows(tokenizer, pairs: Sequence[PreferencePair], width: int | None = None
             ) -> dict[str, np.ndarray]:
  """Padded rows for DPO: tokens [N, W] of prompt + response + eos for the chosen and the
  rejected responses, and masks [N, W] that are 1 on response tokens (eos included) only.
  W is `width`, or the longest row rounded up to a multiple of 16."""
  prompts, sequences = [], {"chosen": [], "rejected": []}
  for i, pair in enumerate(pairs):
    prompt = tokenizer.encode(pair.prompt)
    if not prompt:
      raise ValueError(f"pair {i}: empty prompt (the first response token needs a context)")
    prompts.append(len(prompt))
    for side in sequences:
      sequences[side].append(prompt + tokenizer.encode(getattr(pair, side)) + [tokenizer.eos_id])
  width = width or padded_width(sequences["chosen"] + sequences["rejected"])
  rows = {}
  for side, side_sequences in sequences.items():
    rows[f"tokens_{side}"], lengths = pad_batch(side_sequences, length=width,
                                                pad_id=tokenizer.pad_id)
    position = np.arange(width)[None, :]
    mask = (position >= np.array(prompts)[:, None]) & (position < lengths[:, None])
    rows[f"mask_{side}"] = mask.astype(np.float32)
  return rows


def _sequence_logps(graphdef, params, rest, tokens: np.ndarray, mask: np.ndarray,
                    batch_size: int) -> np.ndarray:
  """Sequence log-probs of all rows in fixed [batch_size, W] chunks (one compilation)."""
  fn = _sequence_logp_fn(graphdef)
  out = np.zeros(len(tokens), np.float32)
  for start in range(0, len(tokens), batch_size):
    index = np.arange(start, start + batch_size) % len(tokens)
    chunk = np.asarray(fn(params, rest, jnp.asarray(tokens[index]), jnp.asarray(mask[index])))
    real = min(batch_size, len(tokens) - start)
    out[start:start + real] = chunk[:real]
  return out


def dpo_task(policy, tokenizer, train: Sequence[PreferencePair],
             heldout: Sequence[PreferencePair], *, beta: float, batch_size: int
             ) -> PreferenceTask:
  """`dpo_loss` against the frozen parameters of `policy` as they are now (the reference; its
  log-probs are computed here, once). Held out: the DPO loss, the mean implicit reward margin
  beta * [(logp_w - logp_ref_w) - (logp_l - logp_ref_l)] and the pairwise accuracy (margin >
  0)."""
  graphdef, reference_params, rest = split_model(policy)
  # One width for both sets, so training, reference and held-out passes share shapes.
  width = dpo_rows(tokenizer, [*train, *heldout])["tokens_chosen"].shape[1]
  eval_rows = 2 * batch_size

  def logps(params, rows):
    return {side: _sequence_logps(graphdef, params, rest, rows[f"tokens_{side}"],
                                  rows[f"mask_{side}"], eval_rows)
            for side in ("chosen", "rejected")}

  data = dpo_rows(tokenizer, train, width)
  reference = logps(reference_params, data)
  data["logp_ref_chosen"], data["logp_ref_rejected"] = reference["chosen"], reference["rejected"]
  heldout_rows = dpo_rows(tokenizer, heldout, width)
  heldout_reference = logps(reference_params, heldout_rows)

  def heldout_metrics(params) -> dict[str, float]:
    policy_logp = logps(params, heldout_rows)
    margin = beta * ((policy_logp["chosen"] - heldout_reference["chosen"])
                     - (policy_logp["rejected"] - heldout_reference["rejected"]))
    loss = dpo_loss(jnp.asarray(policy_logp["chosen"]), jnp.asarray(policy_logp["rejected"]),
                    jnp.asarray(heldout_reference["chosen"]),
                    jnp.asarray(heldout_reference["rejected"]), beta=beta)
    return {"heldout_loss": float(loss), "heldout_reward_margin": float(np.mean(margin)),
            "heldout_accuracy": float(np.mean(margin > 0))}

  return PreferenceTask(_dpo_objective, data, (("beta", beta),), heldout_metrics)


def train_dpo(policy, tokenizer, train: Sequence[PreferencePair],
              heldout: Sequence[PreferencePair], *, beta: float = 0.1, steps: int = 200,
              batch_size: int = 16, lr: float = 1e-3, weight_decay: float = 0.0,
              grad_clip: float = 1.0, seed: int = 0, log_every: int = 100
              ) -> tuple[nnx.Module, dict[str, float]]:
  """DPO (`dpo_task`) against a frozen copy of the initial policy.

  Returns the trained policy (a new module; `policy` is left unchanged) and metrics: train loss
  start / end and, on held-out pairs, the DPO loss, the mean implicit reward margin and the
  pairwise accuracy, each before (`..._start`) and after.
  """
  task = dpo_task(policy, tokenizer, train, heldout, beta=beta, batch_size=batch_size)
  graphdef, params, rest = split_model(policy)
  start_metrics = {f"{k}_start": v for k, v in task.heldout(params).items()}
  params, metrics = fit_objective("dpo", task.objective, policy, task.data, steps=steps,
                                  batch_size=batch_size, lr=lr, weight_decay=weight_decay,
                                  grad_clip=grad_clip, seed=seed, log_every=log_every,
                                  static=task.static)
  metrics.update(start_metrics)
  metrics.update(task.heldout(params))
  return nnx.merge(graphdef, params, rest), metrics
