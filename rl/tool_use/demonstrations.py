"""Expert tool-use transcripts and the SFT warm start they feed.

`DemonstrationPolicy` is a `GenerateFn` (rl/tool_use/rollout.py) that plays fixed assistant turns
instead of sampling: replaying an environment's demonstrations through the real multi-turn
rollout executes the tools for real, so the transcripts hold true tool results with
response_mask 0, exactly the layout RL episodes have. `warm_start` fits a policy to them with
the next-token loss on assistant tokens only (tool output never receives gradient), a cold
start on synthesised agentic trajectories before RL, as DeepSeek-V3.2 does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models.tokenizer import IM_END
from rl.core import train_step as ts
from rl.core.losses import response_nll
from rl.tool_use import calls, environments
from rl.tool_use.rollout import ToolRollout


class DemonstrationPolicy:
  """Plays `turns_by_uid[uid]` (assistant turns; the last, unless a call, is closed by the end
  of turn) under the engine's contract: each call continues a context at index
  `generated_before` of the episode's token stream and stops after a stop id (final or
  tool-call) or `max_new` tokens. Past the script it writes `filler` tokens."""

  def __init__(self, tokenizer, turns_by_uid: Mapping[int, Sequence[str]], *,
               logp: float = 0.0, filler: str = "x"):
    self.stops = set(tokenizer.stop_ids) | {calls.call_stop_id(tokenizer)}
    end_of_turn = tokenizer.token_to_id(IM_END)
    end_of_turn = tokenizer.eos_id if end_of_turn is None else end_of_turn
    self.filler = tokenizer.encode(filler)[0]
    self.logp = logp
    self.streams = {}
    for uid, turns in turns_by_uid.items():
      stream = []
      for k, turn in enumerate(turns):
        stream += tokenizer.encode(turn)
        if k == len(turns) - 1 and not calls.ends_with_call(turn):
          stream.append(end_of_turn)
      self.streams[uid] = stream
    self.rounds = 0

  def __call__(self, ids, lens, uids, generated_before, max_new) -> dict[str, np.ndarray]:
    self.rounds += 1
    n = len(ids)
    tokens = np.concatenate([ids, np.zeros((n, int(np.max(max_new))), np.int32)], 1)
    logp = np.zeros(tokens.shape, np.float32)
    new_count, stopped = np.zeros(n, np.int32), np.zeros(n, bool)
    for i in range(n):
      stream, position = self.streams[int(uids[i])], int(generated_before[i])
      while new_count[i] < max_new[i] and not stopped[i]:
        token = stream[position] if position < len(stream) else self.filler
        tokens[i, lens[i] + new_count[i]] = token
        logp[i, lens[i] + new_count[i]] = self.logp
        new_count[i] += 1
        position += 1
        stopped[i] = token in self.stops
    return {"tokens": tokens, "logp_old": logp, "new_count": new_count, "stopped": stopped}


def transcripts(rollout: ToolRollout, prompts: Sequence[Sequence[int]],
                entries: Sequence[Mapping[str, Any]], *, prompt_width: int = 0):
  """Trajectories of the entries' demonstrations with the tools really run, and episode info."""
  policy = DemonstrationPolicy(rollout.tokenizer, {
      uid: environments.demonstration(entry) for uid, entry in enumerate(entries)})
  return rollout.run(prompts, entries, policy, group_id=np.arange(len(entries)),
                     prompt_width=prompt_width)


def warm_start(graphdef, params, rest, batches: Sequence[Any], *, steps: int,
               optimizer: optax.GradientTransformation,
               seed: int = 0) -> tuple[Any, list[float]]:
  """`steps` `optimizer` steps of the mean next-token loss on assistant tokens, over mini-batches
  drawn from `batches` (Trajectories); returns the new params and the per-step losses."""

  def loss_fn(params, tokens, loss_mask, token_mask):
    logits = nnx.merge(graphdef, params, rest).forward(tokens, token_mask=token_mask).logits
    return response_nll(logits, tokens, loss_mask), {}

  step = jax.jit(ts.gradient_step(loss_fn, optimizer))

  opt_state = optimizer.init(params)
  order = np.random.default_rng(seed).integers(0, len(batches), size=steps)
  losses = []
  for index in order:
    traj = batches[index]
    mask = np.asarray(traj.response_mask, np.float32)
    width = mask.shape[1]
    last = np.where(mask.any(-1), width - np.argmax(mask[:, ::-1] > 0, -1), 0)
    token_mask = (np.arange(width)[None, :] < last[:, None]).astype(np.float32)
    params, opt_state, loss, _ = step(params, opt_state, jnp.asarray(traj.tokens),
                                      jnp.asarray(mask), jnp.asarray(token_mask))
    losses.append(float(loss))
  return params, losses
