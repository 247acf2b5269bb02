"""The problems a run trains and evaluates on, whatever their source: generated puzzles or
prompt records from files (config.data.source), and their prompt token ids."""

from __future__ import annotations

import ml_collections
from absl import logging

from rl.data import sources, templates
from rl.rewards import manager, puzzles


def load_entries(c: ml_collections.ConfigDict) -> tuple[list[dict], list[dict]]:
  """(train, held-out) entries: generated puzzles (held-out from another seed, with any
  question also in the training set removed) or prompt records from files."""
  if c.data.source == "files":
    train, stats = sources.load_records(c.data.train_files.split(","),
                                        skip_bad=c.data.skip_bad_records)
    heldout, heldout_stats = sources.load_records(c.data.heldout_files.split(","),
                                                  skip_bad=c.data.skip_bad_records)
    logging.info("prompt records: %d train (%d skipped), %d held-out (%d skipped)",
                 stats.loaded, stats.skipped, heldout_stats.loaded, heldout_stats.skipped)
    for e in train + heldout:
      manager.kind_of(e)  # an ungradable record fails here, not mid-run
  else:
    train = puzzles.make(c.data.task, size=c.data.train_size, seed=c.seed,
                         difficulty=c.data.difficulty)
    heldout = puzzles.make(c.data.task, size=c.data.heldout_size, seed=c.data.heldout_seed,
                           difficulty=c.data.difficulty)
  train_prompts = {prompt_of(e) for e in train}
  heldout = [e for e in heldout if prompt_of(e) not in train_prompts]
  if not train or not heldout:
    raise ValueError(f"no {'training' if not train else 'held-out'} problems left "
                     "(config.data: sizes, files, or every held-out question is also a training "
                     "question)")
  return train, heldout


def prompt_of(entry: dict) -> str:
  return entry["prompt"] if "prompt" in entry else entry["question"]


def encode_prompts(entries, tokenizer, template: str) -> list[list[int]]:
  """Prompt ids of entries under a template of rl/data/templates.py."""
  return [templates.encode({"prompt": prompt_of(e)}, template, tokenizer) for e in entries]
