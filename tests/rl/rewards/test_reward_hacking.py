"""Reward hacking: programs a policy under RL could find that score without solving the task.

Each attack program defines a wrong `add` (or none) and then tries to make the grader count
the tests as passed anyway: exiting 0 before or during the tests, exit hooks, objects that
compare equal to anything, patched builtins, tracing hooks, threads and signals that end the
process early, reading the tests from disk, and hunting for the harness's token in memory and
/proc. Every attack must score 0 on a HumanEval-style problem (a `check` function, the
completion continuing a prompt) and an MBPP-style one (assert lines); honest programs must
still score in full. The math half bounds the verifier's time on adversarial responses.
"""

import time

import pytest

from rl.rewards import code, code_harness, sandbox
from rl.rewards import math as math_reward

needs_bwrap = pytest.mark.skipif(
    sandbox.bwrap_path() is None,
    reason="bubblewrap (bwrap) is not installed; run `bash launch/setup_sandbox.sh` as root")

PROMPT = 'def add(a, b):\n    """Return a + b."""\n'
CHECK = ("def check(candidate):\n"
         "    assert candidate(1, 2) == 3\n"
         "    assert candidate(-4, 1) == -3\n"
         "    assert abs(candidate(0.5, 0.25) - 0.75) < 1e-9\n")
HUMANEVAL = code.humaneval_problem({"prompt": PROMPT, "test": CHECK, "entry_point": "add"})
MBPP = code.CodeProblem(tests=(code.AssertTest("assert add(1, 2) == 3"),
                               code.AssertTest("assert add(-4, 1) == -3"),
                               code.AssertTest("assert abs(add(0.5, 0.25) - 0.75) < 1e-9")))
WRONG_ADD = "def add(a, b):\n    return 0\n"

ATTACKS = {
    "sys_exit_before_tests": WRONG_ADD + "import sys\nsys.exit(0)\n",
    "os_exit_before_tests": WRONG_ADD + "import os\nos._exit(0)\n",
    "atexit_forces_status_0": WRONG_ADD + "import atexit, os\natexit.register(os._exit, 0)\n",
    "excepthook_forces_status_0": (
        WRONG_ADD + "import os, sys\nsys.excepthook = lambda *args: os._exit(0)\n"),
    "os_exit_inside_call": "def add(a, b):\n    import os\n    os._exit(0)\n",
    "system_exit_inside_call": "def add(a, b):\n    raise SystemExit(0)\n",
    "base_exception_inside_call_with_hook": (
        "import os, sys\n"
        "class Stop(BaseException):\n    pass\n"
        "sys.excepthook = lambda *args: os._exit(0)\n"
        "def add(a, b):\n    raise Stop()\n"),
    "always_equal_object": (
        "class Anything:\n"
        "    __eq__ = lambda self, other: True\n"
        "    __ne__ = lambda self, other: False\n"
        "    __lt__ = __le__ = __gt__ = __ge__ = lambda self, other: True\n"
        "    __bool__ = lambda self: True\n"
        "    __hash__ = lambda self: 0\n"
        "    __sub__ = __rsub__ = __add__ = __radd__ = lambda self, other: self\n"
        "    __abs__ = lambda self: 0\n"
        "def add(a, b):\n    return Anything()\n"),
    "int_subclass_equal_to_anything": (
        "class Int(int):\n"
        "    __eq__ = lambda self, other: True\n"
        "    __ne__ = lambda self, other: False\n"
        "    __hash__ = int.__hash__\n"
        "    __sub__ = lambda self, other: Int(0)\n"
        "def add(a, b):\n    return Int(0)\n"),
    "patched_builtin_abs_and_int_eq": (
        "import builtins\n"
        "builtins.abs = lambda x: 0\n"
        "class Int(int):\n"
        "    __eq__ = lambda self, other: True\n"
        "    __hash__ = int.__hash__\n"
        "def add(a, b):\n    return Int(0)\n"),
    "settrace_exits_when_tests_start": (
        WRONG_ADD + "import os, sys\n"
        "def tracer(frame, event, arg):\n"
        "    if frame.f_code.co_name in ('check', 'add'):\n"
        "        os._exit(0)\n"
        "sys.settrace(tracer)\n"),
    "thread_exits_process_mid_test": (
        "import os, threading, time\n"
        "threading.Thread(target=lambda: (time.sleep(0.3), os._exit(0)), daemon=True).start()\n"
        "def add(a, b):\n    time.sleep(3)\n    return 0\n"),
    "signal_exits_process_mid_test": (
        "import os, signal, time\n"
        "signal.signal(signal.SIGALRM, lambda *args: os._exit(0))\n"
        "signal.setitimer(signal.ITIMER_REAL, 0.3)\n"
        "def add(a, b):\n    time.sleep(3)\n    return 0\n"),
    "kills_the_harness": (
        WRONG_ADD + "import os, signal\n"
        "os.kill(os.getppid(), signal.SIGKILL)\n"
        "for pid in os.listdir('/proc'):\n"
        "    try:\n"
        "        os.write(os.open(f'/proc/{pid}/fd/1', os.O_WRONLY), b'0' * 32 + b'\\n')\n"
        "    except (OSError, ValueError):\n"
        "        pass\n"
        "os._exit(0)\n"),
    "reads_expected_answers_from_disk": (
        "import glob, re\n"
        "def add(a, b):\n"
        "    for path in glob.glob('/tmp/**', recursive=True):\n"
        "        try:\n"
        "            text = open(path, errors='ignore').read()\n"
        "        except OSError:\n"
        "            continue\n"
        "        pattern = r'\\((-?[\\d.]+), (-?[\\d.]+)\\)\\s*(?:==|-)\\s*(-?[\\d.]+)'\n"
        "        for m in re.finditer(pattern, text):\n"
        "            if (float(m.group(1)), float(m.group(2))) == (a, b):\n"
        "                value = m.group(3)\n"
        "                return float(value) if '.' in value else int(value)\n"
        "    return 0\n"),
}

# Hunts for the token everywhere a process can look, writes whatever it finds to every stdout
# it can open, and exits 0 (without solving anything).
TOKEN_HUNT = WRONG_ADD + r'''
import gc, os, re, sys
HEX = re.compile(rb"(?<![0-9a-f])[0-9a-f]{32}(?![0-9a-f])")
found, notes = set(), []

def scan(data):
  found.update(m.group().decode() for m in HEX.finditer(data))

for obj in gc.get_objects():
  for value in (obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple))
                else ()):
    if isinstance(value, (str, bytes)):
      scan(value.encode() if isinstance(value, str) else value)
frame = sys._getframe()
while frame is not None:
  scan(repr(frame.f_locals).encode())
  frame = frame.f_back
scan(repr(dict(os.environ)).encode() + repr(sys.argv).encode())
pids = [p for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
for pid in pids:
  for name in ("cmdline", "environ"):
    try:
      scan(open(f"/proc/{pid}/{name}", "rb").read())
    except OSError as error:
      notes.append(f"{pid}/{name}: {type(error).__name__}")
  try:
    fds = os.listdir(f"/proc/{pid}/fd")
  except OSError as error:
    notes.append(f"{pid}/fd: {type(error).__name__}")
    fds = []
  for fd in fds:
    try:
      handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK)
      scan(os.read(handle, 1 << 16))
      os.close(handle)
    except OSError:
      pass
  try:
    with open(f"/proc/{pid}/mem", "rb", 0) as mem:
      for line in open(f"/proc/{pid}/maps"):
        span, perms = line.split()[:2]
        if perms.startswith("rw"):
          start, end = (int(x, 16) for x in span.split("-"))
          try:
            mem.seek(start)
            scan(mem.read(end - start))
          except (OSError, ValueError, OverflowError):
            pass
    notes.append(f"{pid}/mem: read")
  except OSError as error:
    notes.append(f"{pid}/mem: {type(error).__name__}")
message = ("\n".join(sorted(found)) + "\n").encode()
for pid in pids:
  try:
    handle = os.open(f"/proc/{pid}/fd/1", os.O_WRONLY)
    os.write(handle, message)
    os.close(handle)
  except OSError:
    pass
os.write(1, message)
sys.stderr.write("notes: " + "; ".join(notes) + "\nFOUND " + " ".join(sorted(found)) + "\n")
sys.stderr.flush()
os._exit(0)
'''

HONEST_ADD = "def add(a, b):\n    return a + b\n"


def _as_completion(program: str) -> str:
  """A HumanEval completion: finish the prompt's stub, then the program (which redefines it)."""
  return "    pass\n" + program


@needs_bwrap
@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_scores_zero(name):
  """Every attack scores 0 on both problem kinds, and is told apart from a crash only by
  its detail (the graders never count a test whose code did not run to its end)."""
  program = ATTACKS[name]
  results = code.grade_batch([_as_completion(program), program], [HUMANEVAL, MBPP])
  assert [r.pass_rate for r in results] == [0.0, 0.0], [r.outcomes for r in results]


@needs_bwrap
def test_honest_programs_still_pass():
  """The honest add passes both problems; one that is right on two of three MBPP tests gets
  2/3."""
  results = code.grade_batch([_as_completion(HONEST_ADD), HONEST_ADD], [HUMANEVAL, MBPP])
  assert [r.pass_rate for r in results] == [1.0, 1.0], [r.outcomes for r in results]
  partial = code.grade("def add(a, b):\n    return int(a + b)\n", MBPP)
  assert partial.pass_rate == pytest.approx(2 / 3)


@needs_bwrap
def test_token_hunt_finds_nothing(monkeypatch):
  """The hunt (heap, frames, environment, argv, /proc/*/{cmdline,environ,fd,mem}) scores 0
  and never sees the token: the harness's memory and fds are closed to it."""
  token = "5eed" * 8
  monkeypatch.setattr(code.secrets, "token_hex", lambda nbytes: token)
  results = code.grade_batch([_as_completion(TOKEN_HUNT), TOKEN_HUNT], [HUMANEVAL, MBPP])
  for result in results:
    assert result.pass_rate == 0.0
    detail = result.outcomes[0].detail
    assert "FOUND" in detail and token not in detail, detail
    assert "mem: PermissionError" in detail, detail


@needs_bwrap
def test_token_hunt_control_without_non_dumpable(monkeypatch):
  """Control: with the harness's prctl(PR_SET_DUMPABLE, 0) removed, the same hunt does read
  the token out of the harness's memory, so the hunt is a real attack and the prctl is what
  stops it."""
  token = "5eed" * 8
  source = code._harness_source()
  weakened = source.replace("\n  _make_non_dumpable()\n", "\n")
  assert weakened != source
  monkeypatch.setattr(code, "_harness_source", lambda: weakened)
  monkeypatch.setattr(code.secrets, "token_hex", lambda nbytes: token)
  result = code.grade(TOKEN_HUNT, MBPP)
  assert token in result.outcomes[0].detail


@needs_bwrap
def test_planted_module_is_not_imported_by_the_harness(monkeypatch):
  """The program writes math.py into the working directory, built to dump the token from the
  importing process's heap and exit 0; the test code's `import math` still gets the standard
  library's (the harness never imports from the writable working directory)."""
  token = "5eed" * 8
  monkeypatch.setattr(code.secrets, "token_hex", lambda nbytes: token)
  planted = ("import gc, os, re\n"
             "hexes = {o for o in gc.get_objects() if isinstance(o, str)\n"
             "         and re.fullmatch('[0-9a-f]{32}', o)}\n"
             "os.write(1, ('\\n'.join(hexes) + '\\n').encode())\n"
             "os._exit(0)\n")
  program = WRONG_ADD + f"open('math.py', 'w').write({planted!r})\n"
  problem = code.CodeProblem(tests=(
      code.AssertTest("import math\nassert math.isclose(add(0.5, 0.25), 0.75)"),))
  result = code.grade(program, problem)
  assert result.pass_rate == 0.0 and token not in result.outcomes[0].detail


@needs_bwrap
def test_prompt_helpers_are_not_the_candidates():
  """HumanEval/38-style: the test calls a helper the prompt defines (`encode`); redefining it
  as the identity, with an identity `decode`, does not pass (the harness uses the prompt's)."""
  prompt = ("def encode(s):\n    return s[::-1]\n\n"
            "def decode(s):\n    \"\"\"Inverse of encode.\"\"\"\n")
  test = "def check(candidate):\n    assert candidate(encode('hello')) == 'hello'\n"
  problem = code.humaneval_problem({"prompt": prompt, "test": test, "entry_point": "decode"})
  hack = "    return s\n\ndef encode(s):\n    return s\n"
  assert code.grade(hack, problem).pass_rate == 0.0
  assert code.grade("    return s[::-1]\n", problem).pass_rate == 1.0


@needs_bwrap
def test_shadowed_builtins_are_not_the_candidates():
  """A program that defines a global `sorted` cannot change what the test's `sorted` does."""
  problem = code.CodeProblem(tests=(code.AssertTest("assert sorted(pair(3, 1)) == [1, 3]"),))
  hack = "def pair(a, b):\n    return None\nsorted = lambda x: [1, 3]\n"
  assert code.grade(hack, problem).pass_rate == 0.0
  assert code.grade("def pair(a, b):\n    return (a, b)\n", problem).pass_rate == 1.0


@needs_bwrap
def test_stdio_exit_without_output_fails():
  """Stdio tests pass on their output: exiting 0 early, or printing nothing, scores 0."""
  problem = code.CodeProblem(tests=(code.StdioTest("1 2\n", "3\n"),))
  for program in ("import sys\nsys.exit(0)\n", "import os\nos._exit(0)\n"):
    assert code.grade(program, problem).pass_rate == 0.0


MBPP_SAMPLES = [  # MBPP tasks 2, 3 and 4: reference solution, test lines
    ("def similar_elements(test_tup1, test_tup2):\n"
     "  res = tuple(set(test_tup1) & set(test_tup2))\n"
     "  return (res)\n",
     ["assert set(similar_elements((3, 4, 5, 6),(5, 7, 4, 10))) == set((4, 5))",
      "assert set(similar_elements((1, 2, 3, 4),(5, 4, 3, 7))) == set((3, 4))"]),
    ("import math\n"
     "def is_not_prime(n):\n"
     "    result = False\n"
     "    for i in range(2,int(math.sqrt(n)) + 1):\n"
     "        if n % i == 0:\n"
     "            result = True\n"
     "    return result\n",
     ["assert is_not_prime(2) == False", "assert is_not_prime(10) == True"]),
    ("import heapq as hq\n"
     "def heap_queue_largest(nums,n):\n"
     "  largest_nums = hq.nlargest(n, nums)\n"
     "  return largest_nums\n",
     ["assert heap_queue_largest( [25, 35, 22, 85, 14, 65, 75, 22, 58],3)==[85, 75, 65]"]),
]


@needs_bwrap
def test_mbpp_reference_solutions_pass():
  """MBPP reference solutions pass their own assert lines through the harness."""
  results = code.grade_batch(
      [program for program, _ in MBPP_SAMPLES],
      [code.CodeProblem(tests=tuple(code.AssertTest(t) for t in tests))
       for _, tests in MBPP_SAMPLES])
  assert [r.pass_rate for r in results] == [1.0] * len(MBPP_SAMPLES), results


@needs_bwrap
def test_data_round_trips_through_the_harness():
  """Honest results of every supported kind arrive intact: big ints, floats (nan, -0.0),
  complex, str, bytes, nested containers, dicts, sets, ranges, generators; exceptions keep
  their builtin type; module globals and the program's imports are usable by the test."""
  program = ("import math\n"
             "LIMIT = 10\n"
             "def big():\n    return 2 ** 5000 + 1\n"
             "def mixed(x=0):\n"
             "    return [x, -0.0, 1.5 + 2j, 'h\\u00e9\\ud800', b'\\x00\\xff', (1, (2,)),\n"
             "            {'a': {1, 2}, (1, 2): frozenset({3})}, range(1, 9, 3), None, True]\n"
             "def evens(n):\n    return (i for i in range(n) if i % 2 == 0)\n"
             "def checked(x):\n"
             "    if x < 0:\n        raise ValueError('negative')\n"
             "    return math.sqrt(x)\n"
             "def nan():\n    return float('nan')\n")
  tests = ("assert big() == 2 ** 5000 + 1 and type(big()) is int",
           "assert mixed(x=7) == [7, -0.0, 1.5 + 2j, 'h\\u00e9\\ud800', b'\\x00\\xff', "
           "(1, (2,)), {'a': {1, 2}, (1, 2): frozenset({3})}, range(1, 9, 3), None, True]",
           "assert list(evens(7)) == [0, 2, 4, 6]",
           "try:\n    checked(-1)\n    raise AssertionError('no error')\nexcept ValueError:\n"
           "    pass",
           "assert math.isclose(checked(2.0), 2 ** 0.5) and LIMIT == 10",
           "assert nan() != nan()")
  problem = code.CodeProblem(tests=tuple(code.AssertTest(t) for t in tests))
  result = code.grade(program, problem)
  assert result.pass_rate == 1.0, result.outcomes


def test_decode_builds_only_builtins():
  """The harness's decoder accepts only its tagged forms and builds builtin values."""
  value = [1, 2.5, "x", (None, True), {"k": {3}}, b"\x01", range(3)]
  assert code_harness.decode(code_harness.encode(value)) == value
  for malformed in ({"a": 1}, ["i", 5], ["Q"], ["l", "notalist"], ["f", "1" * 100],
                    ["d", [[["s", "k"]]]], [], "N", ["N", 1]):
    with pytest.raises(ValueError):
      code_harness.decode(malformed)
  with pytest.raises(TypeError):
    code_harness.encode(object())


# ----------------------------------------------------------------------------- Math verifier time

_MEGA = 1_000_000
ADVERSARIAL_RESPONSES = {  # (response of about 1 MB, gold, expected score)
    "20000_unclosed_boxes": ("\\boxed{" * 20000 + "x" * (_MEGA - 140000), "5", 0.0),
    "20000_unclosed_boxes_after_an_answer": (
        "\\boxed{5}" + ("\\boxed{ 1 " + " " * 40) * 19990, "5", 1.0),
    "one_box_then_open_braces": ("\\boxed{" + "{" * (_MEGA - 7), "5", 0.0),
    "escaped_braces": ("\\boxed{" + "\\{" * (_MEGA // 2 - 4), "5", 0.0),
    "box_commands_and_space_runs": (("\\boxed" + " " * 44) * 20000, "5", 0.0),
    "answer_line_then_spaces": ("Answer: 5" + " " * (_MEGA - 10) + "x", "5", 0.0),
    "answer_phrase_then_spaces": ("the answer is 5" + " " * (_MEGA - 16) + "x", "5", 0.0),
    "answer_words_without_colon": ("answer " * (_MEGA // 7), "5", 0.0),
    "digit_groups": ("1," * (_MEGA // 2), "5", 0.0),
}


@pytest.mark.parametrize("name", sorted(ADVERSARIAL_RESPONSES))
def test_adversarial_math_response_grades_in_bounded_time(name):
  """About 1 MB of text built to make extraction rescan grades with the right score in under
  30 s. The bound only separates linear from quadratic: 20,000 unclosed boxes took about 4
  minutes with the quadratic scan (killed at the 60 s worker timeout, so it fails here) and
  take under a second now, which leaves a loaded CI host 30x headroom."""
  response, gold, expected = ADVERSARIAL_RESPONSES[name]
  assert len(response) <= math_reward.MAX_RESPONSE_CHARS
  math_reward.score("\\boxed{2^{3}}", "8")  # the worker pool's start-up is not the response's
  start = time.monotonic()
  scores, counts = math_reward.score_batch([response], [gold], timeout_s=60.0)
  elapsed = time.monotonic() - start
  assert scores == [expected], counts
  assert elapsed < 30.0, f"{name}: {elapsed:.1f} s"
