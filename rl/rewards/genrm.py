"""Learned reward models: a pairwise generative judge, a math-equivalence judge built on it, and
a Bradley-Terry scalar reward model.

Generative judge (spec section 9). The judge is an ordinary LM. It reads `judge_prompt(question,
A, B[, reference])`, which ends with the line "Is Response A better than Response B? Answer YES
or NO." and a newline, and its score is P(YES) of the next token, normalised over {YES, NO}:
sigmoid(logit_YES - logit_NO) at the last prompt position. A judge tends to favour one slot
whatever is in it, so `score_pair` asks both ways and averages:
    score(a, b) = 0.5 * (P(YES | a, b) + 1 - P(YES | b, a)),
which is exactly 0.5 for a == b and satisfies score(a, b) = 1 - score(b, a) for any judge.

Answer tokens. The YES / NO ids are the first tokens of `tokenizer.encode("YES")` and
`tokenizer.encode("NO")`. The template puts the answer at the start of a fresh line, so for BPE
vocabularies these are the no-leading-space tokens a model writes there; for `ByteTokenizer`
they are the single bytes "Y" and "N".

Math judge (Seed-Verifier style). `make_math_judge(rm)` asks the same judge whether answers are
equivalent to their references and returns P(YES) of each; `rl/rewards/math.py` takes it as
`judge=`.

Bradley-Terry RM. A scalar-head model (`build(preset, head="scalar")`) reads prompt + response;
the reward is its value at the last real token.

Batching: prompts are right-padded to a multiple of `length_multiple` tokens and the row count
is rounded up to a power of two (at most `batch_size`), so one jitted function per model
compiles once per (rows, length) bucket and is shared by every instance with the same graph.
The forward pass computes logits at every position and keeps one; that is fine for judges the
size of the tests and the demo, and is the first thing to change for a large-vocabulary judge.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.tokenizer import pad_batch

JUDGE_QUESTION = "Is Response A better than Response B? Answer YES or NO."
EQUIVALENCE_QUESTION = ("Is the candidate answer equivalent to the reference answer? "
                        "Answer YES or NO.")


def judge_prompt(question: str, response_a: str, response_b: str,
                 reference: str | None = None) -> str:
  """The pairwise judge prompt; the judge's next token after it is "YES" or "NO".

  Layout (the reference block only when `reference` is given):

      [Question]
      {question}

      [Reference answer]
      {reference}

      [Response A]
      {response_a}

      [Response B]
      {response_b}

      Is Response A better than Response B? Answer YES or NO.
  """
  blocks = [f"[Question]\n{question}"]
  if reference is not None:
    blocks.append(f"[Reference answer]\n{reference}")
  blocks += [f"[Response A]\n{response_a}", f"[Response B]\n{response_b}", JUDGE_QUESTION]
  return "\n\n".join(blocks) + "\n"


def equivalence_prompt(question: str, reference: str, answer: str) -> str:
  """The math-verifier prompt: is `answer` equivalent to `reference`? Next token YES or NO.

  Layout: "[Question]", "[Reference answer]" and "[Candidate answer]" blocks, then
  `EQUIVALENCE_QUESTION` and a newline.
  """
  blocks = [f"[Question]\n{question}", f"[Reference answer]\n{reference}",
            f"[Candidate answer]\n{answer}", EQUIVALENCE_QUESTION]
  return "\n\n".join(blocks) + "\n"


def answer_token_ids(tokenizer) -> tuple[int, int]:
  """(YES id, NO id): the first token of "YES" and of "NO" (bytes "Y", "N" for ByteTokenizer)."""
  yes_ids, no_ids = tokenizer.encode("YES"), tokenizer.encode("NO")
  if not yes_ids or not no_ids or yes_ids[0] == no_ids[0]:
    raise ValueError(f"the tokenizer must encode 'YES' and 'NO' to different first tokens; "
                     f"got {yes_ids} and {no_ids}")
  return yes_ids[0], no_ids[0]


# ----------------------------------------------------------------------------- Shared pieces

def split_model(model) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
  """(graphdef, params, rest) from an nnx model or an already split triple."""
  if isinstance(model, nnx.Module):
    return nnx.split(model, nnx.Param, ...)
  if isinstance(model, tuple) and len(model) == 3:
    return model
  raise TypeError(f"expected an nnx model or a (graphdef, params, rest) triple, got "
                  f"{type(model).__name__}")


def at_last_token(x_BT: jax.Array, lengths_B: jax.Array) -> jax.Array:
  """x[b, lengths[b] - 1] for x of shape [B, T, ...]: the last real position of each row."""
  index = (lengths_B - 1).astype(jnp.int32).reshape((-1,) + (1,) * (x_BT.ndim - 1))
  return jnp.take_along_axis(x_BT, index, axis=1)[:, 0]


def yes_probability(logits_BTV: jax.Array, lengths_B: jax.Array, yes_id: int,
                    no_id: int) -> jax.Array:
  """P(YES) over {YES, NO} from the next-token logits at each row's last prompt token: [B]."""
  last_BV = at_last_token(logits_BTV, lengths_B)
  return jax.nn.sigmoid(last_BV[:, yes_id] - last_BV[:, no_id])


@functools.lru_cache(maxsize=16)
def _p_yes_fn(graphdef: nnx.GraphDef, yes_id: int, no_id: int) -> Callable:
  def p_yes(params, rest, tokens_BT, lengths_B):
    logits_BTV = nnx.merge(graphdef, params, rest)(tokens_BT)
    return yes_probability(logits_BTV, lengths_B, yes_id, no_id)
  return jax.jit(p_yes)


@functools.lru_cache(maxsize=16)
def _last_value_fn(graphdef: nnx.GraphDef) -> Callable:
  def last_value(params, rest, tokens_BT, lengths_B):
    values_BT = nnx.merge(graphdef, params, rest)(tokens_BT)
    return at_last_token(values_BT, lengths_B)
  return jax.jit(last_value)


def _run_bucketed(fn: Callable, params, rest, sequences: Sequence[Sequence[int]], *,
                  pad_id: int, batch_size: int, length_multiple: int,
                  max_len: int) -> np.ndarray:
  """fn(params, rest, ids [R, L], lengths [R]) -> [R] over `sequences` in bucketed chunks, under
  the mesh the reward model's parameters are sharded on (the run's, rl/jobs/reward_models.py),
  else a mesh of the devices they are on: a model loaded on one device runs there unsharded,
  also inside a trainer's ambient mesh over more devices (Placement.scope), which would refuse
  its arguments."""
  for i, sequence in enumerate(sequences):
    if not 0 < len(sequence) <= max_len:
      raise ValueError(f"sequence {i} has {len(sequence)} tokens; the model takes 1..{max_len}")
  sharding = jax.tree.leaves(params)[0].sharding
  if isinstance(sharding, jax.sharding.NamedSharding):
    mesh = sharding.mesh
  else:
    mesh = jax.sharding.Mesh(np.array(sorted(sharding.device_set, key=lambda d: d.id)), ("rm",))
  with jax.set_mesh(mesh):
    return _run_chunks(fn, params, rest, sequences, pad_id=pad_id, batch_size=batch_size,
                       length_multiple=length_multiple)


def _run_chunks(fn: Callable, params, rest, sequences: Sequence[Sequence[int]], *,
                pad_id: int, batch_size: int, length_multiple: int) -> np.ndarray:
  """_run_bucketed's loop: `sequences` in chunks of `batch_size` rows (a power of two at most,
  filler rows of one pad token), each padded to a multiple of `length_multiple`."""
  out = np.zeros(len(sequences), np.float32)
  for start in range(0, len(sequences), batch_size):
    chunk = list(sequences[start:start + batch_size])
    rows = min(1 << (len(chunk) - 1).bit_length(), batch_size)
    # Filler rows are one pad token long, so their last-token index stays in range.
    filler = [[pad_id]] * (rows - len(chunk))
    ids_RL, lengths_R = pad_batch(chunk + filler, multiple_of=length_multiple, pad_id=pad_id)
    result = fn(params, rest, jnp.asarray(ids_RL), jnp.asarray(lengths_R))
    out[start:start + len(chunk)] = np.asarray(result)[:len(chunk)]
  return out


# ----------------------------------------------------------------------------- Generative RM

class GenerativeRM:
  """A pairwise LLM judge scored by P(YES) of its next token (see the module docstring).

  Args:
    model: an LM-head nnx model, or its (graphdef, params, rest) split.
    tokenizer: the judge's tokenizer; also gives the YES / NO ids (`answer_token_ids`).
    batch_size: most prompts per forward pass.
    length_multiple: prompt lengths are padded up to a multiple of this (the jit buckets).
    use_chat_template: wrap each prompt as one user turn with the tokenizer's chat template
      (for instruction-tuned judges); the raw prompt otherwise.
  """

  def __init__(self, model, tokenizer, *, batch_size: int = 32, length_multiple: int = 64,
               use_chat_template: bool = False):
    self.graphdef, self.params, self.rest = split_model(model)
    config = nnx.merge(self.graphdef, self.params, self.rest).cfg
    if config.head != "lm":
      raise ValueError(f"a generative judge needs an LM head, the model has head={config.head!r}")
    self.tokenizer = tokenizer
    self.yes_id, self.no_id = answer_token_ids(tokenizer)
    self.max_len = config.max_seq_len
    self.batch_size = batch_size
    self.length_multiple = length_multiple
    self.use_chat_template = use_chat_template

  def encode(self, prompt: str) -> list[int]:
    if self.use_chat_template:
      return self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                add_generation_prompt=True, tokenize=True)
    return self.tokenizer.encode(prompt)

  def p_yes(self, prompts: Sequence[str]) -> np.ndarray:
    """P(YES) normalised over {YES, NO} after each prompt: float32 [N].

    Each distinct prompt runs once, so repeated prompts get bit-identical probabilities.
    """
    unique = list(dict.fromkeys(prompts))
    probabilities = _run_bucketed(
        _p_yes_fn(self.graphdef, self.yes_id, self.no_id), self.params, self.rest,
        [self.encode(p) for p in unique], pad_id=self.tokenizer.pad_id,
        batch_size=self.batch_size, length_multiple=self.length_multiple, max_len=self.max_len)
    by_prompt = dict(zip(unique, probabilities))
    return np.array([by_prompt[p] for p in prompts], np.float32)

  def score_pairs(self, questions: Sequence[str], responses_a: Sequence[str],
                  responses_b: Sequence[str],
                  references: Sequence[str | None] | None = None) -> np.ndarray:
    """Both-orders scores 0.5 * (P(YES | a, b) + 1 - P(YES | b, a)): float64 [N].

    Above 0.5 means the judge prefers a. Computed as 0.5 + 0.5 * (p_ab - p_ba) so that a == b
    gives exactly 0.5.
    """
    if not len(questions) == len(responses_a) == len(responses_b):
      raise ValueError("questions, responses_a and responses_b must have the same length")
    if references is None:
      references = [None] * len(questions)
    elif len(references) != len(questions):
      raise ValueError("references must have one entry per question")
    forward = [judge_prompt(q, a, b, r)
               for q, a, b, r in zip(questions, responses_a, responses_b, references)]
    backward = [judge_prompt(q, b, a, r)
                for q, a, b, r in zip(questions, responses_a, responses_b, references)]
    probabilities = self.p_yes(forward + backward).astype(np.float64)
    p_ab, p_ba = probabilities[:len(forward)], probabilities[len(forward):]
    return 0.5 + 0.5 * (p_ab - p_ba)

  def score_pair(self, question: str, response_a: str, response_b: str,
                 reference: str | None = None) -> float:
    """Both-orders score of one pair: > 0.5 when the judge prefers `response_a`."""
    return float(self.score_pairs([question], [response_a], [response_b], [reference])[0])


def make_math_judge(rm: GenerativeRM) -> Callable[[Sequence[str], Sequence[str], Sequence[str]],
                                                   np.ndarray]:
  """A Seed-Verifier-style judge for rl/rewards/math.py: (questions, references, answers) ->
  P(YES) that each answer is equivalent to its reference (prompt: `equivalence_prompt`), all in
  one batched forward."""

  def judge(questions: Sequence[str], references: Sequence[str],
            answers: Sequence[str]) -> np.ndarray:
    return rm.p_yes([equivalence_prompt(q, r, a)
                     for q, r, a in zip(questions, references, answers)])

  return judge


# ----------------------------------------------------------------------------- Bradley-Terry RM

class BradleyTerryRM:
  """A scalar-head reward model: the reward of (prompt, response) is the model's value at the
  last token of encode(prompt) + encode(response).

  Args:
    model: a scalar-head nnx model (`build(preset, head="scalar")`), or its split.
    tokenizer: its tokenizer.
    batch_size, length_multiple: as for `GenerativeRM`.
  """

  def __init__(self, model, tokenizer, *, batch_size: int = 32, length_multiple: int = 64):
    self.graphdef, self.params, self.rest = split_model(model)
    config = nnx.merge(self.graphdef, self.params, self.rest).cfg
    if config.head != "scalar":
      raise ValueError(f"a Bradley-Terry RM needs head='scalar', the model has "
                       f"head={config.head!r}")
    self.tokenizer = tokenizer
    self.max_len = config.max_seq_len
    self.batch_size = batch_size
    self.length_multiple = length_multiple

  def encode(self, prompt: str, response: str) -> list[int]:
    return self.tokenizer.encode(prompt) + self.tokenizer.encode(response)

  def rewards(self, prompts: Sequence[str], responses: Sequence[str]) -> np.ndarray:
    """Reward of each (prompt, response): float32 [N]."""
    if len(prompts) != len(responses):
      raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    return _run_bucketed(
        _last_value_fn(self.graphdef), self.params, self.rest,
        [self.encode(p, r) for p, r in zip(prompts, responses)], pad_id=self.tokenizer.pad_id,
        batch_size=self.batch_size, length_multiple=self.length_multiple, max_len=self.max_len)
