"""The seccomp filter of the code sandbox (rl/rewards/sandbox.py), as a classic BPF program.

bwrap installs it (`--seccomp FD`) just before it executes the sandboxed command, so it binds
every process of the program. It refuses the kernel interfaces a sandboxed program has no use
for and that widen the kernel's attack surface or reach outside the namespaces:

* keyctl, add_key, request_key: the kernel keyrings are not namespaced; the caller's session
  keyring (and anything a process on the host stored in it) would be readable and writable.
* ptrace, process_vm_readv, process_vm_writev: inspecting or steering bwrap's PID 1.
* bpf, perf_event_open, userfaultfd, io_uring_setup/enter/register: large kernel interfaces
  with a long record of privilege-escalation bugs, and userfaultfd stalls kernel paths.
* socket and socketpair of any family but AF_UNIX: the network namespace isolates AF_INET and
  AF_INET6, but not AF_VSOCK (which reaches the hypervisor of a VM), and AF_NETLINK, AF_PACKET
  and the rest are kernel interfaces a program under test has no use for.

A refused syscall fails with EPERM (EAFNOSUPPORT for a socket family), as if the kernel had
refused it, so well-written programs see an ordinary error. A syscall made through another
ABI than the native one (i386 `int 0x80` on x86_64, 32-bit ARM on aarch64, which have other
syscall numbers and, on i386, socketcall) kills the process; so does an x32 syscall number.

The program is built here, instruction by instruction (struct sock_filter), for x86_64 and
aarch64; on any other machine `filter_program` raises UnsupportedArchError.
"""

import errno
import platform
import struct
import sys

# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6].
_NR_OFFSET, _ARCH_OFFSET, _ARGS_OFFSET = 0, 4, 16
# Low 32 bits of args[0] (socket's `int family`): the first word on little-endian machines.
_ARG0_LOW_OFFSET = _ARGS_OFFSET + (0 if sys.byteorder == "little" else 4)

# Classic BPF opcodes (linux/bpf_common.h).
_LD_W_ABS = 0x00 | 0x00 | 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x05 | 0x10 | 0x00     # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x05 | 0x30 | 0x00     # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06 | 0x00            # BPF_RET | BPF_K

# Return values (linux/seccomp.h).
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_RET_ALLOW = 0x7FFF0000

_AF_UNIX = 1
# x32 syscalls on x86_64 are the native numbers with this bit set.
_X32_SYSCALL_BIT = 0x40000000

# Per machine: the AUDIT_ARCH value of its native ABI, and syscall numbers (asm/unistd_64.h on
# x86_64, asm-generic/unistd.h on aarch64).
ARCHES = {
    "x86_64": dict(
        audit_arch=0xC000003E,
        refused=dict(ptrace=101, add_key=248, request_key=249, keyctl=250,
                     perf_event_open=298, process_vm_readv=310, process_vm_writev=311,
                     bpf=321, userfaultfd=323, io_uring_setup=425, io_uring_enter=426,
                     io_uring_register=427),
        socket=(41, 53)),  # socket, socketpair
    "aarch64": dict(
        audit_arch=0xC00000B7,
        refused=dict(ptrace=117, add_key=217, request_key=218, keyctl=219,
                     perf_event_open=241, process_vm_readv=270, process_vm_writev=271,
                     bpf=280, userfaultfd=282, io_uring_setup=425, io_uring_enter=426,
                     io_uring_register=427),
        socket=(198, 199)),
}


class UnsupportedArchError(RuntimeError):
  """No seccomp filter is known for this machine's architecture."""


def arch_table(name: str | None = None) -> dict:
  """The syscall table of machine `name` (default: this one); raises on an unknown one."""
  name = platform.machine() if name is None else name
  if name not in ARCHES:
    raise UnsupportedArchError(
        f"the sandbox's seccomp filter knows the syscall numbers of {sorted(ARCHES)}, "
        f"not of {name!r}; refusing to run untrusted code without it.")
  return ARCHES[name]


def _assemble(program: list[tuple]) -> bytes:
  """Packs (opcode, k, jump_if_true_label, jump_if_false_label) instructions and ("label",
  name) markers into struct sock_filter records, resolving labels to relative jumps."""
  labels, index = {}, 0
  for item in program:
    if item[0] == "label":
      labels[item[1]] = index
    else:
      index += 1
  packed, index = [], 0
  for item in program:
    if item[0] == "label":
      continue
    code, k, *targets = item
    jumps = [labels[t] - index - 1 if t is not None else 0 for t in targets] + [0, 0]
    assert all(0 <= j < 256 for j in jumps[:2]), "seccomp jump out of range"
    packed.append(struct.pack("=HBBI", code, jumps[0], jumps[1], k))
    index += 1
  return b"".join(packed)


def filter_program(name: str | None = None) -> bytes:
  """The filter for machine `name` (default: this one), as bwrap's --seccomp reads it."""
  table = arch_table(name)
  program = [(_LD_W_ABS, _ARCH_OFFSET),
             (_JEQ_K, table["audit_arch"], None, "kill"),
             (_LD_W_ABS, _NR_OFFSET)]
  if table["audit_arch"] == ARCHES["x86_64"]["audit_arch"]:
    program.append((_JGE_K, _X32_SYSCALL_BIT, "kill", None))
  for number in sorted(table["refused"].values()):
    program.append((_JEQ_K, number, "eperm", None))
  for number in table["socket"]:
    program.append((_JEQ_K, number, "socket", None))
  program += [(_RET_K, _RET_ALLOW),
              ("label", "socket"),
              (_LD_W_ABS, _ARG0_LOW_OFFSET),
              (_JEQ_K, _AF_UNIX, "allow", None),
              (_RET_K, _RET_ERRNO | errno.EAFNOSUPPORT),
              ("label", "allow"),
              (_RET_K, _RET_ALLOW),
              ("label", "eperm"),
              (_RET_K, _RET_ERRNO | errno.EPERM),
              ("label", "kill"),
              (_RET_K, _RET_KILL_PROCESS)]
  return _assemble(program)
