"""Supervised fine-tuning (the cold start before RL): next-token loss on response tokens only,
AdamW with warm-up and cosine decay (Seed-Thinking-v1.5: peak 2e-5 decaying to 2e-6 at full
scale), epochs over the data, held-out loss, and orbax checkpoints `{"params", "rest",
"opt_state"}` of which an RL run reads the first two through `config.init_checkpoint`.

Checkpoints are saved every `config.sft.checkpoint_every` steps and at the end (whose record
holds the final metrics: that is how a finished stage is recognised). A rerun resumes from the
latest one: the data order is a function of the seed and the step, so a resumed run ends with
the parameters an uninterrupted one ends with. SIGTERM / SIGINT save at the next step and raise
Preempted (rl/jobs/checkpoint.py).

Rows are `config.sft.max_len` tokens (0: the longest example, at most the model's max_seq_len);
a longer example loses the end of its response (counted and logged). With `config.sft.pack`
several examples share a row: each keeps positions from 0 and a segment id, so attention and the
DSA indexer's top-k stay inside its own document, and the packed loss is the sum of the separate
examples' losses.

DSA models go through up to three stages. DeepSeek-V3.2 starts from a trained dense model; one
trained here from scratch first gets `config.sft.dense_steps` of dense attention in which the
whole model trains and the lightning indexers are fitted alongside by their KL loss (their
inputs detached, so the LM loss does not reach them): "dense". Then
`config.sft.dense_warmup_steps` of DeepSeek-V3.2's dense warm-up (eq. 3): dense attention, every
parameter but the indexers frozen, the indexers fitted to the attention: "dense_warmup". Then
sparse attention and the whole model trains: "sparse".
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from flax import nnx

from models import remat as remat_lib
from models.padding import round_up
from models.tokenizer import load_tokenizer, pad_batch
from rl.core.policy import build_policy, model_config
from rl.config.validation import check_paths, validate
from rl.core import train_step as ts
from rl.core.losses import response_nll
from rl.jobs.checkpoint import MetricsWriter, PreemptionGuard, open_stage
from rl.jobs.progress import Progress
from rl.parallel.placement import Placement
from rl.data.entries import encode_prompts, load_entries
from rl.rewards import puzzles


def sft_examples(entries, tokenizer, template: str) -> list[tuple[list[int], list[int]]]:
  """(prompt ids, response ids) pairs; the response is the entry's `response` (e.g. written by
  rejection sampling), else its worked `solution`, else its `answer`, then end-of-sequence."""
  prompts = encode_prompts(entries, tokenizer, template)
  responses = []
  for e in entries:
    target = e.get("response") or e.get("solution") or e.get("answer")
    if not target:
      raise ValueError(f"SFT record without response/solution/answer: {str(e)[:120]}")
    responses.append(tokenizer.encode(target) + [tokenizer.eos_id])
  return list(zip(prompts, responses))


def fit_examples(examples, max_len: int) -> tuple[list[tuple[list[int], list[int]]], dict]:
  """Cuts responses so that prompt + response <= max_len; an example whose prompt alone leaves
  no response token is dropped. Returns (examples, {"truncated", "dropped"})."""
  kept, counts = [], {"truncated": 0, "dropped": 0}
  for prompt, response in examples:
    room = max_len - len(prompt)
    if room < 1:
      counts["dropped"] += 1
      continue
    if len(response) > room:
      counts["truncated"] += 1
      response = response[:room]
    kept.append((prompt, response))
  return kept, counts


def pack_rows(lengths: Sequence[int], order: Sequence[int], width: int, *,
              open_rows: int = 32) -> list[list[int]]:
  """Example indices per row of `width` tokens, in `order`: first fit among the `open_rows`
  most recently opened rows (bounded work per example; a full scan over every row costs
  O(examples x rows)), else a new row."""
  rows: list[list[int]] = []
  room: list[int] = []
  for index in order:
    length = lengths[index]
    if length > width:
      raise ValueError(f"example {index} has {length} tokens, more than the row width {width}")
    for r in range(max(0, len(rows) - open_rows), len(rows)):
      if room[r] >= length:
        rows[r].append(index)
        room[r] -= length
        break
    else:
      rows.append([index])
      room.append(width - length)
  return rows


def make_packed_batch(examples, rows: Sequence[Sequence[int]], pad_id: int,
                      width: int) -> dict[str, np.ndarray]:
  """Rows of several examples each: tokens, loss_mask (response tokens), token_mask (real
  tokens), segment_ids (1, 2, ... per example; 0 on padding) and positions (from 0 in every
  example)."""
  batch = {"tokens": np.full((len(rows), width), pad_id, np.int32),
           "loss_mask": np.zeros((len(rows), width), np.float32),
           "token_mask": np.zeros((len(rows), width), np.float32),
           "segment_ids": np.zeros((len(rows), width), np.int32),
           "positions": np.zeros((len(rows), width), np.int32)}
  for b, row in enumerate(rows):
    start = 0
    for segment, index in enumerate(row, start=1):
      prompt, response = examples[index]
      end = start + len(prompt) + len(response)
      batch["tokens"][b, start:end] = prompt + response
      batch["loss_mask"][b, start + len(prompt):end] = 1.0
      batch["token_mask"][b, start:end] = 1.0
      batch["segment_ids"][b, start:end] = segment
      batch["positions"][b, start:end] = np.arange(end - start)
      start = end
  return batch


def make_batch(examples, pad_id: int, width: int) -> dict[str, np.ndarray]:
  """Right-padded tokens [B, W] and a loss mask that is 1 on response tokens only."""
  seqs = [p + r for p, r in examples]
  tokens, lengths = pad_batch(seqs, length=width, pad_id=pad_id)
  prompt_lens = np.array([len(p) for p, _ in examples])
  pos = np.arange(width)[None, :]
  loss_mask = (pos >= prompt_lens[:, None]) & (pos < lengths[:, None])
  return {"tokens": tokens, "loss_mask": loss_mask.astype(np.float32),
          "token_mask": (pos < lengths[:, None]).astype(np.float32)}


def is_indexer_path(path) -> bool:
  """Whether a parameter tree path lies inside a DSA lightning indexer."""
  return any(getattr(key, "key", None) == "indexer" for key in path)


def freeze_outside_indexer(params):
  """DSA dense warm-up (DeepSeek-V3.2 eq. 3): every parameter but the indexers' behind a
  stop-gradient, so the step's gradient is the indexer KL's gradient on the indexers alone."""
  return jax.tree.map_with_path(
      lambda path, x: x if is_indexer_path(path) else jax.lax.stop_gradient(x), params)


def _examples(c: ml_collections.ConfigDict, tokenizer):
  """The training and held-out (prompt ids, response ids) examples, fitted to the row width
  (config.sft.max_len, or the longest example), and the width."""
  s = c.sft
  entries, heldout = load_entries(c, tokenizer)
  if s.carry_slip_rate:
    entries = puzzles.with_carry_slips(entries, s.carry_slip_rate, seed=c.seed)
  train_ex = sft_examples(entries, tokenizer, c.data.prompt_template)
  eval_ex = sft_examples(heldout, tokenizer, c.data.prompt_template)
  width = s.max_len or min(round_up(max(len(p) + len(r) for p, r in train_ex + eval_ex), 8),
                           c.model.max_seq_len)
  train_ex, train_cut = fit_examples(train_ex, width)
  eval_ex, eval_cut = fit_examples(eval_ex, width)
  for name, cut in (("training", train_cut), ("held-out", eval_cut)):
    if cut["truncated"] or cut["dropped"]:
      logging.warning("SFT %s examples over config.sft.max_len=%d tokens: %d truncated, %d "
                      "dropped (prompt alone too long)", name, width, cut["truncated"],
                      cut["dropped"])
  if not train_ex or not eval_ex:
    raise ValueError(f"config.sft.max_len={width}: no SFT example fits")
  return train_ex, eval_ex, width


def _epoch_rows(s: ml_collections.ConfigDict, train_ex, width: int, seed: int):
  """Each epoch's rows (lists of example indices: one, or several packed) in the seed's order,
  and each epoch's step count."""
  rng = np.random.default_rng(seed)
  epoch_orders = [rng.permutation(len(train_ex)) for _ in range(s.epochs)]
  if s.pack:  # rows of several examples; the schedule needs every epoch's row count up front
    lengths = [len(p) + len(r) for p, r in train_ex]
    epoch_rows = [pack_rows(lengths, order, width) for order in epoch_orders]
  else:
    epoch_rows = [[[int(i)] for i in order] for order in epoch_orders]
  return epoch_rows, [max(len(rows) // s.batch_size, 1) for rows in epoch_rows]


class _Stage:
  """The set-up of one SFT stage: data, schedule, sharded state and the jitted programs (the
  loop is `run`)."""

  def __init__(self, c: ml_collections.ConfigDict):
    self.c, s = c, c.sft
    self.tokenizer = load_tokenizer(c.tokenizer)
    self.train_ex, self.eval_ex, self.width = _examples(c, self.tokenizer)
    self.epoch_rows, self.steps_per_epoch = _epoch_rows(s, self.train_ex, self.width, c.seed)
    self.total = sum(self.steps_per_epoch)
    self.placement = Placement.from_config(c)
    graphdef, params, rest = nnx.split(build_policy(c, self.placement.mesh), nnx.Param, ...)
    optimizer = ts.make_optimizer(lr=s.lr, warmup_steps=s.warmup_steps, decay_steps=self.total,
                                  final_lr_fraction=s.final_lr_fraction,
                                  weight_decay=s.weight_decay, grad_clip=s.grad_clip)
    state = self.placement.train_state(params, optimizer, offload=c.optim.offload_state)
    self.state = {"params": state.params, "rest": jax.device_put(rest, self.placement.replicated),
                  "opt_state": state.opt_state}
    self.model_cfg = model_config(c)
    # MoE: one aux-loss-free bias step after every optimiser step, from the load it saw.
    self.rebalance = (ts.make_rebalance(graphdef, self.model_cfg.router_bias_rate)
                      if self.model_cfg.router_bias_rate else None)
    self.train_step, self.eval_sums = self._programs(graphdef, optimizer, state)

  def _programs(self, graphdef, optimizer, state):
    s, model_cfg, placement = self.c.sft, self.model_cfg, self.placement

    def loss_fn(params, rest, batch, stage):
      if stage == "dense_warmup":  # the main model frozen: no gradient reaches it
        params = freeze_outside_indexer(params)
      out = nnx.merge(graphdef, params, rest).forward(
          batch["tokens"], indexer_stage="dense_warmup" if stage == "dense" else stage,
          token_mask=batch["token_mask"],
          positions=batch.get("positions"), segment_ids=batch.get("segment_ids"))
      loss = response_nll(out.logits, batch["tokens"], batch["loss_mask"])
      metrics = {}
      if stage is not None:
        # The indexer's inputs and targets are detached: this term trains only the indexer.
        index = out.indexer_loss / jnp.maximum(jnp.sum(batch["token_mask"]), 1.0)
        loss, metrics = loss + s.indexer_coef * index, dict(out.indexer_metrics)
      return ts.add_router_balance(loss, metrics, out.router_stats,
                                   model_cfg.router_aux_loss_coef, 1.0)

    optimiser_step = ts.gradient_step(loss_fn, optimizer)
    # Layouts pinned (rl/parallel/placement.py): parameters and optimiser state stay where they
    # were placed, the optimiser state in host memory between steps with
    # config.optim.offload_state.
    param_shardings, opt_shardings = placement.state_sharding(state)[:2]
    host_opt = (remat_lib.host_shardings(opt_shardings) if self.c.optim.offload_state
                else opt_shardings)

    @functools.partial(jax.jit, static_argnums=4, donate_argnums=(0, 1),
                       out_shardings=(param_shardings, host_opt, None, None))
    def train_step(params, opt_state, rest, batch, stage):
      new_params, opt_state, loss, aux = optimiser_step(
          params, jax.device_put(opt_state, opt_shardings), rest, batch, stage)
      if stage == "dense_warmup":  # AdamW's weight decay would still move the frozen parameters
        new_params = jax.tree.map_with_path(
            lambda path, new, old: new if is_indexer_path(path) else old, new_params, params)
      return new_params, opt_state, loss, aux

    @jax.jit
    def eval_sums(params, rest, batch):
      logits = nnx.merge(graphdef, params, rest)(batch["tokens"])
      return (response_nll(logits, batch["tokens"], batch["loss_mask"], mean=False),
              jnp.sum(batch["loss_mask"][:, 1:]))

    return train_step, eval_sums

  def stage_at(self, step: int) -> str | None:
    """DSA: dense training of the whole model, then the dense warm-up (the model frozen, the
    indexer fitted to its dense attention), then sparse training with the indexer loss
    restricted to its own top-k; None for non-DSA models."""
    s = self.c.sft
    if not self.model_cfg.dsa or not s.indexer_coef:
      return None
    if step < s.dense_steps:
      return "dense"
    return "dense_warmup" if step < s.dense_steps + s.dense_warmup_steps else "sparse"

  def eval_loss(self) -> float:
    """The held-out response NLL per token of the current parameters."""
    batch_size, nll, count = self.c.sft.batch_size, 0.0, 0.0
    for i in range(0, len(self.eval_ex), batch_size):
      chunk = self.eval_ex[i:i + batch_size]
      real = len(chunk)
      chunk = chunk + chunk[:1] * (batch_size - real)  # fixed shape; repeats unweighted
      batch = make_batch(chunk, self.tokenizer.pad_id, self.width)
      batch["loss_mask"][real:] = 0.0
      with self.placement.scope():
        a, b = self.eval_sums(self.state["params"], self.state["rest"],
                              self.placement.put_batch(batch))
      nll, count = nll + float(a), count + float(b)
    return nll / max(count, 1.0)

  def batch(self, epoch: int, i: int) -> dict[str, np.ndarray]:
    """The i-th batch of an epoch."""
    s = self.c.sft
    rows = self.epoch_rows[epoch][i * s.batch_size:(i + 1) * s.batch_size]
    if s.pack:
      return make_packed_batch(self.train_ex, rows, self.tokenizer.pad_id, self.width)
    return make_batch([self.train_ex[r[0]] for r in rows], self.tokenizer.pad_id, self.width)

  def step(self, batch: dict, stage: str | None) -> tuple[jax.Array, dict]:
    """One optimiser step (and the MoE bias step); the loss and the step's metrics, as device
    values (an MoE model's among them: its experts' load, "router_load")."""
    st = self.state
    with self.placement.scope():
      st["params"], st["opt_state"], loss, aux = self.train_step(
          st["params"], st["opt_state"], st["rest"], self.placement.put_batch(batch), stage)
      if self.rebalance is not None and stage != "dense_warmup":
        st["rest"] = jax.device_put(self.rebalance(st["params"], st["rest"],
                                                   aux["router_load"]),
                                    self.placement.replicated)
    return loss, aux


def run(config: ml_collections.ConfigDict, workdir: str, *,
        allow_config_change: bool = False, job_stage: str = "") -> dict[str, float]:
  """Trains (or resumes) the SFT stage in `workdir`; returns its metrics. A finished stage is
  not rerun: its final metrics are returned from the checkpoint. `job_stage` ("stage 1/2")
  opens the progress lines when SFT is one stage of a longer job.

  <workdir>/metrics.jsonl and TensorBoard get the held-out loss at step 0 and at the end and,
  every config.sft.log_every steps, the training loss and the step's auxiliary metrics."""
  t_leg = time.perf_counter()
  c = config
  validate(c)
  check_paths(c)
  workdir, ckpt, done = open_stage(c, workdir, save_every=c.sft.checkpoint_every,
                                   allow_config_change=allow_config_change,
                                   final_key="sft/eval_loss", what="SFT stage")
  if done is not None:
    return done
  sft = _Stage(c)
  start_step, wall_s_before = 0, 0.0
  latest = ckpt.restore_latest(sft.state)
  if latest is None:
    logging.info("compiling the SFT evaluation (held-out loss before training)...")
    metrics = {"sft/eval_loss_start": sft.eval_loss()}
  else:
    start_step, sft.state, record = latest
    metrics = {"sft/eval_loss_start": record["sft/eval_loss_start"]}
    wall_s_before = record["sft/wall_s"]
    logging.info("SFT resumed from %s at step %d", ckpt.directory, start_step)
  writer = MetricsWriter(workdir, resume_step=start_step)
  if latest is None:
    writer.write(0, {"sft/eval_loss": metrics["sft/eval_loss_start"]})

  def save(step: int, *, force: bool = False, **final) -> None:
    ckpt.save(step, sft.state, {"step": step, **metrics, **final,
                                "sft/wall_s": wall_s_before + time.perf_counter() - t_leg},
              force=force)

  # A resumed leg has no current held-out loss (measuring it costs a pass over the held-out
  # set): the figure shown is labelled with the step it was measured at.
  logging.info("%sSFT: %d examples in rows of %d tokens (%.1f per row), %d steps%s, eval loss "
               "%.4f at step 0", f"[{job_stage}] " if job_stage else "", len(sft.train_ex),
               sft.width, len(sft.train_ex) / max(len(sft.epoch_rows[0]), 1), sft.total,
               f", resumed at step {start_step}" if start_step else "",
               metrics["sft/eval_loss_start"])
  loss, row = _loop(sft, start_step, save, ckpt, writer, job_stage)
  final = {"sft/eval_loss": sft.eval_loss(), "sft/train_loss": loss}
  logging.info("SFT done: eval loss %.4f -> %.4f", metrics["sft/eval_loss_start"],
               final["sft/eval_loss"])
  writer.write(sft.total, {**row, "sft/eval_loss": final["sft/eval_loss"]})
  writer.close()
  save(sft.total, force=True, **final)
  ckpt.close()
  return {**metrics, **final, "sft/wall_s": wall_s_before + time.perf_counter() - t_leg}


def _loop(sft: _Stage, start_step: int, save, ckpt, writer, job_stage: str
          ) -> tuple[float, dict[str, float]]:
  """The steps from `start_step` on, logged every config.sft.log_every steps and saved after
  each (preemption stops here); the last step's loss and logged row."""
  s, total = sft.c.sft, sft.total
  progress = Progress(total, start=start_step, stage=job_stage)
  step, loss = 0, float("nan")  # nan: no step left to run in this leg
  compiled_stages = set()
  row: dict[str, float] = {}  # the last logged step's metrics
  with PreemptionGuard() as preemption:
    for epoch, steps in enumerate(sft.steps_per_epoch):
      for i in range(steps):
        if step < start_step:  # done before the restart (the order is the seed's)
          step += 1
          continue
        stage = sft.stage_at(step)
        if stage not in compiled_stages:  # each DSA stage is a program of its own
          compiled_stages.add(stage)
          logging.info("compiling the SFT step%s...", f" ({stage})" if stage else "")
        loss, aux = sft.step(sft.batch(epoch, i), stage)
        step += 1
        if step % s.log_every == 0 or step == total:
          if "router_load" in aux:
            aux.update(ts.load_metrics(aux.pop("router_load")))
          row = {"sft/train_loss": float(loss), "epoch": epoch,
                 **{k: float(v) for k, v in aux.items()}}
          extra = "".join(f" {k} {v:.3f}" for k, v in row.items() if k not in
                          ("sft/train_loss", "epoch"))
          logging.info("%ssft step %d/%d epoch %d loss %.4f%s%s %s", progress.prefix, step,
                       total, epoch, row["sft/train_loss"], f" [{stage}]" if stage else "",
                       extra, progress.suffix(step))
          if step < total:  # the last step's row also holds the final held-out loss
            writer.write(step, row)
        if step < total:  # the last step's checkpoint is the final one, with its metrics
          save(step)
          preemption.stop_if_requested("SFT", step, total, save, ckpt, writer)
  return float(loss), row
