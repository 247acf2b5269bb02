"""Autotuning of the DSA kernels' launch parameters (block sizes, warps, stages), once per shape.

A kernel called with `block_config="auto"` asks `tune` for its parameters. On a cache miss
`tune` times every candidate the kernel proposes on the current device, with random inputs of
the call's shapes and dtypes, and records the fastest in a JSON file; later calls (in this or
any later process) read the choice back without timing anything. Candidates that fail to
lower, compile or run (a Triton tile over the shared-memory budget, a shape Mosaic rejects)
are skipped and recorded with their error.

Cache: one JSON object, entry key = kernel name + shapes + dtypes + static parameters + device
kind + jax version (a new device or jax release tunes again). Location: `settings(cache_path=)`,
else $SEEDRL_AUTOTUNE_CACHE, else ~/.cache/seedrl/autotune.json. Writes go through a temporary
file and a rename, so a killed process never leaves half a file; an unreadable file is
reported with a warning and rebuilt.

Tuning runs at trace time when the kernel is called inside `jax.jit` (shapes are static
there): the candidates are compiled and timed in a separate thread (JAX's trace state is per
thread, so they run as ordinary programs), on fresh random inputs of the call's shapes.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import os
import statistics
import tempfile
import time
import warnings
from typing import Any, Callable, Iterator, Sequence

import jax
import numpy as np

CACHE_ENV = "SEEDRL_AUTOTUNE_CACHE"
DEFAULT_CACHE = os.path.join("~", ".cache", "seedrl", "autotune.json")
BLOCK_CONFIGS = ("default", "auto")  # a kernel's `block_config`: its defaults, or tuned

# timer(run, config) -> seconds; `run()` launches the candidate and returns its outputs.
Timer = Callable[[Callable[[], Any], dict], float]


def wall_timer(run: Callable[[], Any], config: dict, *, iters: int = 5) -> float:
  """Median wall time of `iters` runs after one untimed run (compilation, warm-up)."""
  del config
  jax.block_until_ready(run())
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(run())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


@dataclasses.dataclass(frozen=True)
class Settings:
  cache_path: str | None = None  # None: $SEEDRL_AUTOTUNE_CACHE, else DEFAULT_CACHE
  timer: Timer = wall_timer


_SETTINGS = [Settings()]


@contextlib.contextmanager
def settings(**changes) -> Iterator[Settings]:
  """Temporarily changes the cache location or the timer (tests, benchmarks)."""
  _SETTINGS.append(dataclasses.replace(_SETTINGS[-1], **changes))
  try:
    yield _SETTINGS[-1]
  finally:
    _SETTINGS.pop()


def cache_path() -> str:
  path = _SETTINGS[-1].cache_path or os.environ.get(CACHE_ENV) or DEFAULT_CACHE
  return os.path.abspath(os.path.expanduser(path))


def check_block_config(block_config: str) -> None:
  if block_config not in BLOCK_CONFIGS:
    raise ValueError(f"block_config={block_config!r}: must be one of {list(BLOCK_CONFIGS)}")


def cache_key(kernel: str, arrays: dict[str, Any], static: dict[str, Any]) -> str:
  """The entry key: kernel, argument shapes and dtypes, static parameters, device, jax."""
  return json.dumps({
      "kernel": kernel,
      "arrays": {name: [list(a.shape), str(a.dtype)] for name, a in sorted(arrays.items())},
      "static": {k: static[k] for k in sorted(static)},
      "device": jax.devices()[0].device_kind,
      "jax": jax.__version__,
  }, sort_keys=True)


class TuningCache:
  """The JSON file of tuned choices: {key: {"best", "timings", "failures", "tuned_at"}}."""

  def __init__(self, path: str):
    self.path = path

  def read(self) -> dict:
    try:
      with open(self.path) as f:
        entries = json.load(f)
    except FileNotFoundError:
      return {}
    except (OSError, ValueError) as e:  # ValueError covers JSON and text-decoding errors
      warnings.warn(f"autotune cache {self.path} is unreadable ({type(e).__name__}: {e}); "
                    "it will be rebuilt", RuntimeWarning, stacklevel=3)
      return {}
    if not isinstance(entries, dict) or not all(
        isinstance(v, dict) and isinstance(v.get("best"), dict) for v in entries.values()):
      warnings.warn(f"autotune cache {self.path} does not hold tuning entries; it will be "
                    "rebuilt", RuntimeWarning, stacklevel=3)
      return {}
    return entries

  def get(self, key: str) -> dict | None:
    return self.read().get(key)

  def put(self, key: str, entry: dict) -> None:
    """Adds one entry to what is on disk now (another process may have added others)."""
    entries = self.read()
    entries[key] = entry
    directory = os.path.dirname(self.path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".autotune.", suffix=".json")
    try:
      with os.fdopen(fd, "w") as f:
        json.dump(entries, f, indent=1, sort_keys=True)
      os.replace(tmp, self.path)
    except BaseException:
      os.unlink(tmp)
      raise


def tune(kernel: str, arrays: dict[str, Any], static: dict[str, Any],
         candidates: Sequence[dict], make_inputs: Callable[[], tuple],
         build: Callable[[dict], Callable[..., Any]]) -> dict:
  """The fastest of `candidates` for this call, from the cache or timed now.

  Args:
    kernel: the kernel's name (part of the key).
    arrays: the call's array arguments by name (only shapes and dtypes are read).
    static: the call's other parameters that change what is compiled (part of the key).
    candidates: launch-parameter dicts to try (JSON-serialisable).
    make_inputs: () -> inputs of the call's shapes (made only on a cache miss).
    build: build(config) -> a (jitted) function of the inputs that launches the kernel with
      `config`; built once per candidate, then timed.
  """
  key = cache_key(kernel, arrays, static)
  cache = TuningCache(cache_path())
  hit = cache.get(key)
  if hit is not None:
    return hit["best"]
  timer = _SETTINGS[-1].timer

  def time_candidates():
    timings, failures = [], []
    inputs = make_inputs()
    for config in candidates:
      try:
        launch = build(config)
        seconds = float(timer(functools.partial(launch, *inputs), config))
      except Exception as e:  # noqa: BLE001 (any lowering/compile/launch error skips it)
        failures.append({"config": config, "error": f"{type(e).__name__}: {str(e)[:500]}"})
        continue
      timings.append({"config": config, "seconds": seconds})
    return timings, failures

  # JAX's trace state is per thread: in a fresh thread the candidates compile and run as
  # ordinary programs even when this call is being traced inside a jit.
  with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
    timings, failures = pool.submit(time_candidates).result()
  if not timings:
    raise RuntimeError(f"autotune {kernel}: all {len(candidates)} candidates failed; first "
                       f"error: {failures[0]['error'] if failures else 'no candidates'}")
  best = min(timings, key=lambda t: t["seconds"])["config"]
  cache.put(key, {"best": best, "timings": timings, "failures": failures,
                  "tuned_at": time.strftime("%Y-%m-%dT%H:%M:%S")})
  return best


def random_like(rng: np.random.Generator, x) -> jax.Array:
  """Standard-normal values of x's shape and dtype (timing inputs)."""
  return jax.numpy.asarray(rng.standard_normal(x.shape), x.dtype)


def random_indices(rng: np.random.Generator, shape: tuple[int, ...], length: int) -> jax.Array:
  """int32 indices uniform in [0, length): every slot valid, the kernels' slowest case."""
  return jax.numpy.asarray(rng.integers(0, length, shape), jax.numpy.int32)


def tune_sparse_mla(name: str, kernel: Callable, candidates: Sequence[dict], q, kv, indices, *,
                    scale: float, d_v: int, interpret) -> dict:
  """`tune` for a sparse-MLA kernel `kernel(q, kv, indices, scale=, d_v=, interpret=,
  **config)`: its forward pass timed on random inputs of these shapes."""
  def make_inputs():
    rng = np.random.default_rng(0)
    return (random_like(rng, q), random_like(rng, kv),
            random_indices(rng, indices.shape, kv.shape[1]))

  def build(config):
    return jax.jit(functools.partial(kernel, scale=scale, d_v=d_v, interpret=interpret,
                                     **config))
  return tune(name, {"q": q, "kv": kv, "indices": indices},
              {"d_v": d_v, "interpret": bool(interpret)}, candidates, make_inputs, build)
