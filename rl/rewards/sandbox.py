"""Runs untrusted Python programs (model-written code) in a bubblewrap sandbox.

One call, `run(code, ...)`, executes `code` as `/tmp/main.py` with `/usr/bin/python3` and returns
a `RunResult`. The isolation, in layers:

* bubblewrap (`bwrap`), started as a dedicated non-root user (`seedrl-sandbox`, created by
  `launch/setup_sandbox.sh`; `nobody` as a fallback). Running as non-root matters because the
  kernel ignores RLIMIT_NPROC for root, and a fork bomb would otherwise be unbounded. When the
  caller is not root it runs as the caller's own user, inside the same namespaces.
* New user, PID, network, IPC, UTS and cgroup namespaces: no network at all (not even the
  host's loopback), no view of host processes, and no nested user namespaces.
* A filesystem built from nothing: `/usr` bound read-only (with the `/bin`, `/lib` symlinks
  of a merged-/usr system), a fresh `/proc`, a read-only `/dev` holding only null, zero, full,
  random, urandom and tty, and two size-capped tmpfs, `/dev/shm` (shm_mb) and `/tmp`
  (workdir_mb), the working directory (the program and `files=` are copied in through memfds,
  so nothing touches the host disk). The root is remounted read-only: nothing else is
  writable. `/root`, `/work`, `/home` and `/etc` do not exist inside.
* A seccomp filter (rl/rewards/sandbox_seccomp.py) refusing keyrings, ptrace, bpf,
  perf_event_open, userfaultfd, io_uring and sockets other than AF_UNIX.
* An empty environment, a new session (no terminal to inject keystrokes into), a fresh empty
  session keyring (sandboxes are started from one thread that joined its own), and
  --die-with-parent.
* A cgroup per run (rl/rewards/sandbox_cgroup.py) bounding the sandbox as a whole: memory_mb
  for all its processes together, the files they write to tmpfs included, and max_processes
  tasks. A run in which the kernel OOM-kills a process ends at once, as "memory". Where
  cgroups cannot be used (no write access to the memory and pids controllers: a non-root
  caller, most containers), a one-time warning says so and only the rlimits below bound it:
  then memory is bounded per process, up to memory_mb x max_processes in all.
* rlimits (set by `prlimit` inside the namespaces, so the process count is per sandbox): CPU
  seconds, address space, file size, processes+threads, open files, no core dumps.
* Wall-clock timeout and output cap, enforced from outside (rl/rewards/sandbox_process.py):
  stdout/stderr are streamed through a selector (never `communicate()`, which buffers unbounded
  output) and the run is killed at `max_output_bytes`. A run is killed through PID 1 of its PID
  namespace: the kernel then kills every process in it, orphans that called setsid() included,
  and `run` returns only once they are all gone. When the program exits by itself, bwrap's
  PID 1 exits with it, with the same effect.

Overhead is a few milliseconds for bwrap, ~10 ms of Python start-up and, with cgroups, ~20 ms
of cgroup set-up per run. `run` is thread-safe; `code.py` calls it from a thread pool.
docs/security.md states the threat model and the test that proves each containment.

Without bwrap, `run` refuses unless `allow_weak=True`: then the program runs with the same
rlimits as the non-root user in a private host temp dir, with no namespaces, seccomp filter
or cgroup (it can use the network and read world-readable files). A warning says so. Its process
bound is the user's RLIMIT_NPROC, counted over all that user's processes: a fork bomb in one
run makes forks fail in every concurrent run as the same user (docs/security.md).
"""

import concurrent.futures
import ctypes
import dataclasses
import functools
import math
import os
import platform
import pwd
import shutil
import subprocess
import tempfile
import time
import uuid
import warnings
from collections.abc import Mapping, Sequence

from rl.rewards import sandbox_cgroup
from rl.rewards import sandbox_seccomp
from rl.rewards.sandbox_process import (Collector, as_bytes, await_child_pid, classify,
                                        close_pipes, decode, kill_group, kill_marked,
                                        kill_sandbox, memfd, status_reports)

SANDBOX_USER = "seedrl-sandbox"
FALLBACK_USER = "nobody"
PYTHON = "/usr/bin/python3"
PRLIMIT = "/usr/bin/prlimit"
WORKDIR = "/tmp"
PROGRAM_NAME = "main.py"
STATUSES = ("ok", "timeout", "memory", "output_limit", "runtime_error", "killed")

_KEYCTL_JOIN_SESSION_KEYRING = 1
# Environment of the sandboxed program: nothing of the caller's leaks in.
_SANDBOX_ENV = {"PATH": "/usr/bin:/bin", "HOME": WORKDIR, "TMPDIR": WORKDIR, "LANG": "C.UTF-8",
                "PYTHONIOENCODING": "utf-8"}


class SandboxUnavailableError(RuntimeError):
  """The machine cannot run the sandbox (no bwrap, no non-root user, no interpreter)."""


class SandboxError(RuntimeError):
  """The sandbox itself failed to start; the program never ran (not the program's fault)."""


@dataclasses.dataclass(frozen=True)
class RunResult:
  """Outcome of one sandboxed run.

  status: one of STATUSES. "memory" is an allocation refused under RLIMIT_AS or a process of
    the run killed by the kernel for going over the whole sandbox's memory limit.
  exit_code: the program's exit status; -N when it died of signal N (bwrap reports that as
    128+N, so a program that itself exits with 129..192 reads as a signal); None when the
    sandbox killed it (timeout, output_limit).
  stdout, stderr: decoded as UTF-8 (invalid bytes replaced), each cut at max_output_bytes.
  wall_s: wall-clock seconds from start to the end of the run, sandbox set-up included.
  """
  status: str
  exit_code: int | None
  stdout: str
  stderr: str
  wall_s: float

  @property
  def ok(self) -> bool:
    return self.status == "ok"


@dataclasses.dataclass(frozen=True)
class _Identity:
  """Who the sandboxed process runs as: uid/gid to switch to, or None to stay the caller."""
  uid: int | None
  gid: int | None
  name: str


def bwrap_path() -> str | None:
  """Absolute path of the bubblewrap binary, or None when it is not installed."""
  return shutil.which("bwrap") or next(
      (p for p in ("/usr/bin/bwrap", "/usr/local/bin/bwrap") if os.access(p, os.X_OK)), None)


@functools.cache
def sandbox_identity() -> _Identity:
  """The non-root identity programs run as (cached: users do not change while we run)."""
  if os.geteuid() != 0:
    return _Identity(uid=None, gid=None, name=pwd.getpwuid(os.geteuid()).pw_name)
  for name in (SANDBOX_USER, FALLBACK_USER):
    try:
      entry = pwd.getpwnam(name)
    except KeyError:
      continue
    if entry.pw_uid != 0:
      return _Identity(uid=entry.pw_uid, gid=entry.pw_gid, name=name)
  raise SandboxUnavailableError(
      f"running as root but neither user {SANDBOX_USER!r} nor {FALLBACK_USER!r} exists; the "
      "sandbox must not run programs as root (RLIMIT_NPROC does not apply to root). Run "
      "`bash launch/setup_sandbox.sh` as root.")


def sandbox_uid() -> int:
  """Uid that sandboxed programs run as (for tests that look for leftover processes)."""
  identity = sandbox_identity()
  return os.geteuid() if identity.uid is None else identity.uid


def whole_sandbox_limits() -> bool:
  """Whether memory_mb and max_processes bound each sandbox as a whole (through a cgroup)
  here, rather than each of its processes (rlimits only)."""
  return sandbox_cgroup.hierarchy() is not None


@functools.cache
def _warn_without_cgroups(reason: str) -> None:
  warnings.warn(
      f"sandbox: cgroups cannot be used here ({reason}), so memory_mb bounds each sandboxed "
      "process (RLIMIT_AS) and max_processes their number (RLIMIT_NPROC): one sandbox can "
      "use up to memory_mb x max_processes of memory. Run as root on a host with the memory "
      "and pids cgroup controllers (docs/security.md).", RuntimeWarning, stacklevel=3)


def _join_fresh_session_keyring() -> None:
  """Gives the calling thread a new, empty session keyring (keyrings belong to threads)."""
  keyctl = sandbox_seccomp.ARCHES.get(platform.machine(), {}).get("refused", {}).get("keyctl")
  if keyctl is not None:  # Elsewhere run() refuses anyway (no seccomp filter).
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall(ctypes.c_long(keyctl), _KEYCTL_JOIN_SESSION_KEYRING, None)


@functools.cache
def _spawner() -> concurrent.futures.ThreadPoolExecutor:
  """The one thread that starts every sandboxed process. It has its own empty session
  keyring, which the processes it forks inherit instead of their caller's."""
  return concurrent.futures.ThreadPoolExecutor(
      max_workers=1, thread_name_prefix="seedrl-sandbox-spawner",
      initializer=_join_fresh_session_keyring)


@functools.cache
def _seccomp_program() -> bytes:
  try:
    return sandbox_seccomp.filter_program()
  except sandbox_seccomp.UnsupportedArchError as error:
    raise SandboxUnavailableError(str(error)) from None


def _prlimit_argv(*, cpu_s: int, memory_mb: int, max_file_mb: int, max_processes: int,
                  max_open_files: int) -> list[str]:
  # The hard CPU limit is one second above the soft one: SIGXCPU first, then SIGKILL for a
  # program that ignores it.
  return [PRLIMIT, f"--cpu={cpu_s}:{cpu_s + 1}", f"--as={memory_mb << 20}",
          f"--fsize={max_file_mb << 20}", f"--nproc={max_processes}",
          f"--nofile={max_open_files}", "--core=0", "--"]


@functools.cache
def _system_binds() -> tuple[str, ...]:
  """bwrap arguments mapping the host's /usr read-only, plus the merged-/usr symlinks."""
  argv = ["--ro-bind", "/usr", "/usr"]
  for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
    host = f"/{name}"
    if os.path.islink(host):
      argv += ["--symlink", os.readlink(host), host]
    elif os.path.isdir(host):
      argv += ["--ro-bind", host, host]
  return tuple(argv)


def _check_files(files: Mapping[str, str | bytes]) -> None:
  for name in files:
    parts = name.split("/")
    if name.startswith("/") or any(p in ("", ".", "..") for p in parts):
      raise ValueError(f"files= keys must be relative paths without '..': {name!r}")
    if name == PROGRAM_NAME:
      raise ValueError(f"files= may not contain {PROGRAM_NAME!r}: that name holds the program")


def run(code: str, *, stdin: str | bytes = "", timeout_s: float = 5.0, memory_mb: int = 512,
        files: Mapping[str, str | bytes] | None = None, args: Sequence[str] = (),
        allow_weak: bool = False, max_output_bytes: int = 1 << 20, max_processes: int = 32,
        max_file_mb: int = 16, workdir_mb: int = 64, shm_mb: int = 16,
        max_open_files: int = 256, python: str = PYTHON) -> RunResult:
  """Runs Python source `code` in the sandbox and returns how it went.

  Args:
    code: the program, run as `python3 -B -s main.py *args` in the working directory /tmp.
    stdin: fed to the program's standard input (streamed, any size).
    timeout_s: wall-clock limit; the CPU rlimit is ceil(timeout_s) + 1 seconds.
    memory_mb: memory of the whole sandbox (its cgroup's limit: all processes, files in /tmp
      and /dev/shm, kernel memory), and the address-space limit (RLIMIT_AS) of each process.
      Without cgroups (see whole_sandbox_limits), only the latter.
    files: extra files written into the working directory first, {relative path: content}.
    args: command-line arguments for the program.
    allow_weak: without bwrap, run with rlimits only (no namespaces) instead of refusing.
    max_output_bytes: cap on each of stdout and stderr; beyond it the run is killed.
    max_processes: processes and threads in the sandbox, bwrap's init included (its
      cgroup's pids.max, and RLIMIT_NPROC).
    max_file_mb: largest file the program may write (RLIMIT_FSIZE).
    workdir_mb: size of the private tmpfs at /tmp (bounds the sum of all files written).
    shm_mb: size of the tmpfs at /dev/shm (POSIX shared memory, semaphores).
    max_open_files: RLIMIT_NOFILE.
    python: interpreter inside the sandbox; it must live under /usr (the only host tree
      mapped in).

  Raises:
    SandboxUnavailableError: no bwrap (and not allow_weak), no non-root user, no python, or
      an architecture the seccomp filter does not know.
    SandboxError: bwrap failed to set the sandbox up.
  """
  files = dict(files or {})
  _check_files(files)
  if not os.path.isabs(python) or not os.access(python, os.X_OK):
    raise SandboxUnavailableError(f"no interpreter at {python}: install python3 (apt-get).")
  if not os.access(PRLIMIT, os.X_OK):
    raise SandboxUnavailableError(f"{PRLIMIT} is missing: install util-linux.")
  identity = sandbox_identity()
  limits = _prlimit_argv(cpu_s=math.ceil(timeout_s) + 1, memory_mb=memory_mb,
                         max_file_mb=max_file_mb, max_processes=max_processes,
                         max_open_files=max_open_files)
  program_argv = [python, "-B", "-s", PROGRAM_NAME, *args]
  files[PROGRAM_NAME] = code
  stdin_bytes = as_bytes(stdin)
  bwrap = bwrap_path()
  if bwrap is None:
    if not allow_weak:
      raise SandboxUnavailableError(
          "bubblewrap (bwrap) is not installed, so untrusted code cannot be isolated. Run "
          "`bash launch/setup_sandbox.sh` as root, or pass allow_weak=True to accept "
          "rlimit-only isolation (no namespaces: network and world-readable files stay "
          "reachable).")
    warnings.warn("sandbox.run(allow_weak=True) without bubblewrap: rlimits and a non-root "
                  "user only; the program can reach the network and read world-readable "
                  "files.", RuntimeWarning, stacklevel=2)
    return _run_weak(files, program_argv, limits, identity, stdin_bytes, timeout_s,
                     max_output_bytes)
  seccomp = _seccomp_program()
  where = sandbox_cgroup.hierarchy()
  cgroup = None
  if where is None:
    _warn_without_cgroups(sandbox_cgroup.unavailable_reason())
  else:
    try:
      cgroup = sandbox_cgroup.RunCgroup(where, memory_bytes=memory_mb << 20,
                                        max_pids=max_processes)
    except OSError as error:
      raise SandboxError(f"cannot create the run's cgroup under {where.memory_parent}: "
                         f"{error}") from error
  try:
    return _run_bwrap(bwrap, files, program_argv, limits, identity, stdin_bytes, timeout_s,
                      max_output_bytes, workdir_mb, shm_mb, seccomp, cgroup)
  finally:
    if cgroup is not None:
      cgroup.close()


def _popen(argv: list[str], identity: _Identity, stdin_bytes: bytes, **kwargs):
  # user=/group=/extra_groups= switch identity in C between fork and exec, unlike a
  # preexec_fn, which is unsafe in a threaded caller (code.py runs us from a thread pool).
  # Started from the spawner thread, so that the child inherits its empty session keyring.
  switch = {} if identity.uid is None else dict(user=identity.uid, group=identity.gid,
                                                  extra_groups=[])
  return _spawner().submit(
      subprocess.Popen, argv, stdin=subprocess.PIPE if stdin_bytes else subprocess.DEVNULL,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, **switch,
      **kwargs).result()


def _run_bwrap(bwrap: str, files: dict[str, str | bytes], program_argv: list[str],
               limits: list[str], identity: _Identity, stdin_bytes: bytes, timeout_s: float,
               max_output_bytes: int, workdir_mb: int, shm_mb: int, seccomp: bytes,
               cgroup: sandbox_cgroup.RunCgroup | None) -> RunResult:
  file_fds = {name: memfd(as_bytes(content)) for name, content in files.items()}
  seccomp_fd = memfd(seccomp)
  status_read, status_write = os.pipe()
  # bwrap waits on block_read before it runs the program: time to move its PID 1 into the
  # run's cgroup, so that every process of the program is born there.
  block_read, block_write = os.pipe()
  argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
          "--new-session", "--hostname", "sandbox", *_system_binds(), "--proc", "/proc",
          "--dev", "/dev", "--remount-ro", "/dev", "--size", str(shm_mb << 20), "--tmpfs",
          "/dev/shm", "--size", str(workdir_mb << 20), "--tmpfs", WORKDIR]
  directories = sorted({os.path.dirname(n) for n in files} - {""})
  for directory in directories:
    argv += ["--dir", f"{WORKDIR}/{directory}"]
  for name, fd in file_fds.items():
    argv += ["--file", str(fd), f"{WORKDIR}/{name}"]
  argv += ["--remount-ro", "/", "--chdir", WORKDIR, "--clearenv"]
  for key, value in _SANDBOX_ENV.items():
    argv += ["--setenv", key, value]
  argv += ["--seccomp", str(seccomp_fd), "--block-fd", str(block_read),
           "--json-status-fd", str(status_write), "--", *limits, *program_argv]
  start = time.monotonic()
  try:
    proc = _popen(argv, identity, stdin_bytes, env={}, cwd="/",
                  pass_fds=[status_write, seccomp_fd, block_read, *file_fds.values()])
  except BaseException:
    os.close(block_write)
    os.close(status_read)
    raise
  finally:
    for fd in (status_write, seccomp_fd, block_read, *file_fds.values()):
      os.close(fd)
  collector, status_so_far = None, b""
  try:
    status_so_far, child_pid = await_child_pid(status_read, start + timeout_s)
    if child_pid is not None:  # Else bwrap failed, or the time is up: it never runs the program.
      if cgroup is not None:
        cgroup.attach(child_pid)
      os.close(block_write)
      block_write = None
    collector = Collector(proc, stdin_bytes, status_read, max_output_bytes, status_so_far)
    out_of_memory = None if cgroup is None else (lambda: cgroup.oom_kills() > 0)
    stopped_by = collector.collect(start + timeout_s, out_of_memory)
  finally:
    if proc.returncode is None:
      kill_sandbox(proc, status_reports(collector.extra if collector else status_so_far))
    if block_write is not None:
      os.close(block_write)
    os.close(status_read)
    close_pipes(proc)
  wall_s = time.monotonic() - start
  reports = status_reports(collector.extra)
  if not any("child-pid" in r for r in reports):
    if stopped_by is not None:  # Killed during set-up (a tiny timeout): a plain timeout.
      return RunResult(stopped_by, None, "", "", wall_s)
    raise SandboxError(f"bwrap failed to start the sandbox (exit {proc.returncode}): "
                       f"{decode(collector.stderr()).strip()}")
  exit_codes = [r["exit-code"] for r in reports if "exit-code" in r]
  returncode = exit_codes[-1] if exit_codes else proc.returncode
  return _result(collector, stopped_by, returncode, wall_s,
                 out_of_memory=cgroup is not None and cgroup.oom_kills() > 0)


def _run_weak(files: dict[str, str | bytes], program_argv: list[str], limits: list[str],
              identity: _Identity, stdin_bytes: bytes, timeout_s: float,
              max_output_bytes: int) -> RunResult:
  workdir = tempfile.mkdtemp(prefix="seedrl-sandbox-")
  run_id = uuid.uuid4().hex
  try:
    for name, content in files.items():
      path = os.path.join(workdir, name)
      os.makedirs(os.path.dirname(path), exist_ok=True)
      with open(path, "wb") as f:
        f.write(as_bytes(content))
    if identity.uid is not None:
      for root, dirs, names in os.walk(workdir):
        for entry in [root, *(os.path.join(root, n) for n in dirs + names)]:
          os.chown(entry, identity.uid, identity.gid)
    env = {**_SANDBOX_ENV, "HOME": workdir, "TMPDIR": workdir, "SEEDRL_SANDBOX_RUN": run_id}
    start = time.monotonic()
    proc = _popen([*limits, *program_argv], identity, stdin_bytes, env=env, cwd=workdir)
    try:
      collector = Collector(proc, stdin_bytes, None, max_output_bytes)
      stopped_by = collector.collect(start + timeout_s)
    finally:
      kill_group(proc)
      proc.wait()
      kill_marked(f"SEEDRL_SANDBOX_RUN={run_id}".encode())
      close_pipes(proc)
    wall_s = time.monotonic() - start
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  return _result(collector, stopped_by, proc.returncode, wall_s)


def _result(collector: Collector, stopped_by: str | None, returncode: int, wall_s: float, *,
            out_of_memory: bool = False) -> RunResult:
  """The RunResult of a run whose program started: the limit that stopped it, else how it
  exited ("memory" when `out_of_memory`: the kernel OOM-killed a process of the run)."""
  stdout, stderr = decode(collector.stdout()), decode(collector.stderr())
  if stopped_by is not None:
    return RunResult(stopped_by, None, stdout, stderr, wall_s)
  status, exit_code = classify(returncode, collector.stderr())
  return RunResult("memory" if out_of_memory else status, exit_code, stdout, stderr, wall_s)
