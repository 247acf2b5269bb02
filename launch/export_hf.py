"""Writes a run's policy as a Hugging Face checkpoint directory (config.json + safetensors +
tokenizer files), which transformers, vLLM and SGLang load.

  python launch/export_hf.py --checkpoint=workdir/demo/rl/checkpoints --out=/tmp/demo_hf
  python launch/export_hf.py --checkpoint=workdir/qwen_dapo --out=/ckpt/qwen_dapo_200 \
      --step=200 --out_dtype=bfloat16 --mesh=fsdp=-1

--checkpoint is a run's orbax checkpoint directory (<workdir>/checkpoints) or its workdir; the
model is rebuilt from the run's own resolved config (<workdir>/config.json, written by the
trainer and SFT), so no --config is needed. Any saved step (--step; default the latest) of an
RL or SFT run exports; only the policy is read, not the optimiser state or a critic.

Memory: the policy is restored straight into its shards on a mesh of this host's devices
(--mesh, default every device on "fsdp"), then written tensor by tensor (models/hf.py
save_pretrained): each parameter is gathered to the host, converted and appended to its
safetensors file before the next is read, so host memory holds one parameter (the embedding
or one MoE layer's stacked experts) at a time, never the whole model. On several hosts every
process runs this same command; process 0 writes the files.

Tokenizer: a run whose config.tokenizer is an HF directory gets its tokenizer files copied
beside the weights (tokenizer.json, tokenizer_config.json, special_tokens_map.json,
generation_config.json, chat_template.jinja, those that exist). The built-in byte tokenizer
(config.tokenizer="byte") has no HF form: the export then holds the model alone, and a
warning says so; its ids are UTF-8 bytes + 7 (models/tokenizer.py ByteTokenizer), which a
user encodes themselves.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ml_collections  # noqa: E402
from absl import flags, logging  # noqa: E402

from launch import cli, logs  # noqa: E402
from models import hf  # noqa: E402
from models import sharding as sharding_lib  # noqa: E402
from rl.core.checks import InputError  # noqa: E402

_CHECKPOINT = cli.define(flags.DEFINE_string,
    "checkpoint", None, "A run's orbax checkpoint directory (<workdir>/checkpoints) or its "
    "workdir.")
_OUT = cli.define(flags.DEFINE_string, "out", None, "Output directory of the HF checkpoint.")
_STEP = cli.define(flags.DEFINE_integer, "step", None, "Checkpoint step (default: the latest).")
_DTYPE = flags.DEFINE_string("out_dtype", None, "dtype of the written tensors: float32, bfloat16 "
                             "or float16 (default: the run's config.model.param_dtype).")
_MESH = cli.define(flags.DEFINE_string, "mesh", "fsdp=-1", "Mesh the policy is restored onto: "
                            "comma-separated axis=size over this host's devices (one may be "
                            "-1: the devices left over), e.g. fsdp=4,tensor=2.")


def run_paths(checkpoint: str) -> tuple[str, str]:
  """(workdir, checkpoint directory) of --checkpoint, which names either."""
  checkpoint = os.path.abspath(checkpoint)
  if not os.path.isdir(checkpoint):
    raise InputError(f"--checkpoint={checkpoint}: no such directory")
  if os.path.isdir(os.path.join(checkpoint, "checkpoints")):
    return checkpoint, os.path.join(checkpoint, "checkpoints")
  return os.path.dirname(checkpoint), checkpoint


def run_config(workdir: str) -> ml_collections.ConfigDict:
  """The run's resolved config, as the trainer wrote it to <workdir>/config.json."""
  path = os.path.join(workdir, "config.json")
  if not os.path.isfile(path):
    raise InputError(f"{path} does not exist: --checkpoint must be a run's checkpoint "
                     "directory or workdir (the run writes its config.json there)")
  with open(path) as f:
    return ml_collections.ConfigDict(json.load(f))


def export(checkpoint: str, out: str, *, step: int | None = None, dtype: str | None = None,
           mesh_shape: dict[str, int] | None = None) -> int:
  """Writes the policy of `checkpoint` (a run's checkpoint directory or workdir) at `step`
  (None: the latest) to `out` as an HF directory; returns the step written."""
  from rl.core.policy import model_config
  from rl.jobs import evaluation
  workdir, directory = run_paths(checkpoint)
  config = run_config(workdir)
  hf.family_of(model_config(config))  # a model with no HF family fails before the restore
  if dtype is not None and dtype not in hf.SAFETENSORS_DTYPES:
    raise InputError(f"--out_dtype={dtype}: one of {', '.join(sorted(hf.SAFETENSORS_DTYPES))}")
  try:
    mesh = sharding_lib.make_mesh(mesh_shape or {"fsdp": -1})
  except ValueError as e:
    raise InputError(f"--mesh: {e}") from None
  try:
    model, step = evaluation.load_policy_checkpoint(config, directory, step, mesh=mesh)
  except (FileNotFoundError, ValueError) as e:
    raise InputError(f"--checkpoint: {e}") from None
  tokenizer_dir = None
  if os.path.isfile(os.path.join(config.tokenizer, "tokenizer.json")):
    tokenizer_dir = config.tokenizer
  else:
    logging.warning("the run's tokenizer %r has no HF tokenizer files: %s holds the model "
                    "alone (the byte tokenizer's ids are UTF-8 bytes + 7)", config.tokenizer,
                    out)
  hf.save_pretrained(model, out, dtype=dtype, tokenizer_dir=tokenizer_dir)
  logging.info("wrote step %d of %s to %s (%s)", step, directory, out,
               hf.family_of(model.cfg))
  return step


def main(argv):
  cli.no_arguments(argv)
  if not _CHECKPOINT.value or not _OUT.value:
    raise InputError("--checkpoint and --out are required")
  from rl.parallel import distributed
  distributed.initialize_from_env()
  export(_CHECKPOINT.value, _OUT.value, step=_STEP.value, dtype=_DTYPE.value,
         mesh_shape=cli.mesh_shape("mesh", _MESH.value))


if __name__ == "__main__":
  logs.run(main, bad_input=(InputError, hf.CheckpointError))
