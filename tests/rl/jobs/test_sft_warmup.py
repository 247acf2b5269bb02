"""The DSA stages of SFT: the dense stage (a model trained from scratch: dense attention, the
whole model learns), the dense warm-up (DeepSeek-V3.2 eq. 3: the main model is frozen and only
the lightning indexers learn, from the indexer KL) and the sparse stage (everything learns)."""

from types import SimpleNamespace

import jax
import numpy as np
from flax import nnx

from rl.core.policy import build_policy, model_config
from rl.jobs import sft
from rl.jobs.checkpoint import Checkpointer
from test_trainer import small_config


def run_and_compare(config, workdir):
  """(indexer leaves changed, other leaves changed) by an SFT run: parameter paths, and the
  MoE router biases (the aux-loss-free balance step) under the other leaves."""
  sft.run(config, str(workdir))
  _, params, rest = nnx.split(build_policy(config), nnx.Param, ...)
  ckpt = Checkpointer(workdir / "checkpoints")
  restored, _ = ckpt.restore(ckpt.latest_step(), {"params": params, "rest": rest},
                             partial=True)
  ckpt.close()
  changed = {"indexer": [], "other": []}
  for tree, after in ((params, restored["params"]), (rest, restored["rest"])):
    flat_before = jax.tree_util.tree_flatten_with_path(tree)[0]
    flat_after = jax.tree.leaves(after)
    assert len(flat_before) == len(flat_after)
    for (path, before), new in zip(flat_before, flat_after):
      if not np.array_equal(np.asarray(before), np.asarray(new)):
        name = jax.tree_util.keystr(path)
        changed["indexer" if "['indexer']" in name else "other"].append(name)
  return changed, len(jax.tree.leaves(params)) + len(jax.tree.leaves(rest))


def test_dense_warmup_updates_only_the_indexers(tmp_path):
  """Three SFT steps, all in the dense warm-up, with weight decay on: every indexer leaf of
  both layers moves, and no other parameter nor router bias does."""
  c = small_config(**{"sft.epochs": 1, "sft.dense_steps": 0, "sft.dense_warmup_steps": 1000,
                      "sft.weight_decay": 0.1})
  changed, leaves = run_and_compare(c, tmp_path)
  assert not changed["other"], changed["other"]
  assert len(changed["indexer"]) == 10, changed["indexer"]  # 5 leaves x 2 DSA layers
  assert leaves > 20


def test_sparse_stage_trains_the_whole_model(tmp_path):
  """One warm-up step then sparse ones: the main model's parameters learn again."""
  c = small_config(**{"sft.epochs": 1, "sft.dense_steps": 0, "sft.dense_warmup_steps": 1})
  changed, _ = run_and_compare(c, tmp_path)
  assert len(changed["other"]) > 20 and len(changed["indexer"]) == 10


def test_stages_run_dense_then_warmup_then_sparse():
  """sft.dense_steps of "dense", then sft.dense_warmup_steps of "dense_warmup", then "sparse";
  no stages for a model without DSA or with the indexer loss off."""
  c = small_config(**{"sft.dense_steps": 2, "sft.dense_warmup_steps": 3})
  stage = SimpleNamespace(c=c, model_cfg=model_config(c))
  assert [sft._Stage.stage_at(stage, i) for i in range(7)] == (
      ["dense"] * 2 + ["dense_warmup"] * 3 + ["sparse"] * 2)
  off = small_config(**{"sft.dense_steps": 2, "sft.indexer_coef": 0.0})
  assert sft._Stage.stage_at(SimpleNamespace(c=off, model_cfg=model_config(off)), 0) is None


def test_dense_stage_trains_the_whole_model_and_the_indexers(tmp_path):
  """SFT steps all in the dense stage (no warm-up): the main model and every indexer leaf of
  both layers learn."""
  c = small_config(**{"sft.epochs": 1, "sft.dense_steps": 1000, "sft.dense_warmup_steps": 0})
  changed, _ = run_and_compare(c, tmp_path)
  assert len(changed["other"]) > 20 and len(changed["indexer"]) == 10
