"""The problems a run trains and evaluates on, whatever their source: generated puzzles or
prompt records from files (config.data.source), and their prompt token ids."""

from __future__ import annotations

import ml_collections
from absl import logging

from rl.core.checks import InputError, allowed, positive
from rl.data import curriculum, sources, templates
from rl.rewards import puzzles, rm_graders

# Prompts over the context logged one by one; the rest only appear in the count.
MAX_LOGGED_LONG_PROMPTS = 10


def check_data(data: ml_collections.ConfigDict) -> None:
  """config.data's checker: the source, task, template and sizes `load_entries` reads, and the
  curriculum (rl/data/curriculum.py). Its files are checked at run start (`sources.check_files`
  from rl/config/validation.py check_paths): a dry run plans a recipe without its data."""
  allowed("data.source", data.source, ("puzzles", "files"))
  allowed("data.task", data.task, sorted(puzzles.TASKS))
  allowed("data.prompt_template", data.prompt_template, templates.TEMPLATES)
  positive(data, "data", "train_size", "heldout_size")
  if data.train_seed < -1:
    raise ValueError(f"config.data.train_seed={data.train_seed}: must be >= 0, or -1 for "
                     "config.seed")
  curriculum.check_curriculum(data)


def train_seed(c: ml_collections.ConfigDict) -> int:
  """The generator seed of the training problems: config.data.train_seed, or config.seed when
  it is -1."""
  return c.seed if c.data.train_seed == -1 else c.data.train_seed


def load_entries(c: ml_collections.ConfigDict,
                 tokenizer=None) -> tuple[list[dict], list[dict]]:
  """(train, held-out) entries: generated puzzles (held-out from another seed, with any
  question also in the training set removed) or prompt records from files. Given the run's
  tokenizer, every prompt must leave the response its room in the model's context (see
  `fit_context`)."""
  if c.data.source == "files":
    train, stats = sources.load_records(c.data.train_files.split(","),
                                        skip_bad=c.data.skip_bad_records)
    heldout, heldout_stats = sources.load_records(c.data.heldout_files.split(","),
                                                  skip_bad=c.data.skip_bad_records)
    logging.info("prompt records: %d train (%d skipped), %d held-out (%d skipped)",
                 stats.loaded, stats.skipped, heldout_stats.loaded, heldout_stats.skipped)
    # A record of a domain no grader scores fails here, not mid-run.
    rm_graders.check_record_domains(train + heldout, c.reward.graders)
    train_where, heldout_where = stats.locations, heldout_stats.locations
  else:
    train = puzzles.make(c.data.task, size=c.data.train_size, seed=train_seed(c),
                         difficulty=c.data.difficulty)
    heldout = puzzles.make(c.data.task, size=c.data.heldout_size, seed=c.data.heldout_seed,
                           difficulty=c.data.difficulty)
    train_where, heldout_where = ([f"config.data.task={c.data.task!r} {kind} problem {i}"
                                   for i in range(len(entries))]
                                  for kind, entries in (("training", train),
                                                        ("held-out", heldout)))
  if tokenizer is not None:
    train = fit_context(train, train_where, tokenizer, c)
    heldout = fit_context(heldout, heldout_where, tokenizer, c)
  train_prompts = {templates.prompt_of(e) for e in train}
  heldout = [e for e in heldout if templates.prompt_of(e) not in train_prompts]
  if not train or not heldout:
    raise ValueError(f"no {'training' if not train else 'held-out'} problems left "
                     "(config.data: sizes, files, or every held-out question is also a training "
                     "question)")
  return train, heldout


def encode_prompts(entries, tokenizer, template: str) -> list[list[int]]:
  """Prompt ids of entries under a template of rl/data/templates.py."""
  return [templates.encode({"prompt": templates.prompt_of(e)}, template, tokenizer) for e in entries]


def fit_context(entries: list[dict], where: list[str], tokenizer,
                c: ml_collections.ConfigDict) -> list[dict]:
  """The entries whose prompt (under config.data.prompt_template) has at most
  config.model.max_seq_len - config.rollout.max_new_tokens tokens. A longer one is an
  InputError naming its file and line (`where`), or with config.data.skip_bad_records it is
  skipped, counted and logged."""
  limit = c.model.max_seq_len - c.rollout.max_new_tokens
  kept, skipped = [], 0
  for entry, place in zip(entries, where, strict=True):
    length = len(templates.encode({"prompt": templates.prompt_of(entry)}, c.data.prompt_template,
                                  tokenizer))
    if length <= limit:
      kept.append(entry)
      continue
    message = (f"{place}: prompt of {length} tokens, more than the {limit} the model's context "
               f"leaves (config.model.max_seq_len={c.model.max_seq_len} - "
               f"config.rollout.max_new_tokens={c.rollout.max_new_tokens})")
    if not c.data.skip_bad_records:
      raise InputError(message)
    skipped += 1
    if skipped <= MAX_LOGGED_LONG_PROMPTS:
      logging.warning("skipping %s", message)
  if skipped:
    logging.warning("skipped %d of %d prompts longer than the context allows (%d tokens)",
                    skipped, len(entries), limit)
  return kept
