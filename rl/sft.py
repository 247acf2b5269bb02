"""Supervised fine-tuning (the cold start before RL): next-token loss on response tokens only,
AdamW with warm-up and cosine decay (Seed-Thinking-v1.5: peak 2e-5 decaying to 2e-6 at full
scale), epochs over the data, held-out loss, and an orbax checkpoint `{"params": ...}` that an
RL run reads through `config.init_checkpoint`.
"""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging
from flax import nnx

from configs import common
from models.tokenizer import load_tokenizer, pad_batch
from rl.checkpoint import Checkpointer
from rl.data.entries import encode_prompts, load_entries


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


def make_batch(examples, pad_id: int, width: int) -> dict[str, np.ndarray]:
  """Right-padded tokens [B, W] and a loss mask that is 1 on response tokens only."""
  seqs = [p + r for p, r in examples]
  tokens, lengths = pad_batch(seqs, length=width, pad_id=pad_id)
  prompt_lens = np.array([len(p) for p, _ in examples])
  pos = np.arange(width)[None, :]
  loss_mask = (pos >= prompt_lens[:, None]) & (pos < lengths[:, None])
  return {"tokens": tokens, "loss_mask": loss_mask.astype(np.float32),
          "token_mask": (pos < lengths[:, None]).astype(np.float32)}


def response_nll(logits: jax.Array, tokens: jax.Array, loss_mask: jax.Array) -> jax.Array:
  """Summed NLL of the masked tokens (token t predicted from position t - 1)."""
  logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
  logp = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  return -jnp.sum(logp * loss_mask[:, 1:])


def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  c = config
  common.validate(c)
  s = c.sft
  tokenizer = load_tokenizer(c.tokenizer)
  entries, heldout = load_entries(c)
  train_ex = sft_examples(entries, tokenizer, c.data.prompt_template)
  eval_ex = sft_examples(heldout, tokenizer, c.data.prompt_template)
  width = max(len(p) + len(r) for p, r in train_ex + eval_ex)
  width = -(-width // 8) * 8

  common.check_single_device_run(c)
  model = common.build_policy(c)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  steps_per_epoch = max(len(train_ex) // s.batch_size, 1)
  total = s.epochs * steps_per_epoch
  schedule = optax.warmup_cosine_decay_schedule(0.0, s.lr, min(s.warmup_steps, total - 1),
                                                total, end_value=s.lr * s.final_lr_fraction)
  optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.adamw(schedule, weight_decay=s.weight_decay))
  opt_state = optimizer.init(params)

  dsa = common.model_config(c).dsa

  def loss_fn(params, batch, stage):
    out = nnx.merge(graphdef, params, rest).forward(batch["tokens"], indexer_stage=stage,
                                                    token_mask=batch["token_mask"])
    loss = response_nll(out.logits, batch["tokens"], batch["loss_mask"]) / jnp.maximum(
        jnp.sum(batch["loss_mask"][:, 1:]), 1.0)
    if stage is None:
      return loss, {}
    # The indexer's inputs and targets are detached: this term trains only the indexer.
    index = out.indexer_loss / jnp.maximum(jnp.sum(batch["token_mask"]), 1.0)
    return loss + s.indexer_coef * index, out.indexer_metrics

  @functools.partial(jax.jit, static_argnums=3)
  def train_step(params, opt_state, batch, stage):
    (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch, stage)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, aux

  def stage_at(step: int) -> str | None:
    """DSA: a dense warm-up (dense attention, the indexer fitted to it), then sparse training
    with the indexer loss restricted to its own top-k; None for non-DSA models."""
    if not dsa or not s.indexer_coef:
      return None
    return "dense_warmup" if step < s.dense_warmup_steps else "sparse"

  @jax.jit
  def eval_sums(params, batch):
    logits = nnx.merge(graphdef, params, rest)(batch["tokens"])
    return (response_nll(logits, batch["tokens"], batch["loss_mask"]),
            jnp.sum(batch["loss_mask"][:, 1:]))

  def eval_loss(params) -> float:
    nll = count = 0.0
    for i in range(0, len(eval_ex), s.batch_size):
      chunk = eval_ex[i:i + s.batch_size]
      chunk = chunk + chunk[:1] * (s.batch_size - len(chunk))  # fixed shape; repeats unweighted
      batch = make_batch(chunk, tokenizer.pad_id, width)
      real = len(eval_ex[i:i + s.batch_size])
      batch["loss_mask"][real:] = 0.0
      a, b = eval_sums(params, batch)
      nll, count = nll + float(a), count + float(b)
    return nll / max(count, 1.0)

  rng = np.random.default_rng(c.seed)
  metrics = {"sft/eval_loss_start": eval_loss(params)}
  logging.info("SFT: %d examples, %d steps, eval loss %.4f", len(train_ex), total,
               metrics["sft/eval_loss_start"])
  t0 = time.perf_counter()
  step = 0
  for epoch in range(s.epochs):
    order = rng.permutation(len(train_ex))
    for i in range(steps_per_epoch):
      idx = order[i * s.batch_size:(i + 1) * s.batch_size]
      batch = make_batch([train_ex[j] for j in idx], tokenizer.pad_id, width)
      stage = stage_at(step)
      params, opt_state, loss, aux = train_step(params, opt_state, batch, stage)
      step += 1
      if step % s.log_every == 0 or step == total:
        elapsed = time.perf_counter() - t0
        extra = "".join(f" {k} {float(v):.3f}" for k, v in aux.items())
        logging.info("sft step %d/%d epoch %d loss %.4f%s%s ETA %.0fs", step, total, epoch,
                     float(loss), f" [{stage}]" if stage else "", extra,
                     elapsed / step * (total - step))
  metrics["sft/eval_loss"] = eval_loss(params)
  metrics["sft/train_loss"] = float(loss)
  metrics["sft/wall_s"] = time.perf_counter() - t0
  logging.info("SFT done: eval loss %.4f -> %.4f", metrics["sft/eval_loss_start"],
               metrics["sft/eval_loss"])
  ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), keep=1)
  ckpt.save(total, {"params": params}, {"step": total, **metrics}, force=True)
  ckpt.close()
  return metrics
