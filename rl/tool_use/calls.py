"""The tool-call format, the registry of tools, and tool execution that never crashes a rollout.

Format (Hermes / Qwen2.5 style; one call ends an assistant turn):

  the model writes  <tool_call>{"name": "find_hotels", "arguments": {"city": "Rome"}}</tool_call>
  the host appends  <|im_end|>\\n<|im_start|>tool\\n<tool_response>RESULT</tool_response>
                    <|im_end|>\\n<|im_start|>assistant\\n
                    (one string, no line break after </tool_response>) with response_mask 0,
                    and generation resumes in a fresh assistant turn.

Pausing at the end marker. A tokenizer with `</tool_call>` as one added token (Qwen2.5, Qwen3)
stops on that id. The byte tokenizer spells the marker as 12 byte tokens, so the engine stops
on its last byte, `>`, and the host checks whether the turn's text now ends with the whole
marker; when it does not (a `>` in ordinary text, or the opening `<tool_call>` itself) the
episode just continues in the next engine round, which costs a re-prefill but no turn: a call
in bytes takes two rounds. Other tokenizers are refused: a BPE `>` can merge with its
neighbours, so the stop would be missed.

Tools are plain Python functions registered by name with `@register_tool`; each takes a
`ToolContext` (the episode's task and the limits) and the call's JSON arguments as keywords and
returns a string or a JSON-serialisable value. Executing a call never raises: malformed JSON,
an unknown tool, bad arguments, an exception or a timeout become an `error: ...` result the
model reads. Model-written code runs only in the sandbox (`python` tool); the other tools are
trusted host functions over the task's data.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from models.tokenizer import IM_END, IM_START, ByteTokenizer
from rl.rewards import sandbox

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
RESPONSE_START = "<tool_response>"
RESPONSE_END = "</tool_response>"
RESULT_PREFIX = f"{IM_END}\n{IM_START}tool\n{RESPONSE_START}"
RESULT_SUFFIX = f"{RESPONSE_END}{IM_END}\n{IM_START}assistant\n"
# Beyond the tool's own limit: a sandboxed program's timeout is reported by the sandbox first.
_WAIT_GRACE_S = 1.0


class ToolCallError(ValueError):
  """The model's call cannot be parsed or does not name a tool of its environment."""


class ToolFailure(RuntimeError):
  """A tool ran and failed; its message is what the model reads."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
  name: str
  arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ToolContext:
  """What a tool sees besides its arguments."""
  task: Mapping[str, Any]  # the episode's task (e.g. its database)
  timeout_s: float
  allow_weak_sandbox: bool = False


@dataclasses.dataclass(frozen=True)
class ToolResult:
  text: str
  error: bool
  wall_s: float


@dataclasses.dataclass(frozen=True)
class Tool:
  name: str
  fn: Callable[..., Any]
  description: str
  parameters: Mapping[str, str]  # argument name -> description


TOOLS: dict[str, Tool] = {}


def register_tool(name: str, description: str, parameters: Mapping[str, str]):
  """Decorator registering `fn(ctx: ToolContext, **arguments)` as tool `name`."""
  def register(fn):
    if name in TOOLS:
      raise ValueError(f"tool {name!r} is already registered")
    TOOLS[name] = Tool(name, fn, description, dict(parameters))
    return fn
  return register


def describe_tools(names: Sequence[str]) -> str:
  """The tool list and the call format, as the system prompt states them."""
  lines = [f'Tools (call: {CALL_START}{{"name": ..., "arguments": {{...}}}}{CALL_END}, '
           f"result: {RESPONSE_START}...{RESPONSE_END}):"]
  for name in names:
    tool = TOOLS[name]
    lines.append(f"- {name}({', '.join(tool.parameters)}): {tool.description}")
  return "\n".join(lines)


# ----------------------------------------------------------------------------- Format

def render_call(name: str, arguments: Mapping[str, Any]) -> str:
  return f"{CALL_START}{json.dumps({'name': name, 'arguments': dict(arguments)})}{CALL_END}"


def render_result(text: str) -> str:
  return f"{RESULT_PREFIX}{text}{RESULT_SUFFIX}"


def ends_with_call(turn_text: str) -> bool:
  return turn_text.endswith(CALL_END)


def parse_call(turn_text: str) -> ToolCall:
  """The call closing an assistant turn's text (which ends with `</tool_call>`)."""
  if not ends_with_call(turn_text):
    raise ToolCallError(f"a tool call must end with {CALL_END}")
  start = turn_text.rfind(CALL_START)
  if start < 0:
    raise ToolCallError(f"{CALL_END} without {CALL_START}")
  body = turn_text[start + len(CALL_START):-len(CALL_END)]
  try:
    obj = json.loads(body)
  except json.JSONDecodeError as e:
    raise ToolCallError(f"the call is not valid JSON ({e.msg})") from None
  if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
    raise ToolCallError('the call must be a JSON object {"name": ..., "arguments": {...}}')
  arguments = obj.get("arguments", {})
  if not isinstance(arguments, dict):
    raise ToolCallError("the call's arguments must be a JSON object")
  return ToolCall(obj["name"], arguments)


def call_stop_id(tokenizer) -> int:
  """The id the engine stops on to pause at `</tool_call>` (see the module docstring)."""
  single = tokenizer.token_to_id(CALL_END)
  if single is not None:
    return int(single)
  if isinstance(tokenizer, ByteTokenizer):
    return int(tokenizer.token_to_id(CALL_END[-1]))
  raise ValueError(f"the tokenizer has no single token {CALL_END!r}; tool use needs it (or the "
                   "byte tokenizer) so that generation can pause at the end of a call")


# ----------------------------------------------------------------------------- Execution

def execute(turn_text: str, tool_names: Sequence[str], ctx: ToolContext) -> ToolResult:
  """Parses and runs the call ending `turn_text`; every failure is an error result."""
  start = time.monotonic()

  def failed(message: str) -> ToolResult:
    return ToolResult(f"error: {message}", True, time.monotonic() - start)
  try:
    call = parse_call(turn_text)
  except ToolCallError as e:
    return failed(f"malformed tool call: {e}")
  if call.name not in tool_names:
    return failed(f"unknown tool {call.name!r}; available: {', '.join(tool_names)}")
  try:
    value = TOOLS[call.name].fn(ctx, **call.arguments)
  except TypeError as e:
    return failed(f"bad arguments for {call.name}: {e}")
  except ToolFailure as e:
    return failed(str(e))
  except Exception as e:  # noqa: BLE001  (a tool's bug must not end the rollout)
    return failed(f"{call.name} raised {type(e).__name__}: {e}")
  text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
  return ToolResult(text, False, time.monotonic() - start)


class ToolRunner:
  """Runs calls concurrently in a thread pool, each with a deadline.

  The deadline counts from submission (timeout_s + 1 s grace), so calls queued behind a full
  pool spend part of theirs waiting: size `workers` to the calls one wave can issue. A host
  tool that overruns is abandoned (its thread finishes in the background) and the model reads
  a timeout error; sandboxed programs are killed by the sandbox itself at timeout_s.
  """

  def __init__(self, *, workers: int, timeout_s: float, allow_weak_sandbox: bool = False):
    self.timeout_s = timeout_s
    self.allow_weak_sandbox = allow_weak_sandbox
    self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="tool")

  def submit(self, turn_text: str, tool_names: Sequence[str], task: Mapping[str, Any]):
    ctx = ToolContext(task, self.timeout_s, self.allow_weak_sandbox)
    future = self._pool.submit(execute, turn_text, tuple(tool_names), ctx)
    return future, time.monotonic() + self.timeout_s + _WAIT_GRACE_S

  def result(self, pending) -> ToolResult:
    future, deadline = pending
    try:
      return future.result(timeout=max(0.0, deadline - time.monotonic()))
    except concurrent.futures.TimeoutError:
      future.cancel()
      return ToolResult(f"error: the tool call timed out after {self.timeout_s:g} s", True,
                        self.timeout_s + _WAIT_GRACE_S)

  def close(self) -> None:
    self._pool.shutdown(wait=False, cancel_futures=True)


# ----------------------------------------------------------------------------- Built-in tools

@register_tool("python", "runs a program in a sandbox, returns what it prints",
               {"code": "Python 3 source"})
def run_python(ctx: ToolContext, code: str) -> str:
  if not isinstance(code, str):
    raise ToolFailure("python: `code` must be a string")
  result = sandbox.run(code, timeout_s=ctx.timeout_s, allow_weak=ctx.allow_weak_sandbox,
                       max_output_bytes=1 << 14)
  if result.ok:
    return result.stdout
  if result.status == "runtime_error":
    # The traceback's last lines (the exception) matter most; results are cut to a budget.
    raise ToolFailure("python: " + "\n".join(result.stderr.strip().splitlines()[-2:]))
  raise ToolFailure(f"python: the program was stopped ({result.status}, limit "
                    f"{ctx.timeout_s:g} s)")
