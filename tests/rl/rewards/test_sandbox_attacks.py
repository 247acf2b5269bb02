"""Attacks on rl/rewards/sandbox.py: programs written to beat the sandbox, each of which must
be contained. docs/security.md maps every containment to the test here that proves it.

Every attack is bounded by construction (at most ~1.6 GB for a moment, a few seconds), so that
even against a sandbox that fails to contain it, the host (24 GB, 2 shared cores) is not hurt.
Syscalls are made through ctypes so that the attack does not depend on what Python wraps.
"""

import ctypes
import os
import platform
import threading
import uuid

import pytest

from rl.rewards import sandbox
from test_sandbox import _assert_nothing_left  # noqa: E402  (tests/ is on sys.path)

needs_bwrap = pytest.mark.skipif(
    sandbox.bwrap_path() is None,
    reason="bubblewrap (bwrap) is not installed; run `bash launch/setup_sandbox.sh` as root")

# Syscall numbers of the attacks, per machine (asm/unistd_64.h and asm-generic/unistd.h).
_SYSCALLS = {
    "x86_64": dict(socket=41, ptrace=101, add_key=248, keyctl=250, perf_event_open=298,
                   bpf=321, userfaultfd=323, io_uring_setup=425),
    "aarch64": dict(socket=198, ptrace=117, add_key=217, keyctl=219, perf_event_open=241,
                    bpf=280, userfaultfd=282, io_uring_setup=425),
}
NR = _SYSCALLS.get(platform.machine())
needs_known_arch = pytest.mark.skipif(NR is None, reason=f"no syscall table for "
                                      f"{platform.machine()}")

# Prologue of the attack programs: a raw syscall that prints OK <result> or DENIED <errno>.
_PROLOGUE = """\
import ctypes, errno, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def attempt(label, nr, *args):
  ctypes.set_errno(0)
  result = libc.syscall(ctypes.c_long(nr), *args)
  if result < 0:
    print(label, 'DENIED', errno.errorcode.get(ctypes.get_errno(), ctypes.get_errno()))
  else:
    print(label, 'OK', result)
  return result
"""


def _run_attack(body: str, **kwargs) -> sandbox.RunResult:
  return sandbox.run(_PROLOGUE + body, **kwargs)




# ----------------------------------------------------------------------------------------
# Memory and processes: bounded for the sandbox as a whole.
# ----------------------------------------------------------------------------------------

_FORK_AND_HOLD = """\
import os, sys
children, held_r, held_w = int(sys.argv[2]), *os.pipe()
release_r, release_w = os.pipe()
for _ in range(children):
  if os.fork() == 0:
    os.close(held_r)
    os.close(release_w)
    block = b'x' * (int(sys.argv[3]) << 20)  # Written, so resident, not just reserved.
    os.write(held_w, b'1')
    os.read(release_r, 1)  # Hold the memory until the parent has counted.
    os._exit(0)
os.close(held_w)
held = 0
while chunk := os.read(held_r, 64):
  held += len(chunk)
  if held == children:
    break
print('HELD', held, flush=True)
os.close(release_w)
while True:
  try:
    os.wait()
  except ChildProcessError:
    break
"""


@needs_bwrap
@pytest.mark.skipif(not sandbox.whole_sandbox_limits(),
                    reason="cgroups are not writable here: memory is bounded per process only "
                    "(docs/security.md)")
def test_children_cannot_sum_past_memory_mb():
  """4 children each holding 400 MB under memory_mb=512: the run ends as "memory" before all
  four hold their memory, and none of its processes survive."""
  token = f"memhold-{uuid.uuid4().hex}"
  result = sandbox.run(_FORK_AND_HOLD, args=[token, "4", "400"], memory_mb=512,
                       timeout_s=30.0)
  assert result.status == "memory", result
  assert "HELD 4" not in result.stdout
  _assert_nothing_left(token, grace_s=5.0)


@needs_bwrap
def test_memory_within_the_limit_still_works():
  """The whole-sandbox bound leaves room for what memory_mb promises: 2 x 100 MB under 512."""
  result = sandbox.run(_FORK_AND_HOLD, args=["ok", "2", "100"], memory_mb=512, timeout_s=30.0)
  assert result.status == "ok", result
  assert "HELD 2" in result.stdout


_COUNT_FORKS = """\
import os, sys, time
alive, (count_r, count_w) = 0, os.pipe()
for _ in range(1000):
  try:
    pid = os.fork()
  except OSError as error:
    print('FORK FAILED', errno.errorcode[error.errno], flush=True)
    break
  if pid == 0:
    time.sleep(60)
    os._exit(0)
  alive += 1
print('ALIVE', alive, flush=True)
"""


@needs_bwrap
def test_fork_bomb_is_bounded_and_cleaned_up():
  """An exponential fork bomb ends within the timeout with none of its forks left behind, and
  a linear one never has more than max_processes processes alive at once."""
  token = f"forkbomb-{uuid.uuid4().hex}"
  result = sandbox.run("import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n"
                       "    pass\n", args=[token], timeout_s=2.0)
  assert result.status in ("timeout", "killed", "runtime_error", "memory"), result
  _assert_nothing_left(token, grace_s=5.0)
  token = f"forkcount-{uuid.uuid4().hex}"
  result = _run_attack(_COUNT_FORKS, args=[token], max_processes=16, timeout_s=10.0)
  assert "FORK FAILED" in result.stdout, result
  alive = int(result.stdout.split("ALIVE")[1].split()[0])
  assert alive < 16, result.stdout
  _assert_nothing_left(token, grace_s=5.0)


# ----------------------------------------------------------------------------------------
# Writable filesystems: each capped, so that filling it fails inside the sandbox.
# ----------------------------------------------------------------------------------------

_FILL = """\
import errno, os, sys
directory, written, block = sys.argv[1], 0, b'x' * (4 << 20)
try:
  for i in range(256):  # 1 GB in 4 MB files (each under RLIMIT_FSIZE).
    with open(f'{directory}/fill-{i}', 'wb') as f:
      f.write(block)
    written += len(block)
  print('WROTE', written >> 20, 'MB')
except OSError as error:
  print('STOPPED', written >> 20, 'MB', errno.errorcode.get(error.errno, error.errno))
"""


@needs_bwrap
@pytest.mark.parametrize("directory", ["/dev/shm", "/tmp", "/dev"])
def test_writable_filesystems_are_capped(directory):
  """Writing 1 GB to /dev/shm, /tmp or /dev stops inside the sandbox at its cap (or at once,
  for a read-only /dev), with an error the program sees."""
  result = sandbox.run(_FILL, args=[directory], timeout_s=20.0)
  assert result.status in ("ok", "memory"), result
  assert "STOPPED" in result.stdout or result.status == "memory", result.stdout
  if "STOPPED" in result.stdout:
    written_mb = int(result.stdout.split()[1])
    assert written_mb <= 64, result.stdout


# ----------------------------------------------------------------------------------------
# Kernel attack surface: keyrings, ptrace, bpf, perf, userfaultfd, io_uring, sockets.
# ----------------------------------------------------------------------------------------

_KEYCTL_GET_KEYRING_ID, _KEYCTL_JOIN_SESSION_KEYRING, _KEYCTL_DESCRIBE, _KEYCTL_READ = 0, 1, 6, 11
_KEY_SPEC_SESSION_KEYRING = -3


def _in_thread_with_secret_key(secret: bytes, fn):
  """Runs fn() in a thread whose (fresh, anonymous) session keyring holds a "user" key
  described `secret`: the caller's keyring a sandboxed program must not reach."""
  libc = ctypes.CDLL(None, use_errno=True)
  libc.syscall.restype = ctypes.c_long
  outcome = {}

  def body():
    try:
      if libc.syscall(ctypes.c_long(NR["keyctl"]), _KEYCTL_JOIN_SESSION_KEYRING, None) < 0:
        pytest.skip("keyctl is refused to this test process (a container's seccomp profile?): "
                    "it has no keyring to protect")
      key = libc.syscall(ctypes.c_long(NR["add_key"]), b"user", secret, b"payload-" + secret,
                         ctypes.c_size_t(8 + len(secret)), _KEY_SPEC_SESSION_KEYRING)
      assert key >= 0, os.strerror(ctypes.get_errno())
      outcome["result"] = fn()
    except BaseException as error:  # Re-raised in the test's thread.
      outcome["error"] = error

  thread = threading.Thread(target=body)
  thread.start()
  thread.join()
  if "error" in outcome:
    raise outcome["error"]
  return outcome["result"]


@needs_bwrap
@needs_known_arch
def test_callers_session_keyring_is_unreachable():
  """keyctl on the session keyring (list, describe, read) and add_key into it fail: the
  caller's secret key is neither readable nor replaceable from inside."""
  secret = f"seedrl-secret-{uuid.uuid4().hex}".encode()
  code = f"""\
buf = ctypes.create_string_buffer(4096)
n = attempt('list', {NR['keyctl']}, {_KEYCTL_READ}, {_KEY_SPEC_SESSION_KEYRING}, buf, 4096)
for key in (ctypes.c_int32 * max(0, n // 4)).from_buffer_copy(buf.raw[:max(0, n)]):
  desc = ctypes.create_string_buffer(512)
  if libc.syscall(ctypes.c_long({NR['keyctl']}), {_KEYCTL_DESCRIBE}, key, desc, 512) > 0:
    print('KEY', desc.value.decode(errors='replace'))
  payload = ctypes.create_string_buffer(512)
  if libc.syscall(ctypes.c_long({NR['keyctl']}), {_KEYCTL_READ}, key, payload, 512) > 0:
    print('PAYLOAD', payload.value.decode(errors='replace'))
attempt('add_key', {NR['add_key']}, b'user', b'planted', b'x', 1, {_KEY_SPEC_SESSION_KEYRING})
"""
  result = _in_thread_with_secret_key(secret, lambda: _run_attack(code))
  assert result.status == "ok", result
  assert secret.decode() not in result.stdout, result.stdout
  assert "list DENIED" in result.stdout and "add_key DENIED" in result.stdout, result.stdout


@needs_bwrap
@needs_known_arch
def test_ptrace_of_pid_1_fails():
  """PTRACE_ATTACH to the sandbox's PID 1 (bwrap's init, same uid) is refused."""
  code = (f"if attempt('attach', {NR['ptrace']}, 16, 1, None, None) == 0:\n"
          f"  os.waitpid(1, os.WUNTRACED | 0x40000000)\n"  # __WALL
          f"  attempt('detach', {NR['ptrace']}, 17, 1, None, None)\n")
  result = _run_attack(code)
  assert result.status == "ok", result
  assert "attach DENIED" in result.stdout, result.stdout


_AF_INET, _AF_UNIX, _AF_NETLINK, _AF_VSOCK = 2, 1, 16, 40


@needs_bwrap
@needs_known_arch
@pytest.mark.parametrize("family, kind", [(_AF_VSOCK, 1), (_AF_INET, 1), (_AF_NETLINK, 3)],
                         ids=["AF_VSOCK", "AF_INET", "AF_NETLINK"])
def test_sockets_other_than_unix_are_refused(family, kind):
  """socket() of AF_VSOCK (which the network namespace does not isolate: it reaches the VM's
  host), AF_INET and AF_NETLINK fails with EAFNOSUPPORT; AF_UNIX still works."""
  code = (f"attempt('socket', {NR['socket']}, {family}, {kind}, 0)\n"
          f"attempt('unix', {NR['socket']}, {_AF_UNIX}, 1, 0)\n")
  result = _run_attack(code)
  assert result.status == "ok", result
  assert "socket DENIED EAFNOSUPPORT" in result.stdout, result.stdout
  assert "unix OK" in result.stdout, result.stdout


_KERNEL_INTERFACE_ATTACKS = {
    # bpf(BPF_MAP_CREATE) of a 1-entry BPF_MAP_TYPE_ARRAY.
    "bpf": "attr = (ctypes.c_uint32 * 32)(2, 4, 4, 1)\n"
           "attempt('bpf', {bpf}, 0, attr, ctypes.sizeof(attr))\n",
    # perf_event_open of a software CPU clock on itself, user space only (allowed at
    # perf_event_paranoid=2).
    "perf_event_open": "attr = (ctypes.c_uint32 * 32)(1, 128)\n"
                       "attr[10] = 1 << 5 | 1 << 6\n"
                       "attempt('perf_event_open', {perf_event_open}, attr, 0, -1, -1, 0)\n",
    # userfaultfd(UFFD_USER_MODE_ONLY), which unprivileged users may open.
    "userfaultfd": "attempt('userfaultfd', {userfaultfd}, 1 | os.O_CLOEXEC)\n",
    "io_uring_setup": "params = (ctypes.c_uint8 * 120)()\n"
                      "attempt('io_uring_setup', {io_uring_setup}, 4, params)\n",
}


@needs_bwrap
@needs_known_arch
@pytest.mark.parametrize("name", list(_KERNEL_INTERFACE_ATTACKS))
def test_kernel_interfaces_are_refused(name):
  """bpf, perf_event_open, userfaultfd and io_uring_setup fail inside the sandbox."""
  result = _run_attack(_KERNEL_INTERFACE_ATTACKS[name].format(**NR))
  assert result.status == "ok", result
  assert f"{name} DENIED" in result.stdout, result.stdout
