"""The GKE renderer's checks (launch/gke/render.py): a manifest is printed only for a job that
can run: a valid config, pods that match the TPU topology or GPU count and the config's mesh,
a grace period long enough for SIGTERM's checkpoint, and every local path it reads mounted.
The rendered Job template is checked against the published Kubernetes batch/v1 schema."""

import os

import pytest
import yaml

from launch.gke import render

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
TPU = os.path.join(ROOT, "launch", "gke", "jobset_tpu.yaml")
GPU = os.path.join(ROOT, "launch", "gke", "jobset_gpu.yaml")
# The demo's model (byte tokenizer, no checkpoint to read) on a mesh that takes every device.
DEMO = ["--config=configs/demo.py", "--config.data.source=files", "--config.sft.carry_slip_rate=0"]


def tpu_values(accelerator="tpu-v5p-slice", topology="4x4x2", hosts=8, chips=4, *extra):
  return ["NAME=run", "IMAGE=img", "WORKDIR=gs://b/run", f"TPU_ACCELERATOR={accelerator}",
          f"TPU_TOPOLOGY={topology}", f"HOSTS={hosts}", f"CHIPS_PER_HOST={chips}",
          "MAX_RESTARTS=0", *extra]


def gpu_values(nodes=2, gpus=8, *extra):
  return ["NAME=run", "IMAGE=img", "WORKDIR=gs://b/run", "GPU_TYPE=nvidia-h100-80gb",
          f"NODES={nodes}", f"GPUS_PER_NODE={gpus}", "MAX_RESTARTS=0", *extra]


def rendered(template, values, command):
  return yaml.safe_load(render.main(["render.py", template, *values, "--", *command]))


def pod_of(doc):
  (job,) = doc["spec"]["replicatedJobs"]
  return job["template"]["spec"]["template"]["spec"]


GS_PROMPTS = "--config.data.train_files=gs://b/p/*.jsonl"


@pytest.mark.parametrize("command,message", [
    ([*DEMO, GS_PROMPTS, "--config.rl.clip_high=-1"], "clip_high"),
    ([*DEMO, GS_PROMPTS, "--config.train.stepz=3"], "stepz"),
    ([*DEMO], "config.data.train_files is empty"),
    (["--config=configs/nope.py"], "nope.py"),
])
def test_a_bad_config_is_refused_on_one_line(command, message):
  """The config is built and validated as launch/train.py does: a bad value, an unknown field,
  a run without prompt files or a missing config file is a one-line error naming it."""
  with pytest.raises(ValueError, match=message) as e:
    render.main(["render.py", GPU, *gpu_values(), "--", *command])
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("accelerator,topology,hosts,chips", [
    ("tpu-v5p-slice", "4x4x2", 8, 4), ("tpu-v5p-slice", "2x2x1", 1, 4),
    ("tpu-v4-podslice", "2x2x4", 4, 4), ("tpu-v5-lite-podslice", "2x4", 1, 8),
    ("tpu-v5-lite-podslice", "4x4", 4, 4), ("tpu-v6e-slice", "8x16", 32, 4),
])
def test_tpu_hosts_follow_the_topology(accelerator, topology, hosts, chips):
  """Hosts and chips per host of a GKE TPU slice: 4 chips per VM, v5e/v6e slices of up to 8
  chips on one VM."""
  assert render.tpu_hosts(accelerator, topology) == (hosts, chips)


@pytest.mark.parametrize("values,message", [
    (tpu_values(hosts=4), r"HOSTS=4 CHIPS_PER_HOST=4 do not match TPU_TOPOLOGY=4x4x2 .* "
                          r"32 chips, 4 per host, so HOSTS=8"),
    (tpu_values("tpu-v5-lite-podslice", "2x4", 2, 4), "so HOSTS=1 CHIPS_PER_HOST=8"),
    (tpu_values("tpu-v9-slice"), "TPU_ACCELERATOR=tpu-v9-slice: not one of"),
    (tpu_values(topology="4x4x"), "TPU_TOPOLOGY=4x4x: expected"),
])
def test_pods_that_do_not_match_the_slice_are_refused(values, message):
  with pytest.raises(ValueError, match=message):
    render.main(["render.py", TPU, *values, "--", *DEMO, GS_PROMPTS])


def test_a_mesh_that_does_not_fit_the_job_is_refused():
  """A fixed config.mesh must span the job's devices; a -1 axis must divide them."""
  fixed = ["--config.mesh.shape.data=1", "--config.mesh.shape.fsdp=32"]
  rendered(GPU, gpu_values(4, 8), [*DEMO, GS_PROMPTS, *fixed])  # 32 GPUs: fits
  with pytest.raises(ValueError, match=r"spans 32 devices; the job has 16"):
    render.main(["render.py", GPU, *gpu_values(2, 8), "--", *DEMO, GS_PROMPTS, *fixed])
  with pytest.raises(ValueError, match=r"16 devices do not split into the fixed axes \(3\)"):
    render.main(["render.py", GPU, *gpu_values(2, 8), "--", *DEMO, GS_PROMPTS,
                 "--config.mesh.shape.fsdp=3"])


def test_grace_period_covers_the_first_compile_and_a_save():
  """terminationGracePeriodSeconds is the first compile's budget plus the save of the state
  (12 bytes per parameter, split over the hosts) at the assumed bandwidth plus the margin;
  GRACE_SECONDS overrides it."""
  command = ["--config=configs/deepseek_v32_moe_tpu.py", GS_PROMPTS, "--config.tokenizer=byte",
             "--config.init_hf_dir=", "--config.data.heldout_files="]
  doc = rendered(TPU, tpu_values("tpu-v5p-slice", "8x8x8", 128, 4), command)  # the recipe's 512
  grace = pod_of(doc)["terminationGracePeriodSeconds"]
  save_s = 671.9e9 * 12 / 128 / 100e6  # DeepSeek-V3.2's 671.9B parameters
  assert grace == pytest.approx(render.FIRST_COMPILE_S + save_s + render.GRACE_MARGIN_S, abs=2)
  assert grace > render.FIRST_COMPILE_S + 600  # the save is no rounding error
  doc = rendered(TPU, tpu_values("tpu-v5p-slice", "8x8x8", 128, 4, "GRACE_SECONDS=99"), command)
  assert pod_of(doc)["terminationGracePeriodSeconds"] == 99


def test_local_paths_need_a_volume_or_are_refused():
  """A prompt file on this machine is refused without DATA_PVC; with it, the claim is mounted
  read-only at the path's top folder, so the config's path is the same in the pod. A relative
  path must be in the repository (the image); gs:// needs no mount."""
  local = [*DEMO, "--config.data.train_files=/data/prompts/a.jsonl,/data/prompts/b.jsonl"]
  with pytest.raises(ValueError, match=r"^config.data.train_files='/data/prompts/a.jsonl': a "
                                       r"path on this machine.*DATA_PVC"):
    render.main(["render.py", GPU, *gpu_values(), "--", *local])
  pod = pod_of(rendered(GPU, gpu_values(2, 8, "DATA_PVC=prompts"), local))
  assert {"name": "data", "persistentVolumeClaim": {"claimName": "prompts", "readOnly": True}} in (
      pod["volumes"])
  (container,) = pod["containers"]
  assert {"name": "data", "mountPath": "/data", "subPath": "data", "readOnly": True} in (
      container["volumeMounts"])
  with pytest.raises(ValueError, match=r"config.data.train_files='nowhere/a.jsonl': not in the "
                                       r"repository"):
    render.main(["render.py", GPU, *gpu_values(), "--", *DEMO,
                 "--config.data.train_files=nowhere/a.jsonl"])
  for prompts in ("--config.data.train_files=README.md", GS_PROMPTS):
    pod = pod_of(rendered(GPU, gpu_values(), [*DEMO, prompts]))
    assert "volumes" not in pod or all(v["name"] != "data" for v in pod["volumes"])


@pytest.mark.parametrize("template,values", [(TPU, tpu_values()), (GPU, gpu_values())])
def test_job_template_matches_the_published_kubernetes_schema(template, values):
  """The Job a JobSet replicates (its replicatedJobs[].template, a batch/v1 JobTemplateSpec)
  validates against Kubernetes' published batch/v1 Job schema in its strict form (an unknown
  or misspelt field is an error), and the check catches such a field."""
  kubernetes_validate = pytest.importorskip("kubernetes_validate")
  doc = rendered(template, values, [*DEMO, GS_PROMPTS, "--config.data.heldout_files="])
  (rjob,) = doc["spec"]["replicatedJobs"]
  job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": doc["metadata"]["name"]},
         "spec": rjob["template"]["spec"]}
  kubernetes_validate.validate(job, kubernetes_validate.latest_version(), strict=True)
  job["spec"]["template"]["spec"]["terminationGracePeriodSecond"] = 60
  with pytest.raises(kubernetes_validate.ValidationError):
    kubernetes_validate.validate(job, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("template,values,platform", [(TPU, tpu_values(), "tpu"),
                                                      (GPU, gpu_values(), "cuda")])
def test_pods_name_their_accelerator(template, values, platform):
  """The pods set JAX_PLATFORMS to their accelerator first: launch/platforms.py then leaves jax's
  start-up alone, and an accelerator that fails to start stops the job instead of training on
  the host's CPU."""
  (container,) = pod_of(rendered(template, values, [*DEMO, GS_PROMPTS]))["containers"]
  env = {e["name"]: e.get("value") for e in container["env"]}
  assert env["JAX_PLATFORMS"].split(",")[0] == platform
