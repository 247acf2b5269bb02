"""Checkpoints (rl/jobs/checkpoint.py): restore onto another mesh, and a save killed half-way."""

import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from models import sharding as sharding_lib
from rl.jobs.checkpoint import Checkpointer

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def _train_state(mesh, seed):
  """Parameters born sharded on `mesh`, AdamW moments after one update (so they are not all
  zeros and follow their parameters' shardings), step 1."""
  params = nnx.state(sharding_lib.shard_model_init("tiny_dense", mesh, seed=seed),
                     nnx.Param)
  optimizer = optax.adamw(1e-3)

  @jax.jit
  def init_and_step(params):
    grads = jax.tree.map(lambda x: jnp.sin(x) + 0.5, params)
    updates, opt_state = optimizer.update(grads, optimizer.init(params), params)
    return {"params": optax.apply_updates(params, updates), "opt_state": opt_state,
            "step": jnp.ones((), jnp.int32)}

  return init_and_step(params)


def test_restore_onto_a_different_mesh(tmp_path):
  """A train state (parameters + AdamW moments + step) saved sharded on fsdp8 and restored
  through an abstract target built on dp2 x tp4 has identical values and the new shardings."""
  save_mesh = sharding_lib.make_mesh({"fsdp": 8})
  load_mesh = sharding_lib.make_mesh({"data": 2, "tensor": 4})
  state = _train_state(save_mesh, seed=4)
  embedding = state["params"]["embed"]["embedding"].get_value()
  assert "fsdp" in embedding.sharding.spec

  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(7, {"train": state}, {"step": 7}, force=True)
  ckpt.close()

  # What a resumed run does: build its state for the current mesh (other values), restore
  # into its shapes, dtypes and shardings.
  target = {"train": _train_state(load_mesh, seed=5)}
  restored, record = Checkpointer(str(tmp_path / "ckpt")).restore(7, target)
  assert record == {"step": 7}
  got_leaves = jax.tree_util.tree_leaves_with_path(restored)
  assert len(got_leaves) == len(jax.tree.leaves(target)) > 20
  for (path, got), want, like in zip(got_leaves, jax.tree.leaves({"train": state}),
                                     jax.tree.leaves(target)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want),
                                  err_msg=jax.tree_util.keystr(path))
    assert got.sharding == like.sharding, jax.tree_util.keystr(path)
  want_params = sharding_lib.state_shardings(restored["train"]["params"], load_mesh)
  for (path, var), (_, sharding) in zip(restored["train"]["params"].flat_state(),
                                        want_params.flat_state()):
    assert var.get_value().sharding.is_equivalent_to(sharding, var.get_value().ndim), path
  q = restored["train"]["params"]["stacks"][0]["attn"]["q_proj"]["kernel"].get_value()
  assert q.sharding.mesh == load_mesh and "tensor" in q.sharding.spec


_KILLED_SAVE = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    import jax.numpy as jnp
    from orbax.checkpoint._src.path import atomicity
    from rl.jobs.checkpoint import Checkpointer

    ckpt = Checkpointer({directory!r}, keep=3)
    ckpt.save(1, {{"w": jnp.arange(4096.0)}}, {{"step": 1}})
    ckpt.wait()

    async def hang(self):
      # Step 2's arrays are written; stop before the rename that commits them.
      print("FINALIZING", flush=True)
      time.sleep(600)

    atomicity.AtomicRenameTemporaryPath.finalize = hang
    ckpt.save(2, {{"w": 2 * jnp.arange(4096.0)}}, {{"step": 2}})
    ckpt.wait()
""")


def test_killed_save_keeps_the_last_good_checkpoint(tmp_path):
  """A process SIGKILLed in the middle of saving step 2 (its arrays written to orbax's
  temporary directory, not yet committed) leaves step 1 intact: latest_step() is 1, step 1
  restores exactly, and the next save of step 2 succeeds over the debris."""
  directory = str(tmp_path / "ckpt")
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  child = subprocess.Popen(
      [sys.executable, "-c", _KILLED_SAVE.format(repo=REPO, directory=directory)],
      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
  try:
    for line in child.stdout:
      if line.strip() == "FINALIZING":
        break
    else:
      raise AssertionError(f"the saving process exited ({child.wait()}) before step 2")
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
  finally:
    if child.poll() is None:
      os.kill(child.pid, signal.SIGKILL)
      child.wait()
  leftovers = sorted(os.listdir(directory))
  assert "1" in leftovers and "2" not in leftovers
  assert any(name.startswith("2.") and "tmp" in name for name in leftovers), leftovers

  ckpt = Checkpointer(directory, keep=3)
  assert ckpt.latest_step() == 1
  target = {"w": jax.ShapeDtypeStruct((4096,), jnp.float32)}
  restored, record = ckpt.restore(1, target)
  np.testing.assert_array_equal(np.asarray(restored["w"]), np.arange(4096.0))
  assert record == {"step": 1}
  ckpt.save(2, {"w": 3 * jnp.arange(4096.0)}, {"step": 2})
  ckpt.wait()
  assert ckpt.latest_step() == 2
  np.testing.assert_array_equal(np.asarray(ckpt.restore(2, target)[0]["w"]),
                                3 * np.arange(4096.0))
  ckpt.close()
