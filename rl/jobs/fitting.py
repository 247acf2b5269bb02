"""The small training loop of the jobs that fit one objective on in-memory rows (preference
models, DPO, the O1-Coder PRM and its SFT warm starts) and the one response-only NLL objective
(SFT, O1-Coder's fine-tuning, the tool-use warm start).

An objective is a pure function (params, graphdef, rest, batch, **static) -> (loss, metrics).
`objective_step` jits one AdamW step of it (constant learning rate, global-norm clipping;
rl/core/train_step.py `make_optimizer`), cached per model graph and hyper-parameters so later
runs reuse the compilation; `fit_objective` runs it over fixed-size batches of row-aligned data
drawn from shuffled epochs (`batch_indices`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from flax import nnx

from rl.core import train_step as ts
from rl.core.losses import response_nll
from rl.rewards.genrm import split_model


def response_nll_objective(params, graphdef, rest, batch):
  """The token-averaged response NLL of batch["tokens"] under batch["loss_mask"]."""
  logits = nnx.merge(graphdef, params, rest)(batch["tokens"])
  return response_nll(logits, batch["tokens"], batch["loss_mask"]), {}


@functools.lru_cache(maxsize=32)
def objective_step(objective: Callable, graphdef: nnx.GraphDef, lr: float, weight_decay: float,
                grad_clip: float, static: tuple) -> tuple[optax.GradientTransformation, Callable]:
  """The optimiser (constant lr) and its jit(params, opt_state, rest, batch) -> (params,
  opt_state, loss, metrics); params and optimiser state are donated."""
  optimizer = ts.make_optimizer(lr=lr, warmup_steps=None, weight_decay=weight_decay,
                                grad_clip=grad_clip)
  kwargs = dict(static)

  def loss_fn(params, rest, batch):
    return objective(params, graphdef, rest, batch, **kwargs)

  return optimizer, jax.jit(ts.gradient_step(loss_fn, optimizer), donate_argnums=(0, 1))


def batch_indices(num_examples: int, batch_size: int, seed: int) -> Iterator[np.ndarray]:
  """Endless fixed-size batches from a stream of shuffled epochs."""
  rng = np.random.default_rng(seed)
  stream = np.zeros(0, np.int64)
  while True:
    while len(stream) < batch_size:
      stream = np.concatenate([stream, rng.permutation(num_examples)])
    yield stream[:batch_size]
    stream = stream[batch_size:]


def fit_objective(name: str, objective: Callable, model, data: dict[str, np.ndarray], *,
                  steps: int, batch_size: int, lr: float, weight_decay: float,
                  grad_clip: float, seed: int, log_every: int,
                  static: tuple = ()) -> tuple[nnx.State, dict[str, float]]:
  """Runs `steps` optimiser steps on row-aligned `data`: (params, metrics), the metrics being
  the first step's loss and each step metric averaged over the last tenth (<= 10 steps)."""
  graphdef, params, rest = split_model(model)
  optimizer, step_fn = objective_step(objective, graphdef, lr, weight_decay, grad_clip, static)
  params = jax.tree.map(jnp.copy, params)  # donated below; the caller's model stays valid
  opt_state = optimizer.init(params)
  num_examples = len(next(iter(data.values())))
  batches = batch_indices(num_examples, batch_size, seed)
  history = []
  start = time.perf_counter()
  for step in range(1, steps + 1):
    index = next(batches)
    params, opt_state, loss, metrics = step_fn(params, opt_state, rest,
                                               {k: v[index] for k, v in data.items()})
    history.append({"loss": loss, **metrics})
    if step % log_every == 0 and step > 1:
      # The previous step's loss is ready by now; reading it does not stall the pipeline.
      elapsed = time.perf_counter() - start
      logging.info("%s step %d/%d loss %.4f (%.1f steps/s, ETA %.0fs)", name, step, steps,
                   float(history[-2]["loss"]), step / elapsed, elapsed / step * (steps - step))
  history = jax.device_get(history)
  tail = history[-max(1, min(10, steps // 10)):]
  summary = {"train_loss_start": float(history[0]["loss"])}
  summary.update({f"train_{k}_end": float(np.mean([m[k] for m in tail])) for k in tail[0]})
  summary.update(steps=steps, wall_s=time.perf_counter() - start)
  return params, summary
