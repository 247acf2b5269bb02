"""Config files and start-up validation: every config builds and validates; typos in field
names and bad values fail early with the field named; the launcher exits with a clear message."""

import glob
import os
import subprocess
import sys

import pytest
from ml_collections import config_flags  # noqa: F401  (the launcher's flag type)

from rl.core.checks import InputError
from rl.config.defaults import base_config
from rl.config.describe import describe_rl, leaves
from rl.core.policy import build_policy, model_config
from rl.config.validation import check_paths, validate
from tests.launch.test_launch import launcher_env

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CONFIG_FILES = sorted(glob.glob(os.path.join(ROOT, "configs", "*.py")))


def load(path, arg=None):
  import importlib.util
  spec = importlib.util.spec_from_file_location("cfg", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config(arg) if arg is not None else module.get_config()


@pytest.mark.parametrize("path", [p for p in CONFIG_FILES
                                  if os.path.basename(p) not in ("__init__.py", "qwen.py")])
def test_every_config_validates(path):
  """Each config file's get_config() returns a locked config that passes validation."""
  config = load(path)
  validate(config)
  with pytest.raises(AttributeError):
    config.rl.clip_hihg = 0.3  # locked: unknown keys are errors


@pytest.mark.parametrize("variant", ["dapo", "vapo", "grpo_v32"])
def test_demo_variants(variant):
  """The demo's algorithm variants select their recipes."""
  config = load(os.path.join(ROOT, "configs", "demo.py"), variant)
  validate(config)
  assert describe_rl(config).startswith(variant)


def test_demo_vapo_credits_the_whole_response():
  """On the demo's responses (10-20 tokens), VAPO's length-adaptive lambda_policy is 0.9 or
  more (0.89: float32 rounding): with the paper's alpha = 0.05 it was clamped to 0 below 20 tokens, leaving every token
  but the last to the critic's one-step TD error, and the run collapsed (docs/demo.md, "VAPO")."""
  from rl.core.advantages import length_adaptive_lambda
  config = load(os.path.join(ROOT, "configs", "demo.py"), "vapo")
  lam = length_adaptive_lambda([10, 15, 20], alpha=config.rl.length_adaptive_alpha)
  assert float(lam.min()) >= 0.89, lam


@pytest.mark.parametrize("field,value,message", [
    ("rl.loss_agg_mode", "mean", r"config.rl.loss_agg_mode='mean': must be one of"),
    ("data.task", "chess", r"config.data.task='chess'"),
    ("model.kv_lora_rank", 0, r"config.model.kv_lora_rank=0"),
    ("model.index_topk", 0, r"config.model.index_topk=0"),
    ("rollout.top_p", 1.5, r"config.rollout.top_p=1.5"),
    ("train.micro_batches", 7, r"config.train.mini_batches=1 x micro_batches=7"),
    ("job", "pretrain", r"config.job='pretrain'"),
    ("seed", -1, r"config.seed=-1: must be >= 0"),
    ("data.train_seed", -2, r"config.data.train_seed=-2: must be >= 0, or -1"),
    ("mesh.shape.fsdp", 0, r"config.mesh.shape.fsdp=0: must be positive or -1"),
    ("mesh.dcn.data", -1, r"config.mesh.dcn.data=-1: must be >= 1"),
    ("kernel_backend", "cuda", r"config.kernel_backend='cuda': must be one of"),
    ("rollout.streaming.max_staleness", -1, r"config.rollout.streaming.max_staleness=-1"),
    ("model.kernel_backend", "tpu",
     r"config.model.kernel_backend: no such field .*did you mean config.kernel_backend\?"),
    ("init_checkpoint", "/ckpt", r"config.init_checkpoint='/ckpt' with config.job='sft_rl'"),
    ("o1.prm_mode", "listwise", r"config.o1.prm_mode='listwise': must be one of"),
])
def test_bad_values_name_the_field(field, value, message):
  """validate() rejects a bad value with a message naming the field and what is allowed."""
  config = load(os.path.join(ROOT, "configs", "demo.py"))
  section, _, key = field.rpartition(".")
  target = config[section] if section else config
  with target.unlocked() if hasattr(target, "unlocked") else config.unlocked():
    target[key] = value
  with pytest.raises(ValueError, match=message):
    validate(config)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("field,value,message", [
    ("optim.lr", NAN, r"config.optim.lr=nan: must be positive and finite"),
    ("optim.lr", INF, r"config.optim.lr=inf: must be positive and finite"),
    ("optim.lr", -1e-4, r"config.optim.lr=-0.0001: must be positive"),
    ("optim.critic_lr", NAN, r"config.optim.critic_lr=nan"),
    ("sft.lr", NAN, r"config.sft.lr=nan"),
    ("rollout.temperature", NAN, r"config.rollout.temperature=nan: must be >= 0 and finite"),
    ("rollout.eval_temperature", -1.0, r"config.rollout.eval_temperature=-1.0"),
    ("rollout.top_k", -1, r"config.rollout.top_k=-1: must be >= 0"),
    ("rl.kl_coef", -0.01, r"config.rl.kl_coef=-0.01: must be >= 0"),
    ("rl.kl_coef", NAN, r"config.rl.kl_coef=nan"),
    ("rl.kl_coef_per_domain", "math=-0.1",
     r"config.rl.kl_coef_per_domain='math=-0.1': 'math=-0.1' is not domain=beta"),
    ("rl.kl_coef_per_domain", "math=0.1,math=0.2", r"'math=0.2' is not domain=beta"),
    ("rl.kl_coef_per_domain", "math:0.1", r"'math:0.1' is not domain=beta"),
    ("optim.grad_clip", -1.0, r"config.optim.grad_clip=-1.0: must be positive"),
    ("optim.grad_clip", NAN, r"config.optim.grad_clip=nan"),
    ("optim.b1", 1.0, r"config.optim.b1=1.0: must be in \[0, 1\)"),
    ("optim.b2", -0.1, r"config.optim.b2=-0.1: must be in \[0, 1\)"),
    ("optim.b2", NAN, r"config.optim.b2=nan"),
    ("optim.warmup_steps", -5, r"config.optim.warmup_steps=-5: must be >= 0"),
    ("sft.warmup_steps", -1, r"config.sft.warmup_steps=-1: must be >= 0"),
    ("train.keep_checkpoints", 0, r"config.train.keep_checkpoints=0: must be positive"),
    ("train.keep_checkpoints", -1, r"config.train.keep_checkpoints=-1: must be positive"),
    ("train.checkpoint_every", 0, r"config.train.checkpoint_every=0: must be positive"),
    ("train.checkpoint_every", -2, r"config.train.checkpoint_every=-2: must be positive"),
    ("sft.checkpoint_every", 0, r"config.sft.checkpoint_every=0: must be positive"),
    ("rollout.max_new_tokens", 4096, r"config.rollout.max_new_tokens=4096: must be smaller "
                                     r"than config.model.max_seq_len=256"),
    ("sft.max_len", 1000, r"config.sft.max_len=1000: must be in \[0, "
                          r"config.model.max_seq_len=256\]"),
    ("o1.search_tasks", 0, r"config.o1.search_tasks=0: must be positive"),
    ("o1.tcg_dpo_lr", NAN, r"config.o1.tcg_dpo_lr=nan: must be positive"),
    ("o1.iterations", -1, r"config.o1.iterations=-1: must be >= 0"),
    ("o1.heldout_fraction", 1.0, r"config.o1.heldout_fraction=1.0: must be in \[0, 1\)"),
    ("o1.prm_heldout_fraction", NAN, r"config.o1.prm_heldout_fraction=nan: must be in \[0, 1\)"),
    ("o1.compile_weight", 1.5, r"config.o1.compile_weight=1.5: must be in \[0, 1\]"),
    ("o1.alpha_end", -0.1, r"config.o1.alpha_end=-0.1: must be in \[0, 1\]"),
    ("o1.process_gamma", 0.0, r"config.o1.process_gamma=0.0: must be in \(0, 1\]"),
])
def test_bad_numbers_name_the_field(field, value, message):
  """Values that would train on NaN, diverge, never save or delete every checkpoint, or
  overflow the model's context are refused at start, naming the field (they passed
  validation before: NaN compares False with every bound)."""
  config = load(os.path.join(ROOT, "configs", "demo.py"))
  section, _, key = field.rpartition(".")
  with config.unlocked():
    config[section][key] = value
  with pytest.raises(InputError, match=message):
    validate(config)


def test_missing_tokenizer_and_hf_dir_are_named(tmp_path):
  """check_paths (run before a job builds anything) names config.tokenizer or
  config.init_hf_dir when the directory is not there."""
  config = load(os.path.join(ROOT, "configs", "demo.py"))
  check_paths(config)
  config.tokenizer = str(tmp_path / "no_tokenizer")
  with pytest.raises(InputError, match=r"config.tokenizer='.*no_tokenizer': no such"):
    check_paths(config)
  config.tokenizer = "byte"
  config.init_hf_dir = str(tmp_path)
  with pytest.raises(InputError, match=r"config.init_hf_dir='.*': no config.json"):
    check_paths(config)


def test_bare_defaults_are_a_valid_run():
  """base_config() on its own passes validation and the start-of-run path checks: every
  default is a usable value (the recipes only change what they need)."""
  config = base_config()
  validate(config)
  check_paths(config)


@pytest.mark.parametrize("name", ["qwen2_5_math_dapo.py", "vapo_qwen.py",
                                  "deepseek_v32_moe_tpu.py", "qwen3_moe_dapo.py"])
def test_recipes_leave_the_prompt_files_to_the_user(name):
  """The recipes that train on prompt files name none of this machine's (they validate, so a
  dry run plans them anywhere); a run without config.data.train_files stops at start naming
  the field."""
  config = load(os.path.join(ROOT, "configs", name))
  assert config.data.source == "files" and config.data.train_files == ""
  validate(config)
  config.tokenizer, config.init_hf_dir = "byte", ""  # the paths checked before the data's
  with pytest.raises(InputError, match=r"^config.data.train_files is empty: "):
    check_paths(config)


def test_missing_prompt_files_are_named(tmp_path):
  """check_paths names the data field whose path, or glob, finds no file; found ones pass."""
  train, heldout = tmp_path / "train.jsonl", tmp_path / "heldout.jsonl"
  for path in (train, heldout):
    path.write_text('{"prompt": "1 + 1?", "answer": "2"}\n')
  config = load(os.path.join(ROOT, "configs", "demo.py"))
  config.data.update(source="files", train_files=f"{train},{tmp_path}/none.jsonl",
                     heldout_files=str(heldout))
  with pytest.raises(InputError, match=r"config.data.train_files='.*': prompt file not found: "
                                       r".*none.jsonl"):
    check_paths(config)
  config.data.train_files = str(tmp_path / "*.jsonl")
  check_paths(config)
  config.data.heldout_files = str(tmp_path / "*.parquet")
  with pytest.raises(InputError, match=r"config.data.heldout_files='.*': no file matches"):
    check_paths(config)


TYPO_FILE = """from rl.config.defaults import base_config


def get_config():
  c = base_config()
  {line}
  return c.lock()
"""


@pytest.mark.parametrize("line,message", [
    ("c.train.stepz = 3",
     r"^config.train.stepz: no such field .*did you mean config.train.steps\?$"),
    ("c.rollout.streaming.enabeld = True",
     r"^config.rollout.streaming.enabeld: .*did you mean config.rollout.streaming.enabled\?"),
    ("c.trian = dict(steps=3)", r"^config.trian.steps: .*did you mean config.train.steps\?"),
    ("c.mesh.shape = dict(data=-1, fsdp=1, expert=1, tensr=1)",
     r"^config.mesh.shape.tensr: .*did you mean config.mesh.shape.tensor\?"),
    ("c.mesh.shape = dict(data=-1, fsdp=1)", r"^config.mesh.shape.expert: missing"),
    ("c.job = 'o1_coder'; c.o1.simulatons = 3",
     r"^config.o1.simulatons: no such field .*did you mean config.o1.simulations\?$"),
])
def test_config_file_typos_are_errors(tmp_path, line, message):
  """A config FILE is held to the schema (base_config's fields) like a --config override: a
  field it adds before locking its config (a typo), or a section it replaces with a dict of
  other keys, fails validation naming the field and the closest real one."""
  path = tmp_path / "typo.py"
  path.write_text(TYPO_FILE.format(line=line))
  with pytest.raises(InputError, match=message):
    validate(load(str(path)))


def test_empty_prompt_files_are_named(tmp_path):
  """check_paths names the data field and the file when a prompt file holds no record: an
  empty jsonl, one of blank lines only, a parquet file of no rows (each would otherwise fail
  after the model is built, with a traceback)."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  good = tmp_path / "good.jsonl"
  good.write_text('{"prompt": "1 + 1?", "answer": "2"}\n')
  (tmp_path / "empty.jsonl").write_text("")
  (tmp_path / "blank.jsonl").write_text("\n  \n")
  pq.write_table(pa.table({"prompt": pa.array([], pa.string()),
                           "answer": pa.array([], pa.string())}), tmp_path / "none.parquet")
  config = load(os.path.join(ROOT, "configs", "demo.py"))
  config.data.update(source="files", train_files=str(good), heldout_files=str(good))
  check_paths(config)
  for name in ("empty.jsonl", "blank.jsonl", "none.parquet"):
    config.data.train_files = f"{good},{tmp_path / name}"
    with pytest.raises(InputError, match=rf"^config.data.train_files='.*': .*{name} holds no "
                                         r"prompt records$"):
      check_paths(config)
  config.data.train_files = str(good)
  config.data.heldout_files = str(tmp_path / "*.parquet")
  with pytest.raises(InputError, match=r"^config.data.heldout_files=.*none.parquet holds no"):
    check_paths(config)


@pytest.mark.parametrize("mesh,message", [
    ({"devices": 16}, r"^config.mesh.devices=16: only 8 devices here$"),
    ({"shape.data": 1, "shape.fsdp": 16},
     r"^config.mesh.shape / config.mesh.dcn do not fit the 8 devices of this run: "
     r"mesh \{.*'fsdp': 16.*\} needs 16 devices, have 8$"),
    ({"shape.fsdp": 3}, r"^config.mesh.shape .*: mesh \{.*'fsdp': 3.*: 8 devices are not "
                        r"divisible by 3$"),
    ({"devices": 4, "dcn.data": 3}, r"^config.mesh.shape / config.mesh.dcn do not fit the 4 "
                                    r"devices .*mesh.dcn \{'data': 3.*: 4 devices do not split "
                                    r"into 3 slices$"),
])
def test_mesh_larger_than_the_machine_is_named(mesh, message):
  """placement.check_devices (launch/train.py calls it at start) names the mesh field a run's
  devices cannot satisfy on this host of 8 devices; the fitting and planned meshes pass."""
  from rl.parallel import placement
  config = base_config()
  placement.check_devices(config.mesh)
  config.mesh.update(auto=True, devices=8)
  placement.check_devices(config.mesh)
  config = base_config()
  for field, value in mesh.items():
    table, _, key = field.rpartition(".")
    (config.mesh[table] if table else config.mesh)[key] = value
  with pytest.raises(InputError, match=message):
    placement.check_devices(config.mesh)


def test_field_notes_come_from_the_comments_beside_the_defaults():
  """field_notes (what --help lists) reads one sentence per field from the comments of
  rl/config/defaults.py, models/config.py and rl/core/algorithms.py: every note names a field
  or section of the schema, every section has one, a field's trailing comment is its note, a
  block above a field is its note, and no field takes a heading's or its parent's comment."""
  from rl.config.describe import field_notes
  notes = field_notes()
  fields = leaves(base_config())
  sections = {name.rsplit(".", 1)[0] for name in fields if "." in name}
  assert set(notes) <= set(fields) | sections
  assert {s for s in sections if "." not in s} <= set(notes)
  assert all("\n" not in note for note in notes.values())
  assert notes["rollout.top_k"] == "sample among the k likeliest tokens (0: off)"
  assert notes["model.n_kv_heads"] == "0 means n_heads (plain multi-head attention)"
  assert notes["rl.kl_coef"] == "beta; 0 skips the reference model entirely"
  assert notes["init_checkpoint"] == "orbax checkpoint directory of an earlier stage (e.g. SFT)"
  assert notes["optim.offload_state"].startswith("Keep the AdamW state in pinned host memory")
  assert notes["rollout.streaming"].startswith("Streaming rollouts (rl/rollout/streaming.py)")
  assert "model.attention" not in notes  # under the heading "--- GQA attention ---" only
  assert "rollout.streaming.enabled" not in notes  # on its section's line, no comment of its own
  assert "rl.entropy_coef" in notes and "kl_coef" not in notes["rl.entropy_coef"]


def _one_line_error(cmd):
  out = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                       env=launcher_env())
  return out.returncode, out.stderr.strip().splitlines()


@pytest.mark.parametrize("script", ["train.py", "eval.py"])
def test_launchers_print_one_line_for_config_typos_and_missing_files(script, tmp_path):
  """A typo in a --config field or inside the config file, a --config file that does not exist,
  and (train.py) a tokenizer directory that does not exist: exit status 2 and one line
  `error: ...` naming the culprit, no traceback, nothing built (no workdir)."""
  launcher = [sys.executable, os.path.join(ROOT, "launch", script)]
  demo = f"--config={os.path.join(ROOT, 'configs', 'demo.py')}"
  workdir = tmp_path / "workdir"
  extra = ([f"--workdir={workdir}"] if script == "train.py" else
           [f"--checkpoint={tmp_path}", "--dataset=arithmetic"])
  typo_file = tmp_path / "typo.py"
  typo_file.write_text(TYPO_FILE.format(line="c.train.stepz = 3"))
  cases = [([demo, "--config.train.stpes=3"], r"'stpes' Did you mean \"steps\""),
           ([f"--config={typo_file}"], r"config.train.stepz: .*did you mean config.train.steps"),
           ([f"--config={tmp_path / 'nope.py'}"], r"nope.py"),
           ([demo, "--config.optim.lr=nan"], r"config.optim.lr=nan")]
  if script == "train.py":
    cases.append(([demo, f"--config.tokenizer={tmp_path / 'tok'}"], r"config.tokenizer="))
  import re
  for args, culprit in cases:
    status, lines = _one_line_error(launcher + args + extra)
    errors = [line for line in lines if line.startswith("error: ")]
    assert status == 2 and len(errors) == 1 and re.search(culprit, errors[0]), (args, lines)
    assert not any("Traceback" in line for line in lines), lines
  assert not workdir.exists()


def test_launcher_reports_bad_config_and_typos():
  """launch/train.py exits non-zero naming the bad field, before building anything."""
  cmd = [sys.executable, os.path.join(ROOT, "launch", "train.py"),
         f"--config={os.path.join(ROOT, 'configs', 'demo.py')}", "--workdir=/tmp/unused"]
  bad = subprocess.run(cmd + ["--config.rl.loss_agg_mode=mean"], capture_output=True,
                       text=True, timeout=120)
  assert bad.returncode == 2 and "config.rl.loss_agg_mode='mean'" in bad.stderr
  typo = subprocess.run(cmd + ["--config.rl.clip_hihg=0.3"], capture_output=True, text=True,
                        timeout=120)
  assert typo.returncode != 0 and "clip_hihg" in typo.stderr


def test_indexer_loss_needs_an_indexer():
  """config.rl.indexer_coef on a model without DSA is refused before anything is built."""
  c = base_config(preset="tiny_dense", algorithm="dapo")
  c.rl.overlong_buffer = 0
  validate(c)
  c.rl.indexer_coef = 0.1
  with pytest.raises(ValueError, match=r"config.rl.indexer_coef=0.1: the model has no DSA"):
    validate(c)


def test_keep_sampling_mask_needs_a_bounded_kept_set():
  """Keep-sampling-mask records each token's kept set as ids: top-p alone is bounded by
  rollout.max_kept_ids, and refused at start-up without one, naming the fields; top_k (or top_p
  1, or greedy) is accepted."""
  c = base_config(preset="tiny_dense", algorithm="grpo_v32")
  validate(c)  # top_p 1: nothing is truncated, nothing recorded
  c.rollout.top_p = 0.95
  validate(c)  # the nucleus cut to max_kept_ids (64)
  c.rollout.max_kept_ids = 0
  with pytest.raises(ValueError, match=r"config.rl.keep_sampling_mask=True with "
                     r"config.rollout.top_p=0.95, config.rollout.top_k=0 and "
                     r"config.rollout.max_kept_ids=0: "):
    validate(c)
  c.rollout.top_k = 64
  validate(c)
  c.rollout.max_kept_ids = -1
  with pytest.raises(ValueError, match=r"config.rollout.max_kept_ids=-1"):
    validate(c)


def test_mesh_allows_one_open_axis():
  """At most one mesh axis may take the devices left over (-1)."""
  config = load(os.path.join(ROOT, "configs", "demo.py"))
  config.mesh.shape.fsdp = -1
  with pytest.raises(ValueError, match=r"config.mesh.shape=.*at most one axis may be -1"):
    validate(config)


def test_init_hf_dir_shapes_must_match_the_model(tmp_path):
  """A present config.init_hf_dir whose config.json describes other shapes than config.model
  fails validation naming the field; a matching one (dtypes and context length free) passes."""
  import json
  from models import hf
  config = base_config(preset="qwen2.5-1.5b", algorithm="grpo", param_dtype="float32")
  config.init_hf_dir = str(tmp_path)
  hf_config = hf.config_to_hf(model_config(config).replace(param_dtype="bfloat16",
                                                           max_seq_len=4096))
  (tmp_path / "config.json").write_text(json.dumps(hf_config))
  validate(config)
  (tmp_path / "config.json").write_text(json.dumps(dict(hf_config, num_hidden_layers=30)))
  with pytest.raises(ValueError, match=r"config.model.n_layers=28 but .*config.json "
                                       r"\(config.init_hf_dir\) gives 30"):
    validate(config)


def test_init_hf_dir_starts_the_policy_from_the_checkpoint(tmp_path):
  """config.init_hf_dir loads the HF checkpoint (same logits as the saved model), not a random
  init; settings a one-device job (O1-Coder self-play) would ignore are refused, naming the
  field."""
  import jax
  import numpy as np

  from models import hf
  from models.transformer import build
  saved = build("tiny_dense", seed=3, dtype="float32", param_dtype="float32")
  hf.save_pretrained(saved, str(tmp_path))
  config = base_config(preset="tiny_dense", algorithm="grpo", dtype="float32",
                       param_dtype="float32")
  config.init_hf_dir = str(tmp_path)
  validate(config)
  tokens = jax.random.randint(jax.random.key(0), (2, 8), 0, 264)
  np.testing.assert_allclose(build_policy(config)(tokens), saved(tokens), atol=1e-5)
  # the fields a config chooses freely reach the loaded model (MoE dispatch was dropped)
  config.model.update(moe_dispatch="dense", router_bias_rate=0.5, remat="full")
  config.kernel_backend = "reference"
  loaded = build_policy(config).cfg
  assert (loaded.moe_dispatch, loaded.router_bias_rate, loaded.remat, loaded.kernel_backend) == (
      "dense", 0.5, "full", "reference")


def test_demo_grpo_v32_records_and_replays_kept_sets():
  """configs/demo.py:grpo_v32 samples with top-p alone, as DeepSeek-V3.2 does, so its
  keep-sampling-mask is live: the rollout records each token's kept ids (max_kept_ids ids and
  the cut flag) and the batch the update reads carries them."""
  from configs import demo
  from rl.parallel import placement
  from rl.rollout.engine import run_rollout_config
  c = demo.get_config("grpo_v32")
  validate(c)
  rollout = run_rollout_config(c)
  assert rollout.keep_sampling_mask and rollout.top_p < 1 and rollout.top_k == 0
  assert placement.workload(c).kept_ids == c.rollout.max_kept_ids + 1
