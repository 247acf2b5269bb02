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
* Wall-clock timeout and output cap enforced here: stdout/stderr are streamed through a
  selector (never `communicate()`, which buffers unbounded output) and the run is killed at
  `max_output_bytes`. A run is killed through PID 1 of its PID namespace: the kernel then
  kills every process in it, orphans that called setsid() included, and `run` returns only
  once they are all gone. When the program exits by itself, bwrap's PID 1 exits with it, with
  the same effect.

Overhead is a few milliseconds for bwrap, ~10 ms of Python start-up and, with cgroups, ~20 ms
of cgroup set-up per run. `run` is thread-safe; `code.py` calls it from a thread pool.
docs/security.md states the threat model and the test that proves each containment.

Without bwrap, `run` refuses unless `allow_weak=True`: then the program runs with the same
rlimits as the non-root user in a private host temp dir, with no namespaces, seccomp filter
or cgroup (it can use the network and read world-readable files). A warning says so.
"""

import concurrent.futures
import ctypes
import dataclasses
import functools
import json
import math
import os
import platform
import pwd
import selectors
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence

from rl.rewards import sandbox_cgroup
from rl.rewards import sandbox_seccomp

SANDBOX_USER = "seedrl-sandbox"
FALLBACK_USER = "nobody"
PYTHON = "/usr/bin/python3"
PRLIMIT = "/usr/bin/prlimit"
WORKDIR = "/tmp"
PROGRAM_NAME = "main.py"
STATUSES = ("ok", "timeout", "memory", "output_limit", "runtime_error", "killed")

_READ_CHUNK = 1 << 16
_KILL_GRACE_S = 5.0
# How often a running sandbox's cgroup is checked for OOM kills.
_OOM_POLL_S = 0.05
_KEYCTL_JOIN_SESSION_KEYRING = 1
# Markers of an allocation refused under RLIMIT_AS (Python, C++ and glibc wording).
_MEMORY_MARKERS = (b"MemoryError", b"std::bad_alloc", b"Cannot allocate memory", b"out of memory")
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


def _memfd(data: bytes) -> int:
  """An anonymous in-memory file holding `data`, rewound, for bwrap's --file."""
  fd = os.memfd_create("seedrl-sandbox-file")
  view = memoryview(data)
  while view:
    view = view[os.write(fd, view):]
  os.lseek(fd, 0, os.SEEK_SET)
  return fd


def _as_bytes(data: str | bytes) -> bytes:
  return data.encode() if isinstance(data, str) else data


class _Collector:
  """Streams a child's pipes through one selector: feeds stdin, caps stdout and stderr, and
  keeps whatever arrives on an extra fd (bwrap's JSON status)."""

  def __init__(self, proc: subprocess.Popen, stdin: bytes, extra_fd: int | None,
               max_output_bytes: int, extra: bytes = b""):
    self.proc = proc
    self.max_output_bytes = max_output_bytes
    self.stdin_fd = None if proc.stdin is None else proc.stdin.fileno()
    self.stdout_fd, self.stderr_fd = proc.stdout.fileno(), proc.stderr.fileno()
    self.chunks = {self.stdout_fd: [], self.stderr_fd: []}
    self.sizes = dict.fromkeys(self.chunks, 0)
    self.extra = bytearray(extra)
    self.extra_fd = extra_fd
    self.pending_stdin = memoryview(stdin)

  def collect(self, deadline: float, out_of_memory: Callable[[], bool] | None = None
              ) -> str | None:
    """Runs until every pipe closes (None) or a limit stops it ("timeout", "output_limit", or
    "memory" when `out_of_memory`, polled every _OOM_POLL_S, says so)."""
    next_poll = time.monotonic() + _OOM_POLL_S
    with selectors.DefaultSelector() as selector:
      for fd in self.chunks:
        selector.register(fd, selectors.EVENT_READ)
      if self.extra_fd is not None:
        selector.register(self.extra_fd, selectors.EVENT_READ)
      if self.stdin_fd is not None:
        os.set_blocking(self.stdin_fd, False)
        selector.register(self.stdin_fd, selectors.EVENT_WRITE)
      while selector.get_map():
        now = time.monotonic()
        if out_of_memory is not None and now >= next_poll:
          if out_of_memory():
            return "memory"
          next_poll = now + _OOM_POLL_S
        remaining = deadline - now
        if remaining <= 0:
          return "timeout"
        wait = remaining if out_of_memory is None else min(remaining, next_poll - now)
        for key, _ in selector.select(wait):
          if key.fd == self.stdin_fd:
            self._feed_stdin(selector)
          elif self._read(selector, key.fd):
            return "output_limit"
    return None

  def _feed_stdin(self, selector: selectors.BaseSelector) -> None:
    try:
      written = os.write(self.stdin_fd, self.pending_stdin[:_READ_CHUNK])
      self.pending_stdin = self.pending_stdin[written:]
    except BlockingIOError:
      return
    except BrokenPipeError:  # The program stopped reading: not an error of ours.
      self.pending_stdin = self.pending_stdin[:0]
    if not self.pending_stdin:
      selector.unregister(self.stdin_fd)
      self.proc.stdin.close()

  def _read(self, selector: selectors.BaseSelector, fd: int) -> bool:
    """Reads one chunk; True when an output stream went over the cap."""
    data = os.read(fd, _READ_CHUNK)
    if not data:
      selector.unregister(fd)
      return False
    if fd == self.extra_fd:
      self.extra += data
      return False
    room = self.max_output_bytes - self.sizes[fd]
    self.chunks[fd].append(data[:room])
    self.sizes[fd] += len(data)
    return self.sizes[fd] > self.max_output_bytes

  def stdout(self) -> bytes:
    return b"".join(self.chunks[self.stdout_fd])

  def stderr(self) -> bytes:
    return b"".join(self.chunks[self.stderr_fd])


def _kill_group(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


def _status_reports(data: bytes) -> list[dict]:
  """The complete JSON documents bwrap wrote to --json-status-fd (one per line)."""
  reports = []
  for line in data.split(b"\n")[:-1]:
    try:
      reports.append(json.loads(line))
    except ValueError:  # Not expected from bwrap; never worth failing a run over.
      continue
  return [r for r in reports if isinstance(r, dict)]


def _parent_pid(pid: int) -> int | None:
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      # The command name, in parentheses, may hold spaces: fields after its end are fixed.
      return int(f.read().rsplit(b")", 1)[1].split()[1])
  except (OSError, IndexError, ValueError):
    return None


def _kill_sandbox(proc: subprocess.Popen, reports: list[dict]) -> None:
  """Kills a running sandbox and returns once every process in it is gone.

  SIGKILL to the bwrap monitor alone would not do: its --die-with-parent signal to the
  sandbox's PID 1 arrives asynchronously, so the run could return with processes still
  alive. Killing PID 1 (the "child-pid" bwrap reported) makes the kernel kill and reap the
  whole PID namespace before PID 1 itself exits; the monitor, which waits for PID 1, exits
  only after that.
  """
  child_pids = [r["child-pid"] for r in reports if "child-pid" in r]
  if child_pids and proc.poll() is None:
    try:
      # A pidfd pins one process; the parent check proves that process is this sandbox's
      # PID 1, not an unrelated one that reused the pid after the monitor reaped PID 1.
      pidfd = os.pidfd_open(child_pids[0])
    except OSError:
      pidfd = None
    if pidfd is not None:
      try:
        if _parent_pid(child_pids[0]) == proc.pid:
          signal.pidfd_send_signal(pidfd, signal.SIGKILL)
      finally:
        os.close(pidfd)
      try:
        proc.wait(timeout=_KILL_GRACE_S)
        return
      except subprocess.TimeoutExpired:
        pass
  _kill_group(proc)
  proc.wait()


def _kill_marked(marker: bytes) -> None:
  """Kills every process whose initial environment holds `marker` (weak mode's orphans).

  Without a PID namespace, a program that calls setsid() leaves our process group; its
  environment, inherited from the run, still names the run.
  """
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/environ", "rb") as f:
        if marker in f.read().split(b"\0"):
          os.kill(int(entry), signal.SIGKILL)
    except (OSError, ProcessLookupError):
      continue


def _classify(returncode: int, stderr: bytes) -> tuple[str, int]:
  """(status, exit_code) from bwrap's (or the program's) return code."""
  if returncode < 0:  # Weak mode: Popen reports a signal as -N.
    signum = -returncode
  elif 128 < returncode <= 128 + 64:  # bwrap reports a signal as 128+N.
    signum = returncode - 128
  else:
    signum = 0
  tail = stderr[-4096:]
  if signum:
    if signum == signal.SIGXCPU:
      return "timeout", -signum
    if any(m in tail for m in _MEMORY_MARKERS):
      return "memory", -signum
    return "killed", -signum
  if returncode == 0:
    return "ok", 0
  if any(m in tail for m in _MEMORY_MARKERS):
    return "memory", returncode
  return "runtime_error", returncode


def _decode(data: bytes) -> str:
  return data.decode("utf-8", errors="replace")


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
  stdin_bytes = _as_bytes(stdin)
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


def _await_child_pid(status_fd: int, deadline: float) -> tuple[bytes, int | None]:
  """Reads bwrap's JSON status until it names the sandbox's PID 1; returns what was read and
  that pid (None if bwrap failed first, or at the deadline)."""
  data = b""
  with selectors.DefaultSelector() as selector:
    selector.register(status_fd, selectors.EVENT_READ)
    while (remaining := deadline - time.monotonic()) > 0:
      if not selector.select(remaining):
        continue
      chunk = os.read(status_fd, _READ_CHUNK)
      data += chunk
      pids = [r["child-pid"] for r in _status_reports(data) if "child-pid" in r]
      if pids or not chunk:
        return data, (pids[0] if pids else None)
  return data, None


def _run_bwrap(bwrap: str, files: dict[str, str | bytes], program_argv: list[str],
               limits: list[str], identity: _Identity, stdin_bytes: bytes, timeout_s: float,
               max_output_bytes: int, workdir_mb: int, shm_mb: int, seccomp: bytes,
               cgroup: sandbox_cgroup.RunCgroup | None) -> RunResult:
  file_fds = {name: _memfd(_as_bytes(content)) for name, content in files.items()}
  seccomp_fd = _memfd(seccomp)
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
    status_so_far, child_pid = _await_child_pid(status_read, start + timeout_s)
    if child_pid is not None:  # Else bwrap failed, or the time is up: it never runs the program.
      if cgroup is not None:
        cgroup.attach(child_pid)
      os.close(block_write)
      block_write = None
    collector = _Collector(proc, stdin_bytes, status_read, max_output_bytes, status_so_far)
    out_of_memory = None if cgroup is None else (lambda: cgroup.oom_kills() > 0)
    stopped_by = collector.collect(start + timeout_s, out_of_memory)
    if stopped_by is None:
      try:
        proc.wait(timeout=max(0.0, start + timeout_s - time.monotonic()))
      except subprocess.TimeoutExpired:
        stopped_by = "timeout"
  finally:
    if proc.returncode is None:
      _kill_sandbox(proc, _status_reports(collector.extra if collector else status_so_far))
    if block_write is not None:
      os.close(block_write)
    os.close(status_read)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
      if stream is not None:
        stream.close()
  wall_s = time.monotonic() - start
  stdout, stderr = collector.stdout(), collector.stderr()
  reports = _status_reports(collector.extra)
  if not any("child-pid" in r for r in reports):
    if stopped_by is not None:  # Killed during set-up (a tiny timeout): a plain timeout.
      return RunResult(stopped_by, None, "", "", wall_s)
    raise SandboxError(f"bwrap failed to start the sandbox (exit {proc.returncode}): "
                       f"{_decode(stderr).strip()}")
  if stopped_by is not None:
    return RunResult(stopped_by, None, _decode(stdout), _decode(stderr), wall_s)
  exit_codes = [r["exit-code"] for r in reports if "exit-code" in r]
  returncode = exit_codes[-1] if exit_codes else proc.returncode
  status, exit_code = _classify(returncode, stderr)
  if cgroup is not None and cgroup.oom_kills() > 0:
    status = "memory"
  return RunResult(status, exit_code, _decode(stdout), _decode(stderr), wall_s)


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
        f.write(_as_bytes(content))
    if identity.uid is not None:
      for root, dirs, names in os.walk(workdir):
        for entry in [root, *(os.path.join(root, n) for n in dirs + names)]:
          os.chown(entry, identity.uid, identity.gid)
    env = {**_SANDBOX_ENV, "HOME": workdir, "TMPDIR": workdir, "SEEDRL_SANDBOX_RUN": run_id}
    start = time.monotonic()
    proc = _popen([*limits, *program_argv], identity, stdin_bytes, env=env, cwd=workdir)
    try:
      collector = _Collector(proc, stdin_bytes, None, max_output_bytes)
      stopped_by = collector.collect(start + timeout_s)
      if stopped_by is None:
        try:
          proc.wait(timeout=max(0.0, start + timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
          stopped_by = "timeout"
    finally:
      _kill_group(proc)
      proc.wait()
      _kill_marked(f"SEEDRL_SANDBOX_RUN={run_id}".encode())
      for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
          stream.close()
    wall_s = time.monotonic() - start
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  stdout, stderr = collector.stdout(), collector.stderr()
  if stopped_by is not None:
    return RunResult(stopped_by, None, _decode(stdout), _decode(stderr), wall_s)
  status, exit_code = _classify(proc.returncode, stderr)
  return RunResult(status, exit_code, _decode(stdout), _decode(stderr), wall_s)
