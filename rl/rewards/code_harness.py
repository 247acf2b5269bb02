"""The trusted side of an assert test: runs test code against a candidate it cannot reach.

`code.py` runs this file as the sandboxed program of every `AssertTest`. Two processes share
the sandbox:

* the harness (this file's `main`, trusted): it reads a per-run random token, runs the test
  code (an MBPP `assert` line, HumanEval's `check`) and writes the token to its stdout only
  when the test code has run to its end without raising;
* the candidate (`serve`, untrusted): a child forked from the harness before the harness
  has read anything secret, which executes the model's program and answers calls of its
  functions over a pipe.

The test code calls the candidate's functions through proxies. Arguments and results cross
the pipe as data (`encode` / `decode`): None, bool, int, float, complex, str, bytes, list,
tuple, dict, set, frozenset, range, with iterators (generators, map, ...) materialised; any
other result makes the call raise. So every value the test code compares is a builtin the
harness built itself, and `==`, `bool()`, `abs()` on it are the builtins' own.

Threat model. The candidate runs arbitrary code with the sandbox's privileges: it can inspect
its own frames and heap, patch its builtins, start threads, exit at any moment, send signals,
read everything under /proc that its uid may read, and write files in the working directory.
The grader (`code.py`) counts a test as passed only when the harness's stdout holds the token,
so the candidate would have to learn the token, and it cannot:

* the token is not in the candidate's process: the harness forks the candidate first, then
  reads the token from its stdin (the child's stdin is already /dev/null), reads and deletes
  the test files, and only then lets the child run the program: no copy of the token or the
  tests ever exists in the child's memory, and the pipe the token came through is empty by
  the time the program runs. The token is in no file, argument or environment variable;
* the harness makes itself non-dumpable (prctl PR_SET_DUMPABLE 0) before anything else, so
  the candidate, without CAP_SYS_PTRACE, can neither ptrace it nor open its /proc/<pid>/mem,
  fd/ or environ;
* the candidate's stdout and stderr are the harness's stderr, never the stdout the grader
  reads; the test code and the HumanEval prompt are read and deleted before it starts, and
  the harness never imports from the writable working directory;
* helper functions of a HumanEval prompt (`poly`, `encode_cyclic`) are the prompt's own, run
  in the harness; only the function the completion writes (the prompt's last `def`) and
  names the prompt does not define are the candidate's. Builtin names (`abs`, `len`) are
  never the candidate's.

What the candidate can still do: kill or stall the harness (the test fails), and exhaust the
sandbox's time or output limits (the test fails). Limits of the protocol: candidate functions
that mutate their arguments, return instances of their own classes, or take callables as
arguments cannot be tested this way; such tests fail. Without bubblewrap (`allow_weak`) the
candidate shares the host's PID namespace, and the token is only as secret as the host's
ptrace policy makes the grader's own memory.
"""

import ast
import builtins
import ctypes
import json
import os
import re
import signal
import struct
import sys

TOKEN_HEX_CHARS = 32
PROGRAM_FILE = "solution.py"
TEST_FILE = "test.py"
PREFIX_FILE = "prefix.py"

_MAX_MESSAGE_BYTES = 64 << 20
_MAX_DEPTH = 200
_HEADER = struct.Struct(">Q")
_PR_SET_DUMPABLE, _PR_GET_DUMPABLE = 4, 3


# ----------------------------------------------------------------------------- Data codec

def encode(value, depth: int = 0) -> list:
  """A JSON-able tagged form of plain data; TypeError for anything else."""
  if depth > _MAX_DEPTH:
    raise ValueError("value nested too deeply")
  if value is None:
    return ["N"]
  if isinstance(value, bool):
    return ["b", bool(value)]
  if isinstance(value, int):
    return ["i", format(int.__int__(value), "x")]
  if isinstance(value, float):
    return ["f", float.__repr__(value)]
  if isinstance(value, complex):
    return ["c", float.__repr__(value.real), float.__repr__(value.imag)]
  if isinstance(value, str):
    return ["s", str.__str__(value)]
  if isinstance(value, (bytes, bytearray)):
    return ["y", bytes(value).hex()]
  if isinstance(value, range):
    return ["r", format(value.start, "x"), format(value.stop, "x"), format(value.step, "x")]
  if isinstance(value, dict):
    return ["d", [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]]
  for kind, tag in ((list, "l"), (tuple, "t"), (set, "S"), (frozenset, "F")):
    if isinstance(value, kind):
      return [tag, [encode(item, depth + 1) for item in value]]
  if hasattr(type(value), "__next__") and hasattr(type(value), "__iter__"):
    return ["I", [encode(item, depth + 1) for item in value]]
  raise TypeError(f"a {type(value).__name__} is not plain data")


def decode(node, depth: int = 0):
  """The value of an `encode`d node, built from builtins only; ValueError if malformed."""
  if depth > _MAX_DEPTH or type(node) is not list or not node or type(node[0]) is not str:
    raise ValueError(f"malformed value {str(node)[:80]}")
  tag, args = node[0], node[1:]
  kinds = tuple(type(a) for a in args)
  if tag == "N" and not args:
    return None
  if tag == "b" and kinds == (bool,):
    return args[0]
  if tag == "i" and kinds == (str,):
    return int(args[0], 16)
  if tag == "f" and kinds == (str,) and len(args[0]) < 64:
    return float(args[0])
  if tag == "c" and kinds == (str, str) and max(map(len, args)) < 64:
    return complex(float(args[0]), float(args[1]))
  if tag == "s" and kinds == (str,):
    return args[0]
  if tag == "y" and kinds == (str,):
    return bytes.fromhex(args[0])
  if tag == "r" and kinds == (str, str, str):
    return range(*(int(a, 16) for a in args))
  if tag == "d" and kinds == (list,):
    if not all(type(pair) is list and len(pair) == 2 for pair in args[0]):
      raise ValueError("malformed dict")
    return {decode(k, depth + 1): decode(v, depth + 1) for k, v in args[0]}
  containers = {"l": list, "t": tuple, "S": set, "F": frozenset, "I": iter}
  if tag in containers and kinds == (list,):
    return containers[tag]([decode(item, depth + 1) for item in args[0]])
  raise ValueError(f"malformed value with tag {tag[:10]!r}")


# ----------------------------------------------------------------------------- Pipe protocol

def _send(fd: int, message) -> None:
  data = json.dumps(message).encode()
  view = memoryview(_HEADER.pack(len(data)) + data)
  while view:
    view = view[os.write(fd, view):]


def _read_exactly(fd: int, size: int) -> bytes:
  chunks, remaining = [], size
  while remaining:
    chunk = os.read(fd, min(remaining, 1 << 20))
    if not chunk:
      raise EOFError("the candidate's process closed the pipe (it exited or was killed)")
    chunks.append(chunk)
    remaining -= len(chunk)
  return b"".join(chunks)


def _receive(fd: int):
  (size,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size))
  if size > _MAX_MESSAGE_BYTES:
    raise ValueError(f"a {size}-byte reply from the candidate is over the limit")
  return json.loads(_read_exactly(fd, size))


# ----------------------------------------------------------------------------- Candidate side

def _describe(value) -> list:
  if type(value).__name__ == "module":
    return ["module", str(getattr(value, "__name__", ""))]
  return ["callable"] if callable(value) else ["value"]


def _answer(namespace: dict, request) -> list:
  try:
    if request[0] == "get":
      result = namespace[request[1]]
    else:
      args, kwargs = decode(request[2]), decode(request[3])
      result = namespace[request[1]](*args, **kwargs)
  except BaseException as error:  # SystemExit and friends from a call are its failure too
    return ["raise", type(error).__name__, str(error)[:1000]]
  try:
    return ["ok", encode(result)]
  except (TypeError, ValueError, RecursionError) as error:
    return ["unencodable", f"{type(result).__name__}: {error}"[:1000]]


def serve(request_fd: int, reply_fd: int) -> None:
  """Runs the candidate's program, then answers calls of its globals until the pipe closes."""
  namespace = {"__name__": "__main__", "__file__": PROGRAM_FILE, "__builtins__": builtins}
  try:
    with open(PROGRAM_FILE, encoding="utf-8") as f:
      source = f.read()
    exec(compile(source, PROGRAM_FILE, "exec"), namespace)  # noqa: S102  (sandboxed)
  except BaseException as error:
    sys.excepthook(*sys.exc_info())  # the traceback, to stderr: the grader's failure detail
    _send(reply_fd, ["failed", f"{type(error).__name__}: {error}"[:1000]])
    return
  _send(reply_fd, ["loaded", {name: _describe(value) for name, value in namespace.items()
                              if type(name) is str}])
  while True:
    try:
      request = _receive(request_fd)
    except EOFError:
      return
    _send(reply_fd, _answer(namespace, request))


# ----------------------------------------------------------------------------- Harness side

class CandidateError(Exception):
  """The candidate's process failed to answer (crashed, exited, sent a malformed reply)."""


class _Candidate:
  """The candidate's process and the pipes to it.

  Forked at construction, before the harness reads its secrets; the child waits for `start`.
  """

  def __init__(self):
    to_child, self._requests = os.pipe()
    self._replies, from_child = os.pipe()
    go_read, self._go = os.pipe()
    self.pid = os.fork()
    if self.pid == 0:
      try:
        for fd in (self._requests, self._replies, self._go):
          os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # the token is still in the stdin pipe: never the child's to read
        os.close(devnull)
        os.dup2(2, 1)  # the harness's stdout carries the token: not the child's to write
        if os.read(go_read, 1) == b"g":
          os.close(go_read)
          serve(to_child, from_child)
      finally:
        try:
          sys.stdout.flush()
        finally:
          os._exit(0)
    for fd in (to_child, from_child, go_read):
      os.close(fd)
    self.globals = {}

  def start(self) -> None:
    """Lets the child run the program (call once the secrets are out of its reach)."""
    os.write(self._go, b"g")
    os.close(self._go)
    reply = self._reply()
    if reply[0] == "failed":
      raise CandidateError(f"the program failed before the tests ran: {reply[1:]}")
    if reply[0] != "loaded" or len(reply) != 2 or type(reply[1]) is not dict:
      raise CandidateError("malformed start-up message from the candidate")
    self.globals = reply[1]

  def _reply(self) -> list:
    try:
      reply = _receive(self._replies)
    except (EOFError, ValueError) as error:
      raise CandidateError(str(error)) from None
    if type(reply) is not list or not reply or type(reply[0]) is not str:
      raise CandidateError("malformed reply from the candidate")
    return reply

  def request(self, message: list):
    _send(self._requests, message)
    reply = self._reply()
    if reply[0] == "ok" and len(reply) == 2:
      return decode(reply[1])
    if reply[0] == "raise" and len(reply) == 3 and all(type(r) is str for r in reply[1:]):
      error_type = getattr(builtins, reply[1], None)
      error = CandidateError(f"{reply[1]}: {reply[2]}")
      if isinstance(error_type, type) and issubclass(error_type, Exception):
        try:
          error = error_type(reply[2])
        except TypeError:  # a builtin exception that wants other arguments
          pass
      raise error
    if reply[0] == "unencodable" and len(reply) == 2:
      raise CandidateError(f"the candidate returned a non-data value ({str(reply[1])[:200]})")
    raise CandidateError("malformed reply from the candidate")

  def close(self) -> None:
    os.kill(self.pid, signal.SIGKILL)
    os.waitpid(self.pid, 0)


class _Proxy:
  """Stands for one of the candidate's functions in the test code."""

  def __init__(self, candidate: _Candidate, name: str):
    self._candidate, self.__name__ = candidate, name

  def __call__(self, *args, **kwargs):
    return self._candidate.request(["call", self.__name__, encode(args), encode(kwargs)])

  def __repr__(self) -> str:
    return f"<candidate function {self.__name__}>"


def _make_non_dumpable() -> None:
  libc = ctypes.CDLL(None, use_errno=True)
  libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                         ctypes.c_ulong]
  if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0 or libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0,
                                                                  0) != 0:
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


def _read_token() -> str:
  """The token line from stdin; stdin then becomes /dev/null (the pipe is left empty)."""
  data = b""
  while b"\n" not in data and len(data) <= TOKEN_HEX_CHARS:
    chunk = os.read(0, TOKEN_HEX_CHARS + 1 - len(data))
    if not chunk:
      break
    data += chunk
  token = data.decode("ascii", "replace").strip()
  devnull = os.open(os.devnull, os.O_RDONLY)
  os.dup2(devnull, 0)
  os.close(devnull)
  if not re.fullmatch(f"[0-9a-f]{{{TOKEN_HEX_CHARS}}}", token):
    raise ValueError("the harness did not receive a token on stdin")
  return token


def _take_file(name: str) -> str:
  with open(name, encoding="utf-8") as f:
    text = f.read()
  os.unlink(name)
  return text


def _referenced_names(test_code: str) -> set[str]:
  return {node.id for node in ast.walk(ast.parse(test_code)) if isinstance(node, ast.Name)}


def _prompt_namespace(prefix: str) -> tuple[dict, str | None]:
  """The HumanEval prompt run in the harness, and the name of its last `def` (the function
  the completion writes). A prompt that does not run gives an empty namespace."""
  namespace = {"__name__": "__main__", "__builtins__": builtins}
  try:
    tree = ast.parse(prefix)
    exec(compile(tree, PREFIX_FILE, "exec"), namespace)  # noqa: S102  (the dataset's prompt)
  except Exception:  # noqa: BLE001  (a prompt that is not a whole module gives no helpers)
    return {"__name__": "__main__", "__builtins__": builtins}, None
  defs = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
  return namespace, defs[-1] if defs else None


def _test_namespace(candidate: _Candidate, test_code: str, prefix: str) -> dict:
  namespace, target = _prompt_namespace(prefix)
  for name in sorted(_referenced_names(test_code) & set(candidate.globals)):
    kind = candidate.globals[name]
    if hasattr(builtins, name) or (name in namespace and name != target):
      continue
    if type(kind) is not list or not kind:
      raise CandidateError("malformed start-up message from the candidate")
    if kind[0] == "callable":
      namespace[name] = _Proxy(candidate, name)
    elif kind[0] == "module" and len(kind) == 2 and re.fullmatch(r"[A-Za-z_][\w.]*",
                                                                   str(kind[1])):
      __import__(kind[1])
      namespace[name] = sys.modules[kind[1]]
    elif kind[0] == "value":
      namespace[name] = candidate.request(["get", name])
  return namespace


def main() -> int:
  """Harness entry point: exit 0 with the token on stdout iff the whole test code ran."""
  _make_non_dumpable()
  script_dir = os.path.dirname(os.path.abspath(sys.argv[0]))
  sys.path[:] = [p for p in sys.path if p not in ("", ".", script_dir)]
  candidate = _Candidate()
  try:
    token = _read_token()
    test_code, prefix = _take_file(TEST_FILE), _take_file(PREFIX_FILE)
    candidate.start()
    namespace = _test_namespace(candidate, test_code, prefix)
    exec(compile(test_code, TEST_FILE, "exec"), namespace)  # noqa: S102  (the dataset's test)
  finally:
    candidate.close()
  sys.stdout.flush()
  os.write(1, f"\n{token}\n".encode())  # on a line of its own, whatever the test printed
  return 0


if __name__ == "__main__":
  sys.exit(main())
