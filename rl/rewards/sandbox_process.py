"""The processes of a sandbox run (sandbox.py): streaming their pipes under the output cap and the
deadline, killing a whole run, and reading how it ended.

* `Collector` feeds a child's stdin, reads stdout and stderr through one selector (never
  `communicate()`, which buffers unbounded output), stops at `max_output_bytes` or the deadline,
  and keeps bwrap's JSON status, which arrives on an extra fd.
* `kill_sandbox` kills a bwrap run through PID 1 of its PID namespace, so the kernel kills every
  process in it (orphans that called setsid() included) before it returns; `kill_marked` finds a
  weak run's orphans by the marker in their environment.
* `classify` turns a return code and stderr into a `sandbox.STATUSES` entry and an exit code.

Nothing here decides what a run may do; sandbox.py builds the confinement and calls these.
"""

import json
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable

_READ_CHUNK = 1 << 16
_KILL_GRACE_S = 5.0
# How often a running sandbox's cgroup is checked for OOM kills.
_OOM_POLL_S = 0.05
# Markers of an allocation refused under RLIMIT_AS (Python, C++ and glibc wording).
_MEMORY_MARKERS = (b"MemoryError", b"std::bad_alloc", b"Cannot allocate memory", b"out of memory")


def memfd(data: bytes) -> int:
  """An anonymous in-memory file holding `data`, rewound, for bwrap's --file."""
  fd = os.memfd_create("seedrl-sandbox-file")
  view = memoryview(data)
  while view:
    view = view[os.write(fd, view):]
  os.lseek(fd, 0, os.SEEK_SET)
  return fd


def as_bytes(data: str | bytes) -> bytes:
  return data.encode() if isinstance(data, str) else data


class Collector:
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
    """Runs until every pipe closes and the child exits (None) or a limit stops it ("timeout",
    "output_limit", or "memory" when `out_of_memory`, polled every _OOM_POLL_S, says so)."""
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
    try:
      self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      return "timeout"
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


def close_pipes(proc: subprocess.Popen) -> None:
  for stream in (proc.stdin, proc.stdout, proc.stderr):
    if stream is not None:
      stream.close()


def kill_group(proc: subprocess.Popen) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass


def status_reports(data: bytes) -> list[dict]:
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


def kill_sandbox(proc: subprocess.Popen, reports: list[dict]) -> None:
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
  kill_group(proc)
  proc.wait()


def kill_marked(marker: bytes) -> None:
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


def classify(returncode: int, stderr: bytes) -> tuple[str, int]:
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


def decode(data: bytes) -> str:
  return data.decode("utf-8", errors="replace")


def await_child_pid(status_fd: int, deadline: float) -> tuple[bytes, int | None]:
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
      pids = [r["child-pid"] for r in status_reports(data) if "child-pid" in r]
      if pids or not chunk:
        return data, (pids[0] if pids else None)
  return data, None

