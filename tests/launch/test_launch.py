"""Launchers: the dry run's sizes for the real-model recipes (abstract meshes on CPU) and for a
tiny config compiled on the 8 local devices; XManager's argument pass-through without
xmanager; the GKE JobSet templates rendered and checked for the fields a JobSet, the TPU / GPU
scheduler and rl/parallel/distributed.py need."""

import importlib.util
import os
import subprocess
import sys

import pytest
import yaml

from launch import cli, dry_run, xm_launch
from launch.gke import render
from models.config import PUBLISHED_PARAMS
from rl.config.defaults import base_config
from rl.config.describe import leaves
from rl.parallel import distributed

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GKE = os.path.join(ROOT, "launch", "gke")


def launcher_env(**extra: str) -> dict:
  """The environment a user's `python launch/...` runs in: one CPU device, jax's default
  matmul precision (this suite's conftest sets 8 host devices and "highest" precision, and the
  demo's SFT lands elsewhere under those numerics: docs/demo.md, "The DSA stages")."""
  return dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu", **extra)


def load(name, arg=None):
  spec = importlib.util.spec_from_file_location("cfg", os.path.join(ROOT, "configs", name))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config() if arg is None else module.get_config(arg)


@pytest.fixture(scope="module")
def v32_report():
  return dry_run.report(load("deepseek_v32_moe_tpu.py"))


def test_tpu_recipe_dry_run_sizes(v32_report):
  """The 671B recipe sizes on this CPU through an abstract 512-chip mesh: the parameter count
  is the published 671B (within 1%), the bf16 parameters are ~1/512 of the total per chip
  (experts 512-way, the rest 64-way), AdamW runs on float32 master weights (master + two moments
  = 6x the bf16 bytes), nothing of >= 1 MiB is left whole on every chip, and so lr 1e-6 steps do
  not round away."""
  r = v32_report
  assert r["abstract_mesh"] and r["devices"] == 512
  assert r["mesh_shape"]["expert"] == 8
  assert abs(r["params_total"] / (PUBLISHED_PARAMS["deepseek-v3.2-671b"]["total"] * 1e9) - 1) < 0.01
  assert r["params_active"] < r["params_total"] / 10
  assert r["param_bytes_total"] == 2 * r["params_total"]
  ideal = r["param_bytes_total"] / 512
  assert ideal <= r["param_bytes_per_device"] < 2.2 * ideal  # the non-expert rest: 64-way
  assert 2 * 2**30 < r["param_bytes_per_device"] < 5 * 2**30
  # AdamW on float32 master weights: the master copy and both moments in float32, 6x the
  # bf16 parameters' bytes.
  assert r["optimizer_dtypes"] == ["float32"]
  assert 0 <= r["optimizer_bytes_per_device"] - 6 * r["param_bytes_per_device"] < 64  # + counts
  assert r["reference_bytes_per_device"] == r["param_bytes_per_device"]  # grpo_v32 has KL
  assert r["replicated_params"] == []
  assert r["micro_batch_rows"] % r["batch_shards"] == 0
  assert not r["updates_round_away"]  # the master weights keep lr-sized steps
  assert r["compiled"] is None
  text = "\n".join(dry_run.format_report(r))
  assert "abstract" in text and "analytic" in text and "671.878B total" in text


def test_small_tpu_recipe_is_sharded_everywhere():
  """The scaled-down MoE+MLA+DSA recipe's 32-chip mesh leaves no big parameter replicated and
  gives one sequence per batch shard per micro-batch."""
  r = dry_run.report(load("deepseek_v32_moe_tpu.py", "small"))
  assert r["devices"] == 32 and r["abstract_mesh"]
  assert r["replicated_params"] == []
  assert r["micro_batch_rows"] == r["batch_shards"]
  assert r["params_active"] < r["params_total"] / 3


@pytest.mark.parametrize("size,published", [("1.5b", "qwen2.5-1.5b"), ("7b", "qwen2.5-7b")])
def test_gpu_recipe_dry_run_sizes(size, published):
  """The DAPO recipe on one 8-GPU host: the published parameter count, fp32 parameters sharded
  8 ways (per GPU = total / 8 within 1%), fp32 AdamW moments twice that, no rounding hazard, one
  sequence per batch shard, and analytic totals of the update and of the rollout that fit an
  80 GB GPU. The rollout's KV cache is its 512 slots' (split over the fsdp rows and the tensor
  axis' KV heads), and a refill prefills each prompt once for its 16 samples."""
  r = dry_run.report(load("qwen2_5_math_dapo.py", size), compile_step=False)
  assert abs(r["params_total"] / (PUBLISHED_PARAMS[published]["total"] * 1e9) - 1) < 0.01
  assert r["devices"] == 8 and r["compiled"] is None
  assert r["param_bytes_total"] == 4 * r["params_total"]
  assert r["param_bytes_per_device"] == pytest.approx(r["param_bytes_total"] / 8, rel=0.01)
  assert 0 <= r["optimizer_bytes_per_device"] - 2 * r["param_bytes_per_device"] < 64
  assert not r["updates_round_away"]
  assert r["sequence_length"] == r["max_seq_len"] == 4096
  assert r["micro_batch_rows"] == r["batch_shards"]
  assert 10 * 2**30 < r["total_bytes_per_device"] < 80e9
  mesh = r["mesh_shape"]
  kv = r["kv_cache_bytes_per_sequence"] * 512 / mesh["fsdp"] / mesh["tensor"]
  assert r["rollout_analytic"]["kv_cache"] == pytest.approx(kv)
  assert r["rollout_batching"] == dict(slots=512, padded=2048, refill_rows=128,
                                       refill_contexts=9)
  assert kv < r["rollout_total_bytes_per_device"] < 80e9


def test_dry_run_warns_of_a_scan_without_remat():
  """remat none with scanned layers (which stacks every residual of the body) is named in one
  warning line; the shipped 1.5B recipe (unrolled) and a remat policy get none."""
  def warned(**model) -> bool:
    c = load("qwen2_5_math_dapo.py", "1.5b")
    c.unlock()
    c.model.update(model)
    text = dry_run.format_report(dry_run.report(c.lock(), compile_step=False))
    return any(line.startswith("WARNING: remat none with the layers scanned") for line in text)
  assert warned(scan_layers=True)
  assert not warned() and not warned(scan_layers=True, remat="full")


def test_vapo_recipe_counts_the_critic():
  """VAPO's dry run adds the critic's parameters, optimiser state and gradients (about as much
  again as the policy's)."""
  r = dry_run.report(load("vapo_qwen.py"), compile_step=False)
  policy = (r["param_bytes_per_device"] + r["optimizer_bytes_per_device"]
            + r["gradient_bytes_per_device"])
  assert r["critic_bytes_per_device"] == pytest.approx(policy, rel=0.15)
  assert r["reference_bytes_per_device"] == 0


def test_compiled_memory_on_local_devices():
  """A small config whose mesh (data 2 x fsdp 4) fits on the 8 local devices is compiled: XLA's
  aliased (donated) bytes equal the dry run's per-device parameter + optimiser bytes + the step
  counter, i.e. the partition-spec accounting is XLA's, and the analytic activation estimate
  is within 4x of XLA's temporaries."""
  c = base_config(preset="tiny_dense", algorithm="grpo", d_model=256, mlp_dim=1024,
                  n_heads=8, n_kv_heads=2, vocab_size=4096)
  c.mesh.shape.update(fsdp=4)
  c.train.prompts_per_step, c.train.samples_per_prompt = 8, 4
  c.rollout.max_new_tokens = 192
  r = dry_run.report(c.lock(), prompt_len=64)
  assert not r["abstract_mesh"] and r["mesh_shape"]["data"] == 2
  compiled = r["compiled"]
  assert compiled["alias"] == r["param_bytes_per_device"] + r["optimizer_bytes_per_device"] + 4
  assert compiled["argument"] > compiled["alias"]
  assert compiled["peak"] >= compiled["temp"] > 0
  assert compiled["temp"] / 4 < r["activation_bytes_per_device"] < 4 * compiled["temp"]
  text = "\n".join(dry_run.format_report(r))
  assert "XLA:cpu memory analysis" in text
  # The rollout engine compiles too, its state sharded as the update's parameters: its
  # arguments are those parameters plus a few small per-sequence inputs.
  rollout = r["compiled_rollout"]
  assert r["param_bytes_per_device"] <= rollout["argument"] < 1.1 * r["param_bytes_per_device"]
  assert rollout["peak"] >= rollout["temp"] > 0 and rollout["flops"] > 0
  assert "for the rollout engine" in text and "compiled in" in text
  big = base_config(preset="tiny_dense", algorithm="grpo")
  big.mesh.shape.update(data=1, fsdp=16)
  with pytest.raises(ValueError, match="cannot compile"):
    dry_run.report(big.lock(), compile_step=True)


def test_each_device_computes_only_its_rows_of_a_micro_batch():
  """FSDP over 4 devices with 4x the rows per micro-batch needs the per-device temporaries of
  one device with 1x: each device computes its own rows (kernels.constrain_rows pins every
  layer's activation rows to the batch axes). Without it, a micro-batch (one device's block of
  the mini-batch) was computed whole by every device (3.6x here)."""
  def temporaries(fsdp: int, prompts: int) -> int:
    c = base_config(preset="tiny_dense", algorithm="grpo", d_model=128, mlp_dim=512,
                    n_heads=4, n_kv_heads=2, vocab_size=1024, max_seq_len=1024)
    c.mesh.shape.update(data=1, fsdp=fsdp)
    c.train.prompts_per_step, c.train.samples_per_prompt = prompts, 4
    c.train.micro_batches = 4
    c.rollout.max_new_tokens = 448
    return dry_run.report(c.lock(), prompt_len=64, compile_rollout=False)["compiled"]["temp"]
  assert temporaries(fsdp=4, prompts=16) < 1.25 * temporaries(fsdp=1, prompts=4)


def test_mesh_minus_one_takes_the_local_devices():
  """A -1 axis takes what the local devices leave; a fixed mesh bigger than them is abstract."""
  c = base_config(preset="tiny_dense", algorithm="grpo")
  c.mesh.shape.update(data=-1, tensor=2)
  mesh, concrete = dry_run.mesh_for(c)
  assert concrete and dict(mesh.shape)["data"] == 4 and mesh.size == 8
  c.mesh.shape.update(data=4, fsdp=8)
  c.mesh.dcn.update(data=2)
  mesh, concrete = dry_run.mesh_for(c)
  assert not concrete and dict(mesh.shape)["data"] == 8 and mesh.size == 128


def test_train_dry_run_flag_prints_the_report():
  """`launch/train.py --dry_run` prints the report for the 671B recipe and exits 0 without
  training (no workdir is created)."""
  out = subprocess.run(
      [sys.executable, os.path.join(ROOT, "launch", "train.py"),
       "--config=" + os.path.join(ROOT, "configs", "deepseek_v32_moe_tpu.py"), "--dry_run",
       "--workdir=/tmp/seedrl_dry_run_never_created"],
      capture_output=True, text=True, timeout=120,
      env=launcher_env())
  assert out.returncode == 0, out.stderr[-2000:]
  assert "params" in out.stdout and "/device" in out.stdout and "512 devices" in out.stdout
  assert not os.path.exists("/tmp/seedrl_dry_run_never_created")


# ------------------------------------------------------------------------------- train.py

@pytest.mark.parametrize("config_arg,name", [
    ("configs/demo.py", "demo"),
    (f"{ROOT}/configs/demo.py:grpo_v32", "demo_grpo_v32"),
    ("configs/demo.py:vapo", "demo_vapo"),
    ("configs/qwen2_5_math_dapo.py:7b", "qwen2_5_math_dapo_7b"),
    ("configs/demo.py:a/b c", "demo_a_b_c"),
])
def test_default_workdir_names_the_variant(config_arg, name):
  """A run's default workdir (workdir/<run_name>) holds the config file's variant: the DAPO
  demo and its grpo_v32 variant never resume each other's checkpoints; a variant that is not
  a plain word stays one path component."""
  assert cli.run_name(config_arg) == name


def test_resuming_a_workdir_under_another_variant_is_refused_on_one_line(tmp_path):
  """The issue's case: the DAPO demo's workdir (its SFT stage holds a checkpoint and the DAPO
  config) rerun with configs/demo.py:grpo_v32 and the same --workdir stops at start, exit
  status 2, one `error:` line naming the rl fields that differ with both values and the flag
  that allows it; nothing of the run is touched (config.json is still DAPO's, no history)."""
  import numpy as np

  from rl.jobs import checkpoint
  sft_dir = tmp_path / "sft"
  checkpoint.save_run_config(sft_dir, load("demo.py"), step=None)
  ckpt = checkpoint.Checkpointer(sft_dir / "checkpoints")
  ckpt.save(1, {"x": np.zeros(1)}, {"step": 1}, force=True)
  ckpt.close()
  saved = (sft_dir / "config.json").read_text()
  out = subprocess.run(
      [sys.executable, os.path.join(ROOT, "launch", "train.py"),
       f"--config={os.path.join(ROOT, 'configs', 'demo.py')}:grpo_v32", f"--workdir={tmp_path}"],
      capture_output=True, text=True, timeout=300,
      env=launcher_env())
  errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
  assert out.returncode == 2 and len(errors) == 1, out.stderr
  assert "Traceback" not in out.stderr
  assert "config.rl.kl_coef=0.0 there, 0.01 now" in errors[0]
  assert "config.rl.keep_routing=False there, True now" in errors[0]
  assert "--allow_config_change" in errors[0]
  assert (sft_dir / "config.json").read_text() == saved
  assert not (sft_dir / checkpoint.HISTORY).exists()


def test_train_names_a_bad_workdir_or_mesh_at_start(tmp_path):
  """launch/train.py exits with status 2 and one `error:` line, before anything is built, for a
  --workdir that is a file or lies inside one, and for a mesh larger than the machine (one CPU
  device here); nothing is written."""
  a_file = tmp_path / "notes.txt"
  a_file.write_text("not a workdir")
  demo = f"--config={os.path.join(ROOT, 'configs', 'demo.py')}"
  cases = [([demo, f"--workdir={a_file}"], rf"--workdir={a_file} is a file"),
           ([demo, f"--workdir={a_file}/run"], rf"--workdir={a_file}/run is inside the file"),
           ([demo, f"--workdir={tmp_path}/run", "--config.mesh.devices=2"],
            r"config.mesh.devices=2: only 1 devices here")]
  for args, culprit in cases:
    out = subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train.py"), *args],
                         capture_output=True, text=True, timeout=300,
                         env=launcher_env())
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert out.returncode == 2 and len(errors) == 1 and culprit in errors[0], out.stderr
    assert "Traceback" not in out.stderr
  assert a_file.read_text() == "not a workdir" and not (tmp_path / "run").exists()


def _train(args, **kwargs):
  return subprocess.run([sys.executable, os.path.join(ROOT, "launch", "train.py"), *args],
                        capture_output=True, text=True, timeout=300,
                        env=launcher_env(), **kwargs)


def test_help_lists_every_config_field_with_its_meaning_and_exits_0():
  """--help and --helpfull print the flags (--print_config among them), then every field of
  the schema with its default, under its section's one-line meaning, with the field's own
  meaning where the defaults' comments give one; both exit 0 (absl's exit 1 and list no
  config field)."""
  fields = leaves(base_config())
  for flag in ("--help", "--helpfull"):
    out = _train([flag])
    assert out.returncode == 0, out.stderr
    assert "--print_config" in out.stdout and "--allow_config_change" in out.stdout
    lines = out.stdout.splitlines()
    for name, value in fields.items():
      assert any(line.strip().startswith(f"{name}={value!r}") for line in lines), name
    assert "    rollout.top_k=0  sample among the k likeliest tokens (0: off)" in lines
    assert "rl: The update rule (rl/core: advantages, losses, train_step; rl/core/algorithms.py " \
           "checks it)." in lines
    assert "    model.max_seq_len=256  context length in tokens (prompt and response)" in lines


def test_print_config_prints_the_resolved_config_and_exits(tmp_path):
  """--print_config prints the run's default workdir and every field of the resolved config
  (the variant's values and the overrides) as name=value lines, builds nothing and exits 0."""
  out = _train([f"--config={os.path.join(ROOT, 'configs', 'demo.py')}:grpo_v32",
                "--config.optim.lr=0.001", "--print_config"], cwd=tmp_path)
  assert out.returncode == 0, out.stderr
  want = leaves(load("demo.py", "grpo_v32"))
  want["optim.lr"] = 0.001
  lines = out.stdout.splitlines()
  assert lines[0] == f"# workdir: {os.path.join('workdir', 'demo_grpo_v32')}"
  assert lines[1:] == [f"{name}={value!r}" for name, value in want.items()]
  assert "rl.kl_coef=0.01" in lines and "optim.lr=0.001" in lines
  assert not (tmp_path / "workdir").exists()


def test_a_gs_workdir_without_credentials_stops_at_start_on_one_line(tmp_path):
  """A gs:// --workdir where Google's client libraries find no credentials (google.auth stubbed
  to find none, as on a laptop that never ran `gcloud auth`; gcsfs and google-cloud-storage
  stubbed as installed) stops at start, exit status 2, on one `error:` line naming the workdir
  and how to get credentials: no traceback, and the storage is never asked (the stub gcsfs
  holds no filesystem, so any use of it would raise)."""
  site = tmp_path / "site"
  for package in ("google/auth", "google/cloud/storage", "gcsfs"):
    (site / package).mkdir(parents=True)
    (site / package / "__init__.py").write_text("")
  (site / "google" / "auth" / "__init__.py").write_text(
      "class DefaultCredentialsError(Exception):\n  pass\n\n\n"
      "def default(*args, **kwargs):\n"
      "  raise DefaultCredentialsError('Your default credentials were not found.')\n")
  path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)
  out = subprocess.run(
      [sys.executable, os.path.join(ROOT, "launch", "train.py"),
       f"--config={os.path.join(ROOT, 'configs', 'demo.py')}", "--workdir=gs://bucket/run"],
      capture_output=True, text=True, timeout=300, cwd=tmp_path,
      env=launcher_env(PYTHONPATH=path))
  errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
  assert out.returncode == 2 and len(errors) == 1, out.stderr[-3000:]
  assert errors[0].startswith("error: --workdir=gs://bucket/run: no usable Google Cloud "
                              "credentials"), errors
  assert "gcloud auth application-default login" in errors[0]
  assert "Traceback" not in out.stderr


# ------------------------------------------------------------------------------- XManager

def test_xm_build_args_passes_config_flags_through():
  """Every --config flag reaches train.py unchanged and in order (both `=` and space forms,
  bools, negative numbers); the config path becomes repository-relative; the launcher's own
  flags are dropped; --workdir is appended."""
  argv = ["xm_launch.py", f"--config={ROOT}/configs/demo.py:vapo", "--accelerator=tpu_v5p=4x4x2",
          "--config.train.steps", "20", "--config.rl.clip_high=0.3", "--name=run",
          "--noconfig.rl.dynamic_sampling", "--config.optim.lr", "-1e-3",
          "--config.data.train_files=/d/a.jsonl,/d/b.jsonl"]
  assert xm_launch.build_args(argv, workdir="gs://b/run", repo_root=ROOT) == [
      "--config=configs/demo.py:vapo", "--config.train.steps", "20",
      "--config.rl.clip_high=0.3", "--noconfig.rl.dynamic_sampling", "--config.optim.lr",
      "-1e-3", "--config.data.train_files=/d/a.jsonl,/d/b.jsonl", "--workdir=gs://b/run"]
  assert xm_launch.build_args(["x", "--config", "configs/demo.py"], workdir="w",
                              repo_root=ROOT)[0] == "--config=configs/demo.py"


@pytest.mark.parametrize("argv,message", [
    (["x", "--config.train.steps=3"], "--config=configs/<name>.py is required"),
    (["x", "--config=/elsewhere/cfg.py"], "outside the repository"),
    (["x", "--config=configs/demo.txt"], "expected a configs/<name>.py"),
])
def test_xm_build_args_rejects(argv, message):
  """A command without a config, or with one the job would not have, fails before submitting."""
  with pytest.raises(ValueError, match=message):
    xm_launch.build_args(argv, workdir="w", repo_root=ROOT)


def test_xm_launch_without_xmanager_says_how_to_get_it(monkeypatch):
  """xmanager is not a dependency: without it, main() stops with an install hint."""
  from absl import app
  monkeypatch.setitem(sys.modules, "xmanager", None)
  with pytest.raises(app.UsageError, match="pip install xmanager"):
    xm_launch.main([])


def test_xm_docker_instructions_pick_the_accelerators_jax():
  """TPU jobs install jax[tpu], GPU jobs jax[cuda12], both at the pinned jax version."""
  tpu = "\n".join(xm_launch.docker_instructions("tpu_v5p", "main"))
  gpu = "\n".join(xm_launch.docker_instructions("a100", "main"))
  assert f'"jax[tpu]=={xm_launch.JAX_VERSION}"' in tpu and "cuda12" in gpu
  assert "requirements.txt" in tpu and "WORKDIR /seedrl" in tpu


# ------------------------------------------------------------------------------- GKE JobSet

TPU_VALUES = ["NAME=v32-small", "IMAGE=gcr.io/p/seedrl:1", "WORKDIR=gs://b/v32",
              "TPU_ACCELERATOR=tpu-v5p-slice", "TPU_TOPOLOGY=4x4x2", "HOSTS=8",
              "CHIPS_PER_HOST=4", "MAX_RESTARTS=3", "DATA_PVC=models-and-data"]
GPU_VALUES = ["NAME=dapo-7b", "IMAGE=gcr.io/p/seedrl:1", "WORKDIR=gs://b/dapo",
              "GPU_TYPE=nvidia-h100-80gb", "NODES=4", "GPUS_PER_NODE=8", "MAX_RESTARTS=0",
              "DATA_PVC=models-and-data"]
COMMAND = ["--", "--config=configs/deepseek_v32_moe_tpu.py:small", "--config.train.steps=7",
           "--config.data.train_files=gs://b/prompts/*.parquet"]


def _check_jobset(doc: dict, pods: int) -> dict:
  """Structural schema of a JobSet that runs launch/train.py as `pods` jax processes; returns
  the container."""
  assert doc["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and doc["kind"] == "JobSet"
  assert isinstance(doc["metadata"]["name"], str) and doc["metadata"]["name"]
  (rjob,) = doc["spec"]["replicatedJobs"]
  assert rjob["name"] and rjob["replicas"] == 1
  job = rjob["template"]["spec"]
  assert job["parallelism"] == job["completions"] == pods
  assert job["completionMode"] == "Indexed"
  pod = job["template"]["spec"]
  assert pod["restartPolicy"] == "Never"
  (container,) = pod["containers"]
  assert container["command"] == ["python", "launch/train.py"]
  assert all(isinstance(a, str) for a in container["args"])
  env = {e["name"]: e for e in container["env"]}
  assert env["JAX_NUM_PROCESSES"]["value"] == env["PROCESSES_IN_JOB"]["value"] == str(pods)
  for name, key in (("JOBSET_NAME", "jobset-name"), ("REPLICATED_JOB_NAME", "replicatedjob-name"),
                    ("JOB_INDEX", "job-index")):
    path = env[name]["valueFrom"]["fieldRef"]["fieldPath"]
    assert path == f"metadata.annotations['jobset.sigs.k8s.io/{key}']"
  # What rl/parallel/distributed.py derives for the last pod of this JobSet (Kubernetes adds the index).
  values = {k: v["value"] for k, v in env.items() if "value" in v}
  pod_env = dict(values, JOBSET_NAME=doc["metadata"]["name"], REPLICATED_JOB_NAME=rjob["name"],
                 JOB_INDEX="0", JOB_COMPLETION_INDEX=str(pods - 1))
  info = distributed.process_info_from_env(pod_env)
  assert (info.num_processes, info.process_id, info.source) == (pods, pods - 1, "gke_jobset")
  name = doc["metadata"]["name"]
  assert info.coordinator == f"{name}-{rjob['name']}-0-0.{name}:8476"
  assert {p["containerPort"] for p in container["ports"]} >= {8476}
  return container, pod


def _render(template: str, values: list[str]) -> dict:
  return yaml.safe_load(render.main(["render.py", os.path.join(GKE, template), *values,
                                     *COMMAND]))


def test_tpu_jobset_renders_and_is_well_formed():
  """The TPU template renders to a JobSet of one pod per host, scheduled on the slice's node
  pool by the GKE TPU selectors, each pod taking its host's chips and running train.py with the
  pass-through config flags."""
  doc = _render("jobset_tpu.yaml", TPU_VALUES)
  container, pod = _check_jobset(doc, pods=8)
  assert pod["nodeSelector"] == {"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice",
                                 "cloud.google.com/gke-tpu-topology": "4x4x2"}
  assert container["resources"]["limits"]["google.com/tpu"] == 4
  assert container["args"] == ["--config=configs/deepseek_v32_moe_tpu.py:small",
                               "--config.train.steps=7",
                               "--config.data.train_files=gs://b/prompts/*.parquet",
                               "--workdir=gs://b/v32"]
  assert doc["spec"]["failurePolicy"]["maxRestarts"] == 3


def test_gpu_jobset_renders_and_is_well_formed():
  """The GPU template renders to a JobSet of one pod per node holding all its GPUs
  (nvidia.com/gpu), on the requested accelerator, with shared memory for NCCL."""
  doc = _render("jobset_gpu.yaml", GPU_VALUES)
  container, pod = _check_jobset(doc, pods=4)
  assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
  assert pod["nodeSelector"]["cloud.google.com/gke-accelerator"] == "nvidia-h100-80gb"
  assert any(m["mountPath"] == "/dev/shm" for m in container["volumeMounts"])


def test_render_names_missing_and_unused_variables():
  """A template variable without a value, or a value no template variable uses, is an error naming
  it; plain rendering substitutes nothing else."""
  with pytest.raises(ValueError, match="no value for HOSTS"):
    render.main(["render.py", os.path.join(GKE, "jobset_tpu.yaml"),
                 *[v for v in TPU_VALUES if not v.startswith("HOSTS=")], *COMMAND])
  with pytest.raises(ValueError, match="TYPO is not used"):
    render.render("a: ${A}\nb: $B {C}", {"A": "1", "TYPO": "2"})
  assert render.render("a: ${A}\nb: $B {C}", {"A": "1"}) == "a: 1\nb: $B {C}"


def test_every_launch_script_imports_beside_every_other():
  """Tests import helpers of several launch scripts into one process, and scripts share flag
  names (--config, --mesh, --seed) with their own meanings: every script imports after every
  other in one interpreter (cli.define), whichever order pytest's workers happen to take. The
  old failure: export_hf's --dtype beside bench_rollout's raised DuplicateFlagError."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  names = sorted(f[:-3] for f in os.listdir(os.path.join(root, "launch"))
                 if f.endswith(".py") and f != "__init__.py")
  code = ("import importlib, sys\nsys.path.insert(0, %r)\n" % root
          + "".join(f"importlib.import_module('launch.{n}')\n" for n in names + names[::-1]))
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                     env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
