"""Memory and process limits for a code sandbox as a whole (rl/rewards/sandbox.py), by cgroup.

rlimits bind one process each: under RLIMIT_AS=512 MB, four children hold 2 GB between them.
A cgroup binds them all, tmpfs files they write and the kernel memory they cause included.
Each run gets its own cgroup, `seedrl-sandbox/run-<id>`, beside (not inside) the caller's:
cgroup v2 forbids processes in a cgroup whose children have controllers, and the caller's
cgroup has processes. With cgroup v2 the run's cgroup sets memory.max, memory.swap.max=0,
memory.oom.group=1 (an OOM kill takes the whole run) and pids.max; on a cgroup v1 host (or a
hybrid one whose memory and pids controllers are on v1, such as the machines this project is
tested on) it sets memory.limit_in_bytes, memory.memsw.limit_in_bytes and pids.max.

`hierarchy()` finds out, once per process, whether this works here: it needs the memory and
pids controllers and write access to their roots, which a root caller on a host has, and a
container or a non-root caller usually has not (unless a writable, delegated cgroup tree is
mounted). When it does not, `unavailable_reason()` says why, and the sandbox falls back to its
per-process rlimits (see rl/rewards/sandbox.py and docs/security.md).
"""

import dataclasses
import functools
import os
import signal
import time
import uuid

PARENT_NAME = "seedrl-sandbox"
_RMDIR_TIMEOUT_S = 2.0


@dataclasses.dataclass(frozen=True)
class Hierarchy:
  """Where run cgroups are created: one directory per controller (the same one on v2)."""
  version: int
  memory_parent: str
  pids_parent: str


def _mounts() -> list[tuple[str, str, set[str]]]:
  """(mount point, filesystem type, super options) of the cgroup mounts we can see."""
  mounts = []
  with open("/proc/self/mountinfo") as f:
    for line in f:
      fields = line.split()
      separator = fields.index("-")
      fstype, options = fields[separator + 1], fields[separator + 3]
      if fstype in ("cgroup", "cgroup2"):
        mounts.append((fields[4], fstype, set(options.split(","))))
  return mounts


def _write(path: str, value: str) -> None:
  with open(path, "w") as f:
    f.write(value)


def _read(path: str) -> str:
  with open(path) as f:
    return f.read()


def _enable_v2_controllers(directory: str) -> None:
  enabled = set(_read(f"{directory}/cgroup.subtree_control").split())
  if not {"memory", "pids"} <= enabled:
    _write(f"{directory}/cgroup.subtree_control", "+memory +pids")


def _find_hierarchy() -> Hierarchy | str:
  """The usable hierarchy, set up (parent cgroups created), or why there is none."""
  mounts = _mounts()
  reasons = []
  for point, fstype, _ in mounts:
    if fstype != "cgroup2":
      continue
    try:
      controllers = set(_read(f"{point}/cgroup.controllers").split())
    except OSError as error:
      reasons.append(f"cannot read {point}/cgroup.controllers ({error.strerror})")
      continue
    if not {"memory", "pids"} <= controllers:
      reasons.append(f"the cgroup v2 tree at {point} has no memory/pids controllers")
      continue
    parent = os.path.join(point, PARENT_NAME)
    try:
      _enable_v2_controllers(point)
      os.makedirs(parent, exist_ok=True)
      _enable_v2_controllers(parent)
    except OSError as error:
      reasons.append(f"cannot set up {parent} ({error.strerror})")
      continue
    return Hierarchy(2, parent, parent)
  v1 = {}
  for point, fstype, options in mounts:
    for controller in ("memory", "pids"):
      if fstype == "cgroup" and controller in options:
        v1.setdefault(controller, point)
  if set(v1) == {"memory", "pids"}:
    parents = {c: os.path.join(point, PARENT_NAME) for c, point in v1.items()}
    try:
      for parent in parents.values():
        os.makedirs(parent, exist_ok=True)
    except OSError as error:
      reasons.append(f"cannot create cgroup v1 {PARENT_NAME} cgroups ({error.strerror})")
    else:
      return Hierarchy(1, parents["memory"], parents["pids"])
  elif not reasons:
    reasons.append("no cgroup filesystem with memory and pids controllers is mounted")
  return "; ".join(reasons)


def _probe(where: Hierarchy) -> str | None:
  """Why a run cgroup cannot be made under `where` (say the parents exist, made by root, but
  we are not root), or None when it can."""
  try:
    RunCgroup(where, memory_bytes=1 << 30, max_pids=64).close()
  except OSError as error:
    return f"cannot create a cgroup under {where.memory_parent} ({error.strerror})"
  return None


@functools.cache
def _cached() -> Hierarchy | str:
  found = _find_hierarchy()
  if isinstance(found, Hierarchy):
    return _probe(found) or found
  return found


def hierarchy() -> Hierarchy | None:
  """The hierarchy run cgroups go into, or None when cgroups cannot be used here."""
  found = _cached()
  return found if isinstance(found, Hierarchy) else None


def unavailable_reason() -> str | None:
  found = _cached()
  return None if isinstance(found, Hierarchy) else found


class RunCgroup:
  """The cgroup of one sandbox run: created with its limits, processes attached, OOM kills
  counted, and removed (with anything still in it killed) by close()."""

  def __init__(self, where: Hierarchy, *, memory_bytes: int, max_pids: int):
    self.version = where.version
    name = f"run-{uuid.uuid4().hex}"
    self.memory_dir = os.path.join(where.memory_parent, name)
    self.pids_dir = os.path.join(where.pids_parent, name)
    self.dirs = list(dict.fromkeys([self.memory_dir, self.pids_dir]))
    for directory in self.dirs:
      os.mkdir(directory)
    try:
      if self.version == 2:
        _write(f"{self.memory_dir}/memory.max", str(memory_bytes))
        self._write_if_present(f"{self.memory_dir}/memory.swap.max", "0")
        _write(f"{self.memory_dir}/memory.oom.group", "1")
      else:
        _write(f"{self.memory_dir}/memory.limit_in_bytes", str(memory_bytes))
        self._write_if_present(f"{self.memory_dir}/memory.memsw.limit_in_bytes",
                               str(memory_bytes))
      _write(f"{self.pids_dir}/pids.max", str(max_pids))
    except BaseException:
      self.close()
      raise

  @staticmethod
  def _write_if_present(path: str, value: str) -> None:
    # Swap accounting is a kernel option: without it there is no swap limit to set.
    if os.path.exists(path):
      _write(path, value)

  def attach(self, pid: int) -> None:
    """Moves process `pid` (not yet running the program) into the run's cgroup."""
    for directory in self.dirs:
      _write(f"{directory}/cgroup.procs", str(pid))

  def oom_kills(self) -> int:
    """How many processes of the run the kernel killed for going over the memory limit."""
    name = "memory.events" if self.version == 2 else "memory.oom_control"
    try:
      for line in _read(f"{self.memory_dir}/{name}").splitlines():
        key, value = line.split()
        if key == "oom_kill":
          return int(value)
    except OSError:
      pass
    return 0

  def _pids(self) -> list[int]:
    pids = set()
    for directory in self.dirs:
      try:
        pids.update(int(p) for p in _read(f"{directory}/cgroup.procs").split())
      except OSError:
        continue
    return sorted(pids)

  def close(self) -> None:
    """Kills whatever is left in the cgroup (nothing, normally: the PID namespace is gone)
    and removes it; the kernel may need a moment to let go of exiting processes."""
    deadline = time.monotonic() + _RMDIR_TIMEOUT_S
    for directory in self.dirs:
      while os.path.isdir(directory):
        try:
          os.rmdir(directory)
        except FileNotFoundError:
          break
        except OSError:
          if time.monotonic() > deadline:
            break
          for pid in self._pids():
            try:
              os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
              pass
          time.sleep(0.01)


if __name__ == "__main__":
  # launch/setup_sandbox.sh: set the hierarchy up now and say what the sandbox will get.
  found = hierarchy()
  if found is None:
    print(f"per-process limits only: {unavailable_reason()}")
  else:
    print(f"whole-sandbox limits through cgroup v{found.version} "
          f"({', '.join(sorted({found.memory_parent, found.pids_parent}))})")
