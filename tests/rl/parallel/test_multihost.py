"""Multi-process JAX (rl/parallel/distributed.py): environment parsing, and two local processes (gloo
CPU collectives over 127.0.0.1) that train like one: a hand-written data-parallel step, and
the RL trainer itself."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from rl.parallel import distributed

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
DEVICES_PER_PROCESS = 2

# Three SGD steps of a linear model on a data-parallel mesh over every device of every
# process. The loss is a global token mean: masked squared errors and token counts are summed
# per shard and psum'd over the mesh, so shards holding different numbers of valid tokens are
# weighted correctly.
_WORKER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {repo!r})
    from rl.parallel import distributed
    info = distributed.initialize_from_env()

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from models import sharding as sharding_lib

    mesh = sharding_lib.make_mesh({{"data": -1}})
    rng = np.random.default_rng(0)
    x_np = rng.normal(size=(16, 8, 4)).astype(np.float32)  # [batch, tokens, features]
    y_np = rng.normal(size=(16, 8)).astype(np.float32)
    mask_np = (rng.random((16, 8)) < np.linspace(0.2, 1.0, 16)[:, None]).astype(np.float32)

    def global_array(value, spec):
      sharding = NamedSharding(mesh, spec)
      return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])

    x = global_array(x_np, P("data"))
    y = global_array(y_np, P("data"))
    mask = global_array(mask_np, P("data"))
    w = global_array(np.zeros(4, np.float32), P())

    def loss_fn(w, x, y, mask):
      def local(w, x, y, mask):
        err = (x @ w - y) ** 2 * mask
        return jax.lax.psum(err.sum(), "data") / jax.lax.psum(mask.sum(), "data")
      return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), P("data"), P("data")),
                           out_specs=P())(w, x, y, mask)

    @jax.jit
    def step(w, x, y, mask):
      loss, grad = jax.value_and_grad(loss_fn)(w, x, y, mask)
      return w - 0.1 * grad, loss

    losses = []
    for _ in range(3):
      w, loss = step(w, x, y, mask)
      losses.append(float(loss.addressable_shards[0].data))
    print("RESULT " + json.dumps(dict(losses=losses, process=jax.process_index(),
                                      processes=jax.process_count(),
                                      devices=jax.device_count(),
                                      main=distributed.is_main_process(),
                                      source=info.source)), flush=True)
""")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


# The RL trainer (rl/jobs/trainer.py) for one DAPO step with a KL term and FP8 sampler weights on a
# data 2 x FSDP 2 x tensor 2 mesh over every device of every process: rollout outputs are
# gathered to every process, batches placed from identical host copies, one checkpoint written
# jointly, metrics written by process 0 only.
_TRAINER_WORKER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {repo!r})
    sys.path.insert(0, {repo!r} + "/tests")
    sys.path.insert(0, {repo!r} + "/tests/rl/jobs")
    from rl.parallel import distributed
    distributed.initialize_from_env()

    import jax
    jax.config.update("jax_default_matmul_precision", "highest")
    from test_trainer import small_config
    from rl.jobs.trainer import Trainer

    c = small_config(**{{"train.steps": 1, "rl.dynamic_sampling": False, "rl.kl_coef": 0.01,
                        "rollout.weight_dtype": "fp8_e4m3", "mesh.devices": 0}})
    c.mesh.shape.update(data=2, fsdp=2, tensor=2)
    last = Trainer(c, sys.argv[1]).run()
    print("RESULT " + json.dumps(dict(
        {{k: last[k] for k in ("loss", "reward", "grad_norm", "sampler/logp_gap_mean")}},
        process=jax.process_index(), devices=jax.device_count())), flush=True)
""")


def _run_workers(envs: list[dict], timeout: int = 120, worker: str = _WORKER,
                 args: list[list[str]] | None = None) -> list[dict]:
  args = args or [[] for _ in envs]
  procs = [subprocess.Popen([sys.executable, "-c", worker.format(repo=REPO), *arg], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for env, arg in zip(envs, args)]
  results = []
  try:
    for proc in procs:
      out, err = proc.communicate(timeout=timeout)
      lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
      assert proc.returncode == 0 and lines, f"worker failed ({proc.returncode}):\n{err[-3000:]}"
      results.append(json.loads(lines[-1][len("RESULT "):]))
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()
  return results


def _base_env(devices: int) -> dict:
  env = {k: v for k, v in os.environ.items()
         if not k.startswith(("JAX_COORDINATOR", "JAX_NUM_PROCESSES", "JAX_PROCESS_"))}
  env.update(JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  return env


def test_two_processes_train_like_one():
  """Two processes (2 CPU devices each, joined by initialize_from_env from JAX_* variables,
  gloo collectives on 127.0.0.1) run 3 SGD steps with a psum'd global token mean and report
  the losses of one process holding all 4 devices; only process 0 is the main process."""
  port = _free_port()
  envs = []
  for pid in range(2):
    env = _base_env(DEVICES_PER_PROCESS)
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
               JAX_PROCESS_ID=str(pid))
    envs.append(env)
  multi = _run_workers(envs + [_base_env(2 * DEVICES_PER_PROCESS)])
  single = multi.pop()
  assert single["processes"] == 1 and single["source"] == "single"
  for pid, result in enumerate(multi):
    assert (result["process"], result["processes"], result["devices"]) == (pid, 2, 4)
    assert result["main"] == (pid == 0) and result["source"] == "explicit"
    np.testing.assert_allclose(result["losses"], single["losses"], rtol=1e-6)
  assert single["losses"][2] < single["losses"][0]


def test_two_process_trainer_matches_one_process(tmp_path):
  """The RL trainer in two processes of 4 CPU devices each (one 8-device mesh, both writing
  one checkpoint directory) gives the loss, reward, gradient norm and FP8 sampler gap of one
  process holding all 8 devices; only process 0 writes metrics."""
  port = _free_port()
  envs = []
  for pid in range(2):
    env = _base_env(4)
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
               JAX_PROCESS_ID=str(pid))
    envs.append(env)
  two, one = str(tmp_path / "two"), str(tmp_path / "one")
  results = _run_workers(envs + [_base_env(8)], timeout=600, worker=_TRAINER_WORKER,
                         args=[[two], [two], [one]])
  single = results.pop()
  assert [r["process"] for r in results] == [0, 1] and single["devices"] == 8
  for result in results:
    assert result["devices"] == 8
    for key in ("loss", "reward", "grad_norm", "sampler/logp_gap_mean"):
      np.testing.assert_allclose(result[key], single[key], rtol=1e-5, err_msg=key)
  with open(os.path.join(two, "metrics.jsonl")) as f:
    assert len(f.readlines()) == 1  # one writer
  assert os.path.isdir(os.path.join(two, "checkpoints", "1"))


def test_process_info_from_each_launcher_environment():
  """The rank, count and coordinator come out right from explicit JAX_* variables, a GKE
  JobSet pod (JOB_INDEX * PROCESSES_IN_JOB + JOB_COMPLETION_INDEX, coordinator from the
  JobSet's service name), a Vertex AI / XManager CLUSTER_SPEC, and jax-detected clusters;
  an empty environment is one process."""
  info = distributed.process_info_from_env({})
  assert info == distributed.ProcessInfo(1, 0, None, "single")
  info = distributed.process_info_from_env(
      {"JAX_COORDINATOR_ADDRESS": "10.0.0.2", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_ID": "3"})
  assert info == distributed.ProcessInfo(4, 3, "10.0.0.2:8476", "explicit")
  info = distributed.process_info_from_env(
      {"JAX_PROCESS_COUNT": "8", "JOB_INDEX": "1", "PROCESSES_IN_JOB": "4",
       "JOB_COMPLETION_INDEX": "2", "JOBSET_NAME": "rl", "REPLICATED_JOB_NAME": "slice",
       "JAX_COORDINATOR_PORT": "1234"})
  assert info == distributed.ProcessInfo(8, 6, "rl-slice-0-0.rl:1234", "gke_jobset")
  spec = {"cluster": {"workerpool0": ["chief:2222"], "workerpool1": ["w0:2222", "w1:2222"]},
          "task": {"type": "workerpool1", "index": 1}}
  info = distributed.process_info_from_env({"CLUSTER_SPEC": json.dumps(spec)})
  assert info == distributed.ProcessInfo(3, 2, "chief:2222", "cluster_spec")
  info = distributed.process_info_from_env({"TPU_WORKER_HOSTNAMES": "t0,t1,t2,t3"})
  assert info.source == "jax_auto"
  assert distributed.process_info_from_env({"TPU_WORKER_HOSTNAMES": "t0"}).source == "single"


def test_bad_launcher_environment_names_the_variable():
  """Malformed or inconsistent variables fail before any network call, naming the variable."""
  with pytest.raises(ValueError, match="JAX_PROCESS_ID='one' is not an integer"):
    distributed.process_info_from_env({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "one",
                                       "JAX_COORDINATOR_ADDRESS": "h"})
  with pytest.raises(ValueError, match=r"process id 2 is not in \[0, JAX_NUM_PROCESSES=2\)"):
    distributed.process_info_from_env({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2",
                                       "JAX_COORDINATOR_ADDRESS": "h"})
  with pytest.raises(ValueError, match="needs JAX_COORDINATOR_ADDRESS"):
    distributed.process_info_from_env({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"})
  with pytest.raises(ValueError, match="neither JAX_PROCESS_ID nor JOB_COMPLETION_INDEX"):
    distributed.process_info_from_env({"JAX_NUM_PROCESSES": "2"})
  with pytest.raises(ValueError, match="PROCESSES_IN_JOB is required"):
    distributed.process_info_from_env({"JAX_NUM_PROCESSES": "4", "JOB_INDEX": "1",
                                       "JOB_COMPLETION_INDEX": "0",
                                       "JAX_COORDINATOR_ADDRESS": "h"})
  with pytest.raises(ValueError, match="CLUSTER_SPEC is not a Vertex AI cluster spec"):
    distributed.process_info_from_env({"CLUSTER_SPEC": "{not json"})
  assert distributed.initialize_from_env({}).source == "single"  # no-op, no jax init
