"""Supervised fine-tuning on in-memory (prompt, response) text pairs: the warm start of the
O1-Coder policy (templated reasoning paths) and the SFT stage of the test-case generator.

The loss is rl/jobs/fitting.py's response-only NLL objective, token-averaged per batch, on
rl/jobs/sft.py's rows (`make_batch`); the optimisation is fitting.py's fixed-shape AdamW loop
(`fit_objective`), so this file only turns text into rows. `rl/jobs/sft.py::run` is the config-driven SFT job over a run's data
entries; this is the library form for data generated inside a loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from flax import nnx

from models.padding import round_up
from rl.jobs.fitting import fit_objective, response_nll_objective
from rl.jobs.sft import make_batch


def sft_rows(tokenizer, pairs: Sequence[tuple[str, str]], width: int | None = None
             ) -> dict[str, np.ndarray]:
  """Rows of prompt + response + eos, the loss mask on response tokens (eos included)."""
  examples = [(tokenizer.encode(prompt), tokenizer.encode(response) + [tokenizer.eos_id])
              for prompt, response in pairs]
  longest = max(len(p) + len(r) for p, r in examples)
  width = width or round_up(longest, 16)
  batch = make_batch(examples, tokenizer.pad_id, width)
  return {"tokens": batch["tokens"], "loss_mask": batch["loss_mask"]}


def supervised_finetune(model, tokenizer, pairs: Sequence[tuple[str, str]], *, steps: int,
                        batch_size: int = 32, lr: float = 2e-3, weight_decay: float = 0.0,
                        grad_clip: float = 1.0, seed: int = 0, log_every: int = 100
                        ) -> tuple[nnx.Module, dict[str, float]]:
  """`steps` AdamW steps of response NLL on `pairs`; returns a new model and the train loss at
  the start and the end (`model` itself is left unchanged)."""
  graphdef, _, rest = nnx.split(model, nnx.Param, ...)
  params, metrics = fit_objective("sft", response_nll_objective, model, sft_rows(tokenizer, pairs),
                                  steps=steps, batch_size=batch_size, lr=lr,
                                  weight_decay=weight_decay, grad_clip=grad_clip, seed=seed,
                                  log_every=log_every)
  return nnx.merge(graphdef, params, rest), metrics
