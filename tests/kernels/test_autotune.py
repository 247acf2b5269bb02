"""Kernel autotuning (kernels/autotune.py) on CPU: the mechanism with fake kernels and an
injected timer (fastest wins, failures skipped and recorded, no re-timing, the cache outlives
the process, a corrupt cache is reported and rebuilt), then the DSA kernels in interpret mode
with `block_config="auto"` inside jax.jit: the tuned parameters are the ones launched and the
results still equal the references."""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax.experimental.pallas import tpu as pltpu

from kernels import autotune, indexer, reference, sparse_mla_gpu, sparse_mla_tpu

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CANDIDATES = [{"block": 16}, {"block": 32}, {"block": 64}, {"block": 128}]
FAKE_SECONDS = {16: 3.0, 32: 1.0, 64: 2.0}  # block 128 "exceeds shared memory"


def fake_build(config):
  """A 'kernel' per candidate; block 128 fails to compile, as an oversized Triton tile does."""
  if config["block"] == 128:
    raise ValueError("out of resource: shared memory, required 300000 > 232448")
  return lambda x: x * config["block"]


class CountingTimer:
  """Runs each candidate once (a real launch), reports its fake time, counts the calls."""

  def __init__(self, seconds=FAKE_SECONDS):
    self.seconds, self.calls = seconds, []

  def __call__(self, run, config):
    jax.block_until_ready(run())
    self.calls.append(config)
    return self.seconds[config["block"]]


def never_called(run, config):
  raise AssertionError(f"timed {config} although the cache holds the choice")


def tune_fake(shape=(4, 8)):
  x = jnp.ones(shape)
  return autotune.tune("fake", {"x": x}, {"mode": "test"}, CANDIDATES, lambda: (x,), fake_build)


def test_picks_the_fastest_records_failures_and_does_not_retime(tmp_path):
  path = str(tmp_path / "cache" / "autotune.json")
  timer = CountingTimer()
  with autotune.settings(cache_path=path, timer=timer):
    assert tune_fake() == {"block": 32}
    assert len(timer.calls) == 3  # the failing candidate is never timed
  with autotune.settings(cache_path=path, timer=never_called):
    assert tune_fake() == {"block": 32}
    assert autotune.cache_path() == path
  (entry,) = json.load(open(path)).values()
  assert sorted(t["config"]["block"] for t in entry["timings"]) == [16, 32, 64]
  (failure,) = entry["failures"]
  assert failure["config"] == {"block": 128} and "shared memory" in failure["error"]
  key = json.loads(next(iter(json.load(open(path)))))
  assert key["kernel"] == "fake" and key["arrays"] == {"x": [[4, 8], "float32"]}
  assert key["device"] == jax.devices()[0].device_kind and key["jax"] == jax.__version__
  with autotune.settings(cache_path=path, timer=CountingTimer({16: 1.0, 32: 2.0, 64: 3.0})):
    assert tune_fake(shape=(4, 16)) == {"block": 16}  # a new shape is tuned on its own
  assert len(json.load(open(path))) == 2


def test_cache_survives_a_new_process(tmp_path, monkeypatch):
  """A choice timed in another process (cache path from $SEEDRL_AUTOTUNE_CACHE) is read back
  here without timing."""
  path = str(tmp_path / "autotune.json")
  script = textwrap.dedent(f"""
      import sys
      sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
      sys.path.insert(0, {REPO!r})
      import test_autotune
      from kernels import autotune
      with autotune.settings(timer=test_autotune.CountingTimer({{16: 1.0, 32: 5.0, 64: 5.0}})):
        print(test_autotune.tune_fake())
  """)
  env = dict(os.environ, JAX_PLATFORMS="cpu", **{autotune.CACHE_ENV: path})
  out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                       timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert "{'block': 16}" in out.stdout
  monkeypatch.setenv(autotune.CACHE_ENV, path)
  with autotune.settings(timer=never_called):
    assert tune_fake() == {"block": 16}


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"k": {"no_best": 1}}', "\udcff"])
def test_corrupt_cache_warns_and_is_rebuilt(tmp_path, content):
  path = tmp_path / "autotune.json"
  path.write_bytes(content.encode("utf-8", "surrogateescape"))
  with autotune.settings(cache_path=str(path), timer=CountingTimer()):
    with pytest.warns(RuntimeWarning, match=f"autotune cache {path}"):
      assert tune_fake() == {"block": 32}
  entries = json.loads(path.read_text())
  assert len(entries) == 1 and next(iter(entries.values()))["best"] == {"block": 32}


def test_all_candidates_failing_is_an_error(tmp_path):
  x = jnp.ones(3)
  with autotune.settings(cache_path=str(tmp_path / "c.json"), timer=CountingTimer()):
    with pytest.raises(RuntimeError, match="all 1 candidates failed.*shared memory"):
      autotune.tune("fake", {"x": x}, {}, [{"block": 128}], lambda: (x,), fake_build)
  with pytest.raises(ValueError, match="block_config"):
    autotune.check_block_config("fastest")


def prefer(best: dict, launched: list, *, launch_best: bool = True):
  """A timer that calls `best` the fastest (others 1 s). It launches only `best` (for real,
  from the tuning thread, while the caller is being traced): interpret-mode compilations of
  every candidate would take minutes on CPU."""
  def timer(run, config):
    launched.append(config)
    if config == best and launch_best:
      jax.block_until_ready(run())
    return 0.5 if config == best else 1.0
  return timer


def test_sparse_mla_auto_block_config_under_jit(tmp_path):
  """Inside jax.jit, `block_config="auto"` tunes at trace time (random inputs of the call's
  shapes), launches the tuned block_k (the index list padded to its multiple) and matches the
  reference; a second trace reads the cache."""
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((1, 3, 4, 80)), jnp.float32)
  kv = jnp.asarray(rng.standard_normal((1, 50, 80)), jnp.float32)
  idx = jnp.asarray(rng.integers(-1, 50, (1, 3, 72)), jnp.int32)
  candidates = sparse_mla_gpu.tuning_candidates(4, 72)
  assert {c["block_k"] for c in candidates} == {32, 64, 128}
  best = {"block_h": 16, "block_k": 32, "num_warps": 4, "num_stages": 3}
  launched = []

  def attend(q, kv, idx):
    return sparse_mla_gpu.sparse_mla(q, kv, idx, scale=0.1, d_v=64, interpret=True,
                                     block_config="auto")
  path = tmp_path / "c.json"
  with autotune.settings(cache_path=str(path), timer=prefer(best, launched)):
    jaxpr = str(jax.make_jaxpr(attend)(q, kv, idx))
    assert len(launched) == len(candidates)
    assert "i32[1,3,96]" in jaxpr  # 72 indices padded to a multiple of block_k = 32
    out, lse = jax.jit(attend)(q, kv, idx)
    assert len(launched) == len(candidates)
  (entry,) = json.loads(path.read_text()).values()
  assert entry["best"] == best and not entry["failures"]  # `best` really launched
  want_out, want_lse = reference.sparse_mla(q, kv, idx, scale=0.1, d_v=64)
  np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_tpu_sparse_mla_tuning_entry(tmp_path):
  """The TPU kernel's candidates (head blocks in multiples of 8, DMA chunk sizes) are tuned
  and cached under their own kernel name (no launch: TPU interpret mode is slow)."""
  q, kv, idx = jnp.zeros((1, 2, 12, 80)), jnp.zeros((1, 40, 80)), jnp.zeros((1, 2, 50), jnp.int32)
  candidates = sparse_mla_tpu.tuning_candidates(12, 50)
  assert {c["block_h"] for c in candidates} == {8, 16} and {c["block_k"] for c in candidates} == {
      32, 64}
  best, launched = {"block_h": 8, "block_k": 64}, []
  path = tmp_path / "c.json"
  with autotune.settings(cache_path=str(path), timer=prefer(best, launched, launch_best=False)):
    assert sparse_mla_tpu.tuned_launch(q, kv, idx, scale=0.1, d_v=64,
                                       interpret=pltpu.InterpretParams()) == best
  assert len(launched) == len(candidates)
  assert json.loads(next(iter(json.loads(path.read_text()))))["kernel"] == "sparse_mla_tpu"


def test_indexer_auto_block_config_matches_reference(tmp_path):
  """The indexer with `block_config="auto"` launches the tuned tiles and selects exactly the
  reference's keys (exactly representable inputs)."""
  rng = np.random.default_rng(1)
  q = jnp.asarray(rng.integers(-3, 4, (1, 40, 2, 16)), jnp.float32)
  k = jnp.asarray(rng.integers(-3, 4, (1, 40, 16)), jnp.float32)
  w = jnp.asarray(rng.integers(-2, 3, (1, 40, 2)) * 0.25, jnp.float32)
  best = {"block_q": 16, "block_l": 64, "num_warps": 8, "num_stages": 1}
  launched = []
  path = tmp_path / "c.json"
  with autotune.settings(cache_path=str(path), timer=prefer(best, launched)):
    got = jax.jit(lambda q, k, w: indexer.lightning_indexer(
        q, k, w, topk=8, interpret=True, block_config="auto"))(q, k, w)
  assert len(launched) == len(indexer.tuning_candidates(40, 40, "gpu"))
  (entry,) = json.loads(path.read_text()).values()
  assert entry["best"] == best and not entry["failures"]
  want = reference.lightning_indexer(q, k, w, topk=8)
  np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
  np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
