"""Runs a Jupyter notebook's code cells in order in one namespace, as a fresh kernel would,
without Jupyter (nbclient is not a dependency of this project):

  python tests/launch/notebook_runner.py NOTEBOOK REPORT_JSON

Run it from the notebook's folder (a kernel's working directory). What a kernel adds to plain
Python is handled explicitly: a line `!command` runs in the shell, and a non-zero status raises
(IPython would only print it); a `%` or `%%` magic raises, naming the line (there is no IPython
here to run it); `display` is the kernel's built-in, and a cell's last expression is displayed,
as a kernel shows it. Every displayed object is recorded by MIME type: a PNG with its size and
whether its bytes are a PNG, text with its first 200 characters. A cell that raises ends the
run: its index and traceback go to stderr, exit status 1. REPORT_JSON then holds {"cells": code
cells, "cells_run": cells that ran to the end, "displayed": [{"mime": ..., ...}]}.
"""

from __future__ import annotations

import ast
import base64
import json
import subprocess
import sys
import traceback

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def code_cells(path: str) -> list[str]:
  with open(path) as f:
    notebook = json.load(f)
  if notebook.get("nbformat") != 4:
    raise ValueError(f"{path}: nbformat {notebook.get('nbformat')}, not 4")
  return ["".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code"]


def shell(command: str) -> None:
  subprocess.run(command, shell=True, check=True)


def translate(source: str) -> str:
  """Python for a cell: `!command` lines become shell calls (indentation kept); magics raise."""
  lines = []
  for number, line in enumerate(source.splitlines(), 1):
    stripped = line.lstrip()
    if stripped.startswith("%"):
      raise SyntaxError(f"line {number}: IPython magic {stripped.split()[0]!r} is not supported "
                        "by this runner")
    if stripped.startswith("!"):
      line = f"{line[:len(line) - len(stripped)]}__shell__({stripped[1:]!r})"
    lines.append(line)
  return "\n".join(lines)


class Display:
  """The kernel's display(): records what a cell shows."""

  def __init__(self):
    self.shown: list[dict] = []

  def __call__(self, *objects, raw: bool = False, **_) -> None:
    for obj in objects:
      bundle = obj if raw and isinstance(obj, dict) else {"text/plain": repr(obj)}
      for mime, data in bundle.items():
        entry = {"mime": mime}
        if mime == "image/png":
          png = base64.b64decode(data) if isinstance(data, str) else data
          entry.update(bytes=len(png), is_png=png.startswith(PNG_SIGNATURE))
        elif mime == "text/plain":
          entry["text"] = data[:200]
        self.shown.append(entry)


def run_cell(source: str, namespace: dict, index: int) -> None:
  """exec's the cell; a last expression statement is evaluated and displayed (unless None)."""
  tree = ast.parse(translate(source), filename=f"<cell {index}>")
  last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
  exec(compile(tree, f"<cell {index}>", "exec"), namespace)
  if last is not None:
    value = eval(compile(ast.Expression(last.value), f"<cell {index}>", "eval"), namespace)
    if value is not None:
      namespace["display"](value)


def main(notebook: str, report: str) -> int:
  display = Display()
  namespace = {"__name__": "__main__", "display": display, "__shell__": shell}
  cells = code_cells(notebook)
  run = 0
  status = 0
  for index, source in enumerate(cells):
    try:
      run_cell(source, namespace, index)
    except BaseException:  # noqa: BLE001  (SystemExit too: a cell that exits failed)
      print(f"notebook code cell {index} raised:", file=sys.stderr)
      traceback.print_exc()
      status = 1
      break
    run += 1
  with open(report, "w") as f:
    json.dump({"cells": len(cells), "cells_run": run, "displayed": display.shown}, f)
  return status


if __name__ == "__main__":
  sys.exit(main(*sys.argv[1:]))
