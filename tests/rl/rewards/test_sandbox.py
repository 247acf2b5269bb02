"""Tests of rl/rewards/sandbox.py: isolation (network, filesystem, users), limits (time,
memory, processes, output) and clean-up (no process of a run survives it).

Programs that must leave nothing behind carry a unique token in their argv (inherited by
every fork), so the checks look for that token in /proc and cannot be confused by sandboxes
that other tests or users run at the same time.
"""

import ctypes
import errno
import os
import pwd
import socket
import struct
import threading
import time
import uuid
import warnings

import pytest

from rl.rewards import sandbox
from rl.rewards import sandbox_cgroup
from rl.rewards import sandbox_seccomp

needs_bwrap = pytest.mark.skipif(
    sandbox.bwrap_path() is None,
    reason="bubblewrap (bwrap) is not installed; run `bash launch/setup_sandbox.sh` as root")

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))


def _pids_with(token: str) -> list[int]:
  """Pids of live processes whose command line contains `token`."""
  pids = []
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        if token.encode() in f.read():
          pids.append(int(entry))
    except OSError:
      continue
  return pids


def _assert_nothing_left(token: str, grace_s: float = 2.0) -> None:
  deadline = time.monotonic() + grace_s
  while _pids_with(token) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert _pids_with(token) == [], f"processes of run {token} survived it"


@needs_bwrap
def test_runs_program_with_stdin_args_and_files():
  """The program gets stdin, argv and files= in its working directory, and its output back."""
  code = ("import sys\n"
          "print(sys.stdin.read().upper(), sys.argv[1:], open('data/in.txt').read())\n"
          "print('to stderr', file=sys.stderr)\n")
  result = sandbox.run(code, stdin="hello", args=["a", "b"], files={"data/in.txt": "payload"})
  assert result.status == "ok" and result.exit_code == 0
  assert result.stdout == "HELLO ['a', 'b'] payload\n"
  assert result.stderr == "to stderr\n"
  assert 0 < result.wall_s < 5


@needs_bwrap
def test_large_stdin_is_streamed():
  """Stdin far larger than a pipe buffer reaches the program whole, without deadlock."""
  result = sandbox.run("import sys; print(len(sys.stdin.read()))", stdin="x" * 5_000_000)
  assert result.status == "ok" and result.stdout.strip() == "5000000"


@needs_bwrap
def test_runs_as_non_root_with_cleared_environment(monkeypatch):
  """The program is not root, sees none of the caller's environment, and no host processes."""
  monkeypatch.setenv("SEEDRL_SECRET_FOR_TEST", "leak")
  code = ("import os, json\n"
          "print(json.dumps([os.getuid(), os.getgid(), dict(os.environ),"
          " sorted(p for p in os.listdir('/proc') if p.isdigit())]))\n")
  result = sandbox.run(code)
  assert result.status == "ok", result.stderr
  uid, gid, env, pids = __import__("json").loads(result.stdout)
  assert uid != 0 and gid != 0
  assert "SEEDRL_SECRET_FOR_TEST" not in env and "leak" not in str(env)
  assert len(pids) <= 3, f"host processes visible: {pids}"


@needs_bwrap
def test_status_of_exit_codes_and_signals():
  """Exit 0 is ok, a nonzero exit or an exception is runtime_error, a signal is killed."""
  assert sandbox.run("import sys; sys.exit(3)").status == "runtime_error"
  result = sandbox.run("1/0")
  assert result.status == "runtime_error" and "ZeroDivisionError" in result.stderr
  result = sandbox.run("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)")
  assert result.status == "killed" and result.exit_code == -11


@needs_bwrap
def test_no_network():
  """Connecting to the host's loopback (with a live listener) and to an external IP fails."""
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen()
  server.settimeout(0.5)
  port = server.getsockname()[1]
  code = ("import socket, sys\n"
          "for host, port in [('127.0.0.1', int(sys.argv[1])), ('1.1.1.1', 53),"
          " ('8.8.8.8', 443)]:\n"
          "  try:\n"
          "    socket.create_connection((host, port), timeout=2).close()\n"
          "    print('CONNECTED', host)\n"
          "  except OSError as error:\n"
          "    print('failed', host, error)\n")
  try:
    result = sandbox.run(code, args=[str(port)])
    with pytest.raises(socket.timeout):
      server.accept()
  finally:
    server.close()
  assert result.status == "ok", result.stderr
  assert "CONNECTED" not in result.stdout
  assert result.stdout.count("failed") == 3


@needs_bwrap
def test_cannot_write_outside_its_tmp():
  """Writes to /work, the project dir, /root, / and /etc fail; /tmp is private and vanishes."""
  name = f"seedrl-sandbox-test-{uuid.uuid4().hex}"
  targets = [f"/work/{name}", f"{REPO_ROOT}/{name}", f"/root/{name}", f"/{name}",
             f"/etc/{name}", f"/usr/{name}"]
  code = ("import sys\n"
          "for path in sys.argv[1:]:\n"
          "  try:\n"
          "    open(path, 'w').write('x')\n"
          "    print('WROTE', path)\n"
          "  except OSError as error:\n"
          "    print('failed', path, type(error).__name__)\n"
          f"open('/tmp/{name}', 'w').write('private')\n"
          f"print(open('/tmp/{name}').read())\n")
  result = sandbox.run(code, args=targets)
  assert result.status == "ok", result.stderr
  assert "WROTE" not in result.stdout
  assert result.stdout.count("failed") == len(targets)
  assert result.stdout.strip().endswith("private")
  for path in [*targets, f"/tmp/{name}"]:
    assert not os.path.exists(path), f"{path} appeared on the host"


@needs_bwrap
def test_cannot_read_host_files():
  """/root, the project directory, /home, /etc/passwd and /etc/shadow are not readable."""
  targets = ["/root", REPO_ROOT, os.path.join(REPO_ROOT, "README.md"), "/home", "/etc/passwd",
             "/etc/shadow", "/work"]
  code = ("import os, sys\n"
          "for path in sys.argv[1:]:\n"
          "  try:\n"
          "    print('OPENED', path, os.listdir(path) if os.path.isdir(path) else"
          " open(path).read()[:20])\n"
          "  except OSError as error:\n"
          "    print('failed', path, type(error).__name__)\n")
  result = sandbox.run(code, args=targets)
  assert result.status == "ok", result.stderr
  assert "OPENED" not in result.stdout, result.stdout
  assert result.stdout.count("failed") == len(targets)


@needs_bwrap
def test_infinite_loop_times_out():
  """A busy loop ends as "timeout" close to timeout_s."""
  result = sandbox.run("while True: pass", timeout_s=1.0)
  assert result.status == "timeout" and result.exit_code is None
  assert 1.0 <= result.wall_s < 3.0


@needs_bwrap
def test_memory_bomb():
  """Allocating past memory_mb, at once or little by little, ends as "memory"."""
  assert sandbox.run("x = bytearray(4 << 30)", memory_mb=256).status == "memory"
  result = sandbox.run("x = []\nwhile True: x.append(bytearray(1 << 20))", memory_mb=256)
  assert result.status == "memory", result


@needs_bwrap
def test_output_flood_is_cut_quickly():
  """200 MB written to stdout ends as "output_limit" within a second, output capped at 1 MB."""
  code = ("import sys\nblock = 'x' * (1 << 20)\n"
          "for _ in range(200):\n  sys.stdout.write(block)\n")
  start = time.monotonic()
  result = sandbox.run(code, timeout_s=30.0)
  assert result.status == "output_limit"
  assert time.monotonic() - start < 2.0
  assert len(result.stdout) <= 1 << 20
  result = sandbox.run("import sys\nwhile True: sys.stderr.write('y' * 4096)", timeout_s=30.0)
  assert result.status == "output_limit" and len(result.stderr) <= 1 << 20


@needs_bwrap
def test_fork_bomb_is_limited_and_cleaned_up():
  """A fork bomb hits RLIMIT_NPROC (killed/runtime_error), and none of its forks survive."""
  token = f"forkbomb-{uuid.uuid4().hex}"
  code = "import os\nwhile True:\n  os.fork()\n"
  start = time.monotonic()
  result = sandbox.run(code, args=[token], timeout_s=5.0)
  assert result.status in ("killed", "runtime_error"), result
  assert "Resource temporarily unavailable" in result.stderr or result.status == "killed"
  assert time.monotonic() - start < 5.0
  _assert_nothing_left(token)


@needs_bwrap
def test_setsid_orphans_are_killed():
  """A child that calls setsid() and outlives the program is killed, after exit or timeout."""
  code = ("import os, sys, time\n"
          "if os.fork() == 0:\n"
          "  os.setsid()\n"
          "  if os.fork() == 0:\n"
          "    time.sleep(60)\n"
          "  os._exit(0)\n"
          "time.sleep(0.3)\n"
          "if sys.argv[2] == 'hang':\n"
          "  time.sleep(60)\n")
  for mode in ("exit", "hang"):
    token = f"orphan-{uuid.uuid4().hex}"
    result = sandbox.run(code, args=[token, mode], timeout_s=2.0)
    assert result.status == ("ok" if mode == "exit" else "timeout"), result
    assert result.wall_s < 4.0
    _assert_nothing_left(token)


@needs_bwrap
def test_no_process_of_the_sandbox_user_left_after_runs():
  """After a timed-out run, no process of the sandbox user holding its token remains."""
  token = f"leftover-{uuid.uuid4().hex}"
  code = "import os, time\nfor _ in range(5):\n  os.fork() or time.sleep(60)\ntime.sleep(60)\n"
  assert sandbox.run(code, args=[token], timeout_s=1.0).status == "timeout"
  uid = sandbox.sandbox_uid()
  survivors = [pid for pid in _pids_with(token) if os.stat(f"/proc/{pid}").st_uid == uid]
  assert survivors == []
  _assert_nothing_left(token)


@needs_bwrap
def test_concurrent_runs_are_independent():
  """Runs from several threads each get their own stdin, stdout and working directory."""
  results = {}

  def worker(i):
    results[i] = sandbox.run(
        "import sys, os\nopen('mine', 'w').write(sys.stdin.read())\nprint(open('mine').read(),"
        " len(os.listdir('.')))", stdin=str(i))

  threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert {i: r.stdout for i, r in results.items()} == {i: f"{i} 2\n" for i in range(8)}


def test_refuses_without_bwrap_unless_weak(monkeypatch):
  """Without bwrap, run raises; allow_weak=True runs with a warning, as non-root, and still
  enforces the timeout and kills setsid orphans.

  Weak mode's process bound is the user's RLIMIT_NPROC, which counts every process of that
  user, those in other sandboxes' namespaces included (docs/security.md). So, run as root with
  the sandbox user set up, the weak runs here run as `nobody`, whom no other test runs programs
  as: a fork bomb in a concurrent test (another xdist worker) must not make this test's one
  fork fail.
  """
  monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
  if os.geteuid() == 0 and sandbox.sandbox_identity().name == sandbox.SANDBOX_USER:
    nobody = pwd.getpwnam(sandbox.FALLBACK_USER)
    monkeypatch.setattr(sandbox, "sandbox_identity", lambda: sandbox._Identity(
        uid=nobody.pw_uid, gid=nobody.pw_gid, name=sandbox.FALLBACK_USER))
  with pytest.raises(sandbox.SandboxUnavailableError, match="bubblewrap"):
    sandbox.run("print(1)")
  with pytest.warns(RuntimeWarning, match="without bubblewrap"):
    result = sandbox.run("import os; print(os.getuid())", allow_weak=True)
  assert result.status == "ok" and int(result.stdout) != 0
  token = f"weak-{uuid.uuid4().hex}"
  code = ("import os, time\n"
          "if os.fork() == 0:\n  os.setsid()\n  time.sleep(60)\n"
          "time.sleep(60)\n")
  with pytest.warns(RuntimeWarning):
    result = sandbox.run(code, args=[token], timeout_s=1.0, allow_weak=True)
  assert result.status == "timeout"
  _assert_nothing_left(token)


def test_rejects_unsafe_file_names():
  """files= keys that are absolute or climb with '..' are refused before anything runs."""
  for name in ("/etc/x", "../x", "a/../../x", "main.py"):
    with pytest.raises(ValueError):
      sandbox.run("pass", files={name: "x"}, allow_weak=True)


@needs_bwrap
def test_ordinary_programs_still_work():
  """The read-only /dev, the seccomp filter and the cgroup leave what programs under test use:
  a multiprocessing pool (semaphores in /dev/shm, AF_UNIX sockets), subprocesses, /dev/null,
  /dev/urandom."""
  code = ("import multiprocessing, os, subprocess\n"
          "def square(x):\n  return x * x\n"
          "if __name__ == '__main__':\n"
          "  with multiprocessing.Pool(2) as pool:\n    print(sum(pool.map(square, range(10))))\n"
          "  print(subprocess.run(['echo', 'child'], capture_output=True, text=True).stdout,"
          " end='')\n"
          "  open('/dev/null', 'w').write('x')\n"
          "  print(len(open('/dev/urandom', 'rb').read(8)))\n"
          "  print([l for l in open('/proc/self/status') if l.startswith('Seccomp:')][0],"
          " end='')\n")
  result = sandbox.run(code, timeout_s=20.0)
  assert result.status == "ok", result
  assert result.stdout.split("\n")[:3] == ["285", "child", "8"]
  assert result.stdout.split("\n")[3].split() == ["Seccomp:", "2"]  # A filter is installed.


def _evaluate_seccomp(program: bytes, nr: int, arch: int, arg0: int = 0) -> int:
  """Runs a classic BPF seccomp program on one syscall, as the kernel would (the opcodes a
  seccomp filter of ours uses only)."""
  data = struct.pack("=iIQ6Q", nr, arch, 0, arg0, 0, 0, 0, 0, 0)
  instructions = [struct.unpack_from("=HBBI", program, i) for i in range(0, len(program), 8)]
  pc, accumulator = 0, 0
  while True:
    code, jump_true, jump_false, k = instructions[pc]
    if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
      accumulator, pc = struct.unpack_from("=I", data, k)[0], pc + 1
    elif code in (0x15, 0x35):  # BPF_JMP | BPF_JEQ / BPF_JGE, BPF_K
      taken = accumulator == k if code == 0x15 else accumulator >= k
      pc += 1 + (jump_true if taken else jump_false)
    elif code == 0x06:  # BPF_RET | BPF_K
      return k
    else:
      raise AssertionError(f"unexpected opcode {code:#x}")


_ALLOW, _KILL = 0x7FFF0000, 0x80000000
_EPERM, _EAFNOSUPPORT = 0x50000 | errno.EPERM, 0x50000 | errno.EAFNOSUPPORT


@pytest.mark.parametrize("machine, audit_arch, keyctl, read, socket_nr, foreign_arch", [
    ("x86_64", 0xC000003E, 250, 0, 41, 0x40000003),  # i386 through int 0x80
    ("aarch64", 0xC00000B7, 219, 63, 198, 0x40000028),  # 32-bit ARM
])
def test_seccomp_filter_decisions(machine, audit_arch, keyctl, read, socket_nr, foreign_arch):
  """The filter of each supported machine, run through a BPF interpreter: every refused
  syscall gets EPERM, socket() is allowed for AF_UNIX only, other syscalls pass, and a
  foreign ABI (or an x32 syscall number) kills."""
  program = sandbox_seccomp.filter_program(machine)
  table = sandbox_seccomp.ARCHES[machine]
  assert set(table["refused"]) == {
      "keyctl", "add_key", "request_key", "ptrace", "process_vm_readv", "process_vm_writev",
      "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
      "io_uring_register"}
  for nr in [keyctl, 425, *table["refused"].values()]:
    assert _evaluate_seccomp(program, nr, audit_arch) == _EPERM, nr
  assert _evaluate_seccomp(program, read, audit_arch) == _ALLOW
  for nr in table["socket"]:
    assert socket_nr in table["socket"]
    assert _evaluate_seccomp(program, nr, audit_arch, arg0=socket.AF_UNIX) == _ALLOW
    for family in (socket.AF_INET, socket.AF_INET6, 40, 16, 17):  # VSOCK, NETLINK, PACKET
      assert _evaluate_seccomp(program, nr, audit_arch, arg0=family) == _EAFNOSUPPORT
  assert _evaluate_seccomp(program, read, foreign_arch) == _KILL
  if machine == "x86_64":
    assert _evaluate_seccomp(program, 0x40000000 | keyctl, audit_arch) == _KILL


def test_unknown_architecture_is_refused(monkeypatch):
  """On a machine the filter has no syscall table for, run refuses with a clear error."""
  with pytest.raises(sandbox_seccomp.UnsupportedArchError, match="riscv64"):
    sandbox_seccomp.filter_program("riscv64")
  monkeypatch.setattr(sandbox_seccomp.platform, "machine", lambda: "riscv64")
  sandbox._seccomp_program.cache_clear()
  monkeypatch.setattr(sandbox, "bwrap_path", lambda: "/usr/bin/bwrap")
  try:
    with pytest.raises(sandbox.SandboxUnavailableError, match="riscv64"):
      sandbox.run("print(1)")
  finally:
    sandbox._seccomp_program.cache_clear()


def test_sandboxes_are_started_with_a_fresh_session_keyring():
  """The thread that starts sandboxes has its own session keyring, not the caller's."""
  if sandbox_seccomp.platform.machine() not in sandbox_seccomp.ARCHES:
    pytest.skip("no syscall table for this machine")
  keyctl = sandbox_seccomp.arch_table()["refused"]["keyctl"]
  libc = ctypes.CDLL(None, use_errno=True)
  libc.syscall.restype = ctypes.c_long

  def session_keyring() -> int:  # KEYCTL_GET_KEYRING_ID of KEY_SPEC_SESSION_KEYRING
    return libc.syscall(ctypes.c_long(keyctl), 0, -3, 1)

  ours = session_keyring()
  if ours < 0:
    pytest.skip("keyctl is refused to this test process (a container's seccomp profile?)")
  assert sandbox._spawner().submit(session_keyring).result() not in (ours, -1)


@needs_bwrap
@pytest.mark.skipif(not sandbox.whole_sandbox_limits(), reason="cgroups not writable here")
def test_run_cgroups_are_created_and_removed(monkeypatch):
  """Each run gets a cgroup of its own with the run's limits, removed when the run ends,
  timed out or OOM-killed."""
  made = []

  class Recording(sandbox_cgroup.RunCgroup):

    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      made.append(self)

  monkeypatch.setattr(sandbox_cgroup, "RunCgroup", Recording)
  code = ("import os, sys, time\n"
          "if sys.argv[1] == 'hang':\n  while True: pass\n"
          "if sys.argv[1] == 'oom':\n"
          "  for _ in range(4):\n"
          "    if os.fork() == 0:\n      x = b'x' * (100 << 20)\n      time.sleep(10)\n"
          "      os._exit(0)\n"
          "  time.sleep(10)\n")
  assert sandbox.run(code, args=["exit"]).status == "ok"
  assert sandbox.run(code, args=["hang"], timeout_s=1.0).status == "timeout"
  result = sandbox.run(code, args=["oom"], memory_mb=200, timeout_s=20.0)
  assert result.status == "memory" and result.wall_s < 10.0, result
  assert len(made) == 3
  for cgroup in made:
    for directory in cgroup.dirs:
      assert not os.path.exists(directory), directory


@needs_bwrap
def test_without_cgroups_warns_once_and_bounds_each_process(monkeypatch):
  """Where cgroups cannot be used, runs still work, bounded per process (RLIMIT_AS), and a
  warning naming the reason comes once."""
  monkeypatch.setattr(sandbox_cgroup, "hierarchy", lambda: None)
  monkeypatch.setattr(sandbox_cgroup, "unavailable_reason", lambda: "test: no cgroups")
  sandbox._warn_without_cgroups.cache_clear()
  try:
    with pytest.warns(RuntimeWarning, match="test: no cgroups.*memory_mb x max_processes"):
      assert sandbox.run("print(1)").stdout == "1\n"
    with warnings.catch_warnings():
      warnings.simplefilter("error")
      assert sandbox.run("x = bytearray(1 << 30)", memory_mb=256).status == "memory"
  finally:
    sandbox._warn_without_cgroups.cache_clear()


@pytest.mark.parametrize("version", [1, 2])
def test_cgroup_limits_written_on_v1_and_v2_trees(tmp_path, monkeypatch, version):
  """On a (fake) cgroup v2 tree the parent gets the memory and pids controllers and a run
  memory.max, memory.swap.max=0, memory.oom.group=1 and pids.max; on a v1 pair of trees,
  memory.limit_in_bytes, memory.memsw.limit_in_bytes and pids.max. OOM kills are read from
  memory.events (v2) or memory.oom_control (v1)."""
  if version == 2:
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    (tmp_path / "cgroup.subtree_control").write_text("")
    mounts = [(str(tmp_path), "cgroup2", {"rw"})]
  else:
    for controller in ("memory", "pids"):
      (tmp_path / controller).mkdir()
    mounts = [(str(tmp_path / c), "cgroup", {"rw", c}) for c in ("memory", "pids")]
  monkeypatch.setattr(sandbox_cgroup, "_mounts", lambda: mounts)
  real_mkdir = os.mkdir

  def mkdir_as_cgroupfs(path, *args, **kwargs):  # The kernel creates the interface files.
    real_mkdir(path, *args, **kwargs)
    if version == 2:
      names = ["cgroup.subtree_control", "memory.swap.max"]
    else:
      names = ["memory.memsw.limit_in_bytes"] if "/memory/" in str(path) else []
    for name in names:
      open(os.path.join(path, name), "w").close()

  monkeypatch.setattr(os, "mkdir", mkdir_as_cgroupfs)
  where = sandbox_cgroup._find_hierarchy()
  assert isinstance(where, sandbox_cgroup.Hierarchy) and where.version == version, where
  assert sandbox_cgroup._find_hierarchy() == where  # Idempotent.
  if version == 2:
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+memory +pids"
    assert (tmp_path / "seedrl-sandbox/cgroup.subtree_control").read_text() == "+memory +pids"
  else:
    assert where.memory_parent == str(tmp_path / "memory/seedrl-sandbox")
    assert where.pids_parent == str(tmp_path / "pids/seedrl-sandbox")
  cgroup = sandbox_cgroup.RunCgroup(where, memory_bytes=512 << 20, max_pids=32)

  def read(directory, name):
    with open(os.path.join(directory, name)) as f:
      return f.read()

  if version == 2:
    assert [read(cgroup.memory_dir, n) for n in ("memory.max", "memory.swap.max",
                                                  "memory.oom.group")] == [
                                                      str(512 << 20), "0", "1"]
    events = "low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\noom_group_kill 1\n"
    (tmp_path / cgroup.memory_dir / "memory.events").write_text(events)
  else:
    assert read(cgroup.memory_dir, "memory.limit_in_bytes") == str(512 << 20)
    assert read(cgroup.memory_dir, "memory.memsw.limit_in_bytes") == str(512 << 20)
    (tmp_path / cgroup.memory_dir / "memory.oom_control").write_text(
        "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
  assert read(cgroup.pids_dir, "pids.max") == "32"
  assert cgroup.oom_kills() == 2


def test_no_cgroup_filesystem_is_a_reason(monkeypatch):
  """Without a usable cgroup mount, the hierarchy is a reason string, not an error."""
  monkeypatch.setattr(sandbox_cgroup, "_mounts", lambda: [])
  assert "no cgroup filesystem" in sandbox_cgroup._find_hierarchy()


def test_parents_made_by_root_do_not_fool_a_non_root_caller(tmp_path, monkeypatch):
  """When the parent cgroups exist (made by setup_sandbox.sh as root) but a run cgroup cannot
  be created under them (a non-root caller), cgroups count as unavailable, with the reason."""
  where = sandbox_cgroup.Hierarchy(2, str(tmp_path), str(tmp_path))
  monkeypatch.setattr(sandbox_cgroup, "_find_hierarchy", lambda: where)

  def refuse(path, *args, **kwargs):
    raise PermissionError(13, "Permission denied", path)

  monkeypatch.setattr(os, "mkdir", refuse)
  sandbox_cgroup._cached.cache_clear()
  try:
    assert sandbox_cgroup.hierarchy() is None
    assert "Permission denied" in sandbox_cgroup.unavailable_reason()
  finally:
    sandbox_cgroup._cached.cache_clear()
