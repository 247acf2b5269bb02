"""launch/export_hf.py: from an HF checkpoint, through a run, back to an HF checkpoint. The
exported directory loads in transformers (CPU torch, fp32) with seedrl's logits and greedy
outputs, for the trained step asked for; every family exports from a sharded orbax
checkpoint; tokenizer files follow an HF tokenizer; bad input fails in one line."""

import dataclasses
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import tiny_hf  # noqa: E402
from launch import export_hf  # noqa: E402
from models import hf  # noqa: E402
from models import sharding  # noqa: E402
from models.padding import round_up  # noqa: E402
from rl.config.defaults import base_config  # noqa: E402
from rl.config.validation import validate  # noqa: E402
from rl.jobs import evaluation  # noqa: E402
from rl.jobs.checkpoint import Checkpointer, save_run_config  # noqa: E402
from rl.rollout import engine as rollout_lib  # noqa: E402
from rl.rollout import trajectories  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
PROMPTS = [[5, 17, 33, 2, 41, 9, 60], [12, 3, 88, 40]]


def run_config(hf_dir: str, tokenizer: str = "byte", **overrides) -> ml_collections.ConfigDict:
  """A run that starts from `hf_dir` (config.model from its config.json, fp32): 2 prompts x 2
  samples of single-digit sums, 8 new tokens, checkpoints every step."""
  model = dataclasses.asdict(hf.config_from_hf(hf.read_hf_config(hf_dir), dtype="float32"))
  del model["kernel_backend"]
  c = base_config(preset="tiny_dense", algorithm="grpo")
  c.model = ml_collections.ConfigDict(model)
  c.init_hf_dir, c.tokenizer = hf_dir, tokenizer
  c.data.update(task="addition", difficulty=0, train_size=16, heldout_size=8)
  c.rollout.max_new_tokens = 8
  c.rl.dynamic_sampling = False
  # The trained steps must move the weights visibly, even when every sample of a group gets
  # the same reward (zero advantages): no warm-up, and an entropy bonus.
  c.optim.update(lr=1e-2, warmup_steps=0)
  c.rl.entropy_coef = 0.1
  c.train.update(steps=2, prompts_per_step=2, samples_per_prompt=2, eval_every=0,
                 checkpoint_every=1)
  for key, value in overrides.items():
    section, _, field = key.rpartition(".")
    (c[section] if section else c)[field] = value
  validate(c)
  return c


def transformers_model(path: str):
  return transformers.AutoModelForCausalLM.from_pretrained(
      path, dtype=torch.float32, attn_implementation="eager").eval()


def seedrl_logits(model, tokens: np.ndarray) -> np.ndarray:
  graphdef, state = nnx.split(model)
  return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s).forward(t).logits)(
      state, jnp.asarray(tokens)))


def assert_same_model(exported: str, model) -> None:
  """transformers on `exported` gives seedrl's logits (<= 1e-4) on a batch of 20 tokens, and
  its greedy `generate` gives the tokens of seedrl's rollout engine (greedy, 8 new tokens)."""
  tokens = np.random.default_rng(0).integers(1, model.cfg.vocab_size, (2, 20)).astype(np.int32)
  theirs = transformers_model(exported)
  with torch.no_grad():
    expected = theirs(input_ids=torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(seedrl_logits(model, tokens), expected, atol=1e-4, rtol=0)
  graphdef, state = nnx.split(model)
  cfg = rollout_lib.RolloutConfig(max_new_tokens=8, greedy=True, prompt_bucket=8)
  traj = trajectories.generate(graphdef, state, PROMPTS, jax.random.key(0), cfg)
  for row, prompt in enumerate(PROMPTS):
    ours = np.asarray(traj.tokens)[row][np.asarray(traj.response_mask)[row].astype(bool)]
    with torch.no_grad():
      generated = theirs.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8,
                                  do_sample=False)[0, len(prompt):].numpy()
    np.testing.assert_array_equal(ours, generated)


# ======================================================================== Trained run

@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
  """A byte-level BPE tokenizer trained on a few sums (tokenizer.json + tokenizer_config.json)."""
  root = tmp_path_factory.mktemp("tokenizer")
  tiny_hf.train_bpe_tokenizer(root, [f"{a}+{b}={a + b} Answer: {a + b}" for a in range(10)
                                     for b in range(10)], 300, ["<|endoftext|>"])
  return str(root)


def launch(script: str, *args: str, devices: int = 1) -> subprocess.CompletedProcess:
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
  return subprocess.run([sys.executable, os.path.join(ROOT, "launch", script), *args],
                        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)


@pytest.mark.parametrize("family", [
    f if f == "qwen3" else pytest.param(f, marks=pytest.mark.slow)
    for f in sorted(tiny_hf.FAMILIES)])
def test_hf_to_train_to_export_to_transformers(family, tokenizer_dir, tmp_path):
  """A tiny HF checkpoint of each family (qwen3 in the fast suite, the others marked slow) with
  an HF tokenizer -> launch/train.py (2 RL steps on an
  fsdp=2 mesh, so the checkpoint is sharded) -> launch/export_hf.py. transformers loads the
  export (and its tokenizer, copied beside it) with the logits and greedy outputs of the
  step-2 policy seedrl restores, whose weights moved away from the starting checkpoint's;
  --step=1 exports step 1, which differs from step 2."""
  import tokenizers
  vocab = round_up(tokenizers.Tokenizer.from_file(
      os.path.join(tokenizer_dir, "tokenizer.json")).get_vocab_size(), 8)
  start = tiny_hf.hf_checkpoint(family, str(tmp_path), vocab_size=vocab)
  config = run_config(start, tokenizer_dir, **{"mesh.devices": 2,
                                               "mesh.shape": {"data": 1, "fsdp": 2,
                                                              "expert": 1, "tensor": 1}})
  config_file = tmp_path / "run_config.py"
  config_file.write_text("import ml_collections\n\ndef get_config():\n  return "
                         f"ml_collections.ConfigDict({config.to_dict()!r})\n")
  workdir = str(tmp_path / "run")
  done = launch("train.py", f"--config={config_file}", f"--workdir={workdir}", devices=2)
  assert done.returncode == 0, done.stderr[-3000:]
  out = str(tmp_path / "export")
  done = launch("export_hf.py", f"--checkpoint={workdir}/checkpoints", f"--out={out}")
  assert done.returncode == 0, done.stderr[-3000:]
  assert "wrote step 2 of" in done.stderr
  for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
    assert os.path.isfile(os.path.join(out, name)), name
  assert transformers.AutoTokenizer.from_pretrained(out)("3+4=").input_ids

  trained, step = evaluation.load_policy_checkpoint(config, workdir)
  assert step == 2
  assert_same_model(out, trained)
  initial = transformers_model(start).state_dict()
  exported = transformers_model(out).state_dict()
  assert exported.keys() == initial.keys()
  assert any(not torch.allclose(exported[k], initial[k], atol=1e-4) for k in initial)

  step1 = str(tmp_path / "export_step1")
  assert export_hf.export(workdir, step1, step=1) == 1
  first, _ = evaluation.load_policy_checkpoint(config, workdir, step=1)
  tokens = np.array([PROMPTS[0]], np.int32)
  with torch.no_grad():
    got = transformers_model(step1)(input_ids=torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(got, seedrl_logits(first, tokens), atol=1e-4, rtol=0)
  assert not np.allclose(got, seedrl_logits(trained, tokens), atol=1e-3)


# ======================================================================== Every family

def saved_run(hf_dir: str, workdir: str, step: int = 3) -> ml_collections.ConfigDict:
  """A run's workdir without training: config.json and an RL checkpoint at `step` holding the
  policy loaded from `hf_dir` (the {"policy": {"params"}, "rest"} of the trainer's state)."""
  config = run_config(hf_dir)
  save_run_config(workdir, config, step=None)
  graphdef, params, rest = nnx.split(hf.load_pretrained(hf_dir, dtype="float32"), nnx.Param,
                                     ...)
  del graphdef
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"))
  checkpointer.save(step, {"policy": {"params": params}, "rest": rest}, {"step": step},
                    force=True)
  checkpointer.close()
  return config


@pytest.mark.parametrize("family", sorted(tiny_hf.FAMILIES))
def test_every_family_exports_from_a_sharded_restore(family, tmp_path):
  """Each family: an orbax checkpoint of the policy -> export (restored onto an 8-device fsdp
  mesh, so every parameter is gathered from its shards while it is written) -> transformers
  gives seedrl's logits and greedy outputs. For the families with router biases
  (deepseek_v3/v32) the biases make the trip too."""
  start = tiny_hf.hf_checkpoint(family, str(tmp_path))
  workdir = str(tmp_path / "run")
  config = saved_run(start, workdir)
  out = str(tmp_path / "export")
  assert export_hf.export(workdir, out, mesh_shape={"fsdp": 8}) == 3
  restored, _ = evaluation.load_policy_checkpoint(config, workdir)
  sharded, _ = evaluation.load_policy_checkpoint(
      config, workdir, mesh=sharding.make_mesh({"fsdp": 8}))
  assert any(not v.get_value().sharding.is_fully_replicated
             for _, v in nnx.state(sharded).flat_state())
  assert_same_model(out, restored)
  assert not any(f.startswith("tokenizer") for f in os.listdir(out))  # the byte tokenizer


def test_bad_input_fails_in_one_line(tmp_path):
  """A directory that is no run, a step that is not saved and a bad --mesh each end the
  launcher with status 2 and one line naming the culprit."""
  workdir = str(tmp_path / "run")
  saved_run(tiny_hf.hf_checkpoint("qwen2", str(tmp_path)), workdir)
  cases = [((f"--checkpoint={tmp_path}", "--out=x"), "config.json does not exist"),
           ((f"--checkpoint={workdir}", "--out=x", "--step=7"), "no checkpoint at step 7"),
           ((f"--checkpoint={workdir}", "--out=x", "--mesh=fsdp=3"), "--mesh")]
  for args, message in cases:
    done = launch("export_hf.py", *args)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, last
