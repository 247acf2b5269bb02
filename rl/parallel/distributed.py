"""Multi-host start-up: one process per host, joined into one JAX runtime by
`jax.distributed.initialize`, from whatever the launcher put in the environment.

Call `initialize_from_env()` first thing in a launcher's main, before anything touches a jax
device. Sources, in order:

1. Explicit (any launcher, a shell, XManager jobs that set them per task):
     JAX_COORDINATOR_ADDRESS  host or host:port of process 0 (port: JAX_COORDINATOR_PORT,
                              default 8476)
     JAX_NUM_PROCESSES        number of processes (JAX_PROCESS_COUNT is accepted too)
     JAX_PROCESS_ID           this process's rank in [0, JAX_NUM_PROCESSES)
2. GKE JobSet (the xpk / MaxText convention; launch/gke manifests): the coordinator and count
   as above, the rank from the Indexed Job:
     JOB_COMPLETION_INDEX     pod index inside its Job (set by Kubernetes)
     JOB_INDEX                index of the Job among the JobSet's replicas (default 0; from
                              the jobset.sigs.k8s.io/job-index label via the downward API)
     PROCESSES_IN_JOB         pods per Job (default 1 when JOB_INDEX is 0)
   rank = JOB_INDEX * PROCESSES_IN_JOB + JOB_COMPLETION_INDEX. The coordinator is pod 0 of
   Job 0: "<jobset>-<replicated job>-0-0.<jobset>" under the JobSet's headless service.
3. CLUSTER_SPEC (Vertex AI custom jobs, where XManager's GCP backend runs work units):
   JSON {"cluster": {"workerpool0": ["host:port"], "workerpool1": [...]},
         "task": {"type": "workerpool1", "index": 2}}; ranks follow the pools in order
   (workerpool0 first), and the coordinator is workerpool0's first address.
4. Environments jax detects itself (Cloud TPU VMs / GKE TPU with TPU_WORKER_HOSTNAMES,
   SLURM, Open MPI): `jax.distributed.initialize()` without arguments.

Anything else is one process, and `initialize_from_env` does nothing. On CPU (JAX_PLATFORMS
= cpu) the cross-process collectives use gloo.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Mapping

import jax

DEFAULT_PORT = 8476


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
  num_processes: int
  process_id: int
  coordinator: str | None  # host:port; None for one process or jax's own detection
  source: str  # "single", "explicit", "gke_jobset", "cluster_spec" or "jax_auto"


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
  if name not in env:
    if default is None:
      raise ValueError(f"environment variable {name} is required here and is not set")
    return default
  try:
    return int(env[name])
  except ValueError:
    raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _with_port(address: str, env: Mapping[str, str]) -> str:
  if ":" in address.rsplit("]", 1)[-1]:
    return address
  return f"{address}:{_int(env, 'JAX_COORDINATOR_PORT', DEFAULT_PORT)}"


def _jax_detects_cluster(env: Mapping[str, str]) -> bool:
  tpu_hosts = env.get("TPU_WORKER_HOSTNAMES", "")
  return (len([h for h in tpu_hosts.split(",") if h]) > 1
          or ("SLURM_JOB_ID" in env and _int(env, "SLURM_NTASKS", 1) > 1)
          or "OMPI_MCA_orte_hnp_uri" in env)


def process_info_from_env(env: Mapping[str, str] | None = None) -> ProcessInfo:
  """Who this process is, from the launcher's environment (no side effects)."""
  env = os.environ if env is None else env
  count_name = "JAX_NUM_PROCESSES" if "JAX_NUM_PROCESSES" in env else "JAX_PROCESS_COUNT"
  if "CLUSTER_SPEC" in env and count_name not in env:
    return _from_cluster_spec(env)
  if count_name in env:
    num = _int(env, count_name)
    if "JAX_PROCESS_ID" in env:
      pid, source = _int(env, "JAX_PROCESS_ID"), "explicit"
    elif "JOB_COMPLETION_INDEX" in env:
      job = _int(env, "JOB_INDEX", 0)
      per_job = _int(env, "PROCESSES_IN_JOB", 1 if job == 0 else None)
      pid, source = job * per_job + _int(env, "JOB_COMPLETION_INDEX"), "gke_jobset"
    else:
      raise ValueError(f"{count_name}={env[count_name]} is set but neither JAX_PROCESS_ID nor "
                       "JOB_COMPLETION_INDEX says which process this is")
    if num < 1 or not 0 <= pid < num:
      raise ValueError(f"process id {pid} is not in [0, {count_name}={num})")
    if num == 1:
      return ProcessInfo(1, 0, None, "single")
    if "JAX_COORDINATOR_ADDRESS" in env:
      coordinator = _with_port(env["JAX_COORDINATOR_ADDRESS"], env)
    elif "JOBSET_NAME" in env and "REPLICATED_JOB_NAME" in env:
      jobset = env["JOBSET_NAME"]
      coordinator = _with_port(f"{jobset}-{env['REPLICATED_JOB_NAME']}-0-0.{jobset}", env)
    else:
      raise ValueError(f"{count_name}={num} needs JAX_COORDINATOR_ADDRESS (or JOBSET_NAME and "
                       "REPLICATED_JOB_NAME on GKE) to find process 0")
    return ProcessInfo(num, pid, coordinator, source)
  if _jax_detects_cluster(env):
    return ProcessInfo(0, -1, None, "jax_auto")
  return ProcessInfo(1, 0, None, "single")


def _from_cluster_spec(env: Mapping[str, str]) -> ProcessInfo:
  try:
    spec = json.loads(env["CLUSTER_SPEC"])
    pools = spec["cluster"]
    task_type, index = spec["task"]["type"], int(spec["task"]["index"])
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"CLUSTER_SPEC is not a Vertex AI cluster spec ({e!r}): "
                     f"{env['CLUSTER_SPEC'][:200]!r}") from None
  names = sorted((n for n in pools if n.startswith("workerpool")), key=lambda n: int(n[10:]))
  if task_type not in names or not 0 <= index < len(pools[task_type]):
    raise ValueError(f"CLUSTER_SPEC task {task_type}[{index}] is not in its cluster {names}")
  offset = sum(len(pools[n]) for n in names[:names.index(task_type)])
  num = sum(len(pools[n]) for n in names)
  if num == 1:
    return ProcessInfo(1, 0, None, "single")
  return ProcessInfo(num, offset + index, _with_port(pools[names[0]][0], env), "cluster_spec")


def initialize_from_env(env: Mapping[str, str] | None = None, *,
                        timeout_s: int = 300) -> ProcessInfo:
  """Joins this process to the others named by the environment (see the module docstring);
  a no-op for a single process or when already initialised. Returns who this process is."""
  env = os.environ if env is None else env
  info = process_info_from_env(env)
  if info.source == "single":
    return info
  if jax.distributed.is_initialized():
    return ProcessInfo(jax.process_count(), jax.process_index(), info.coordinator,
                       info.source)
  if env.get("JAX_PLATFORMS", "").split(",")[0] == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if info.source == "jax_auto":
    jax.distributed.initialize(initialization_timeout=timeout_s)
    return ProcessInfo(jax.process_count(), jax.process_index(), None, "jax_auto")
  jax.distributed.initialize(coordinator_address=info.coordinator,
                             num_processes=info.num_processes, process_id=info.process_id,
                             initialization_timeout=timeout_s)
  return info


def is_main_process() -> bool:
  """True on process 0: the one that logs, writes summaries and owns host-side files."""
  return jax.process_index() == 0
