"""The layer contract: launch -> configs -> rl -> models -> kernels, no upward imports.

configs/ holds only recipes (ml_collections files and their helpers); the schema they fill in,
its defaults and its checks are rl/config/, so rl never reads configs.

Every import statement of a package's modules, function-local ones included, is read with
`ast`; an import of a higher layer fails with the module and line. (import-linter would check
the same from the installed package; this needs nothing beyond the standard library.)
"""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# package -> the project packages it must not import
FORBIDDEN = {
    "kernels": {"models", "rl", "configs", "launch"},
    "models": {"rl", "configs", "launch"},
    "rl": {"configs", "launch"},
    "configs": {"launch"},
}


def _imports(path: str):
  """(line, top-level package) of every import in the file."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for alias in node.names:
        yield node.lineno, alias.name.split(".")[0]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      yield node.lineno, node.module.split(".")[0]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_upward_imports(package):
  bad = []
  for folder, _, files in os.walk(os.path.join(ROOT, package)):
    for name in sorted(files):
      if name.endswith(".py"):
        path = os.path.join(folder, name)
        bad += [f"{os.path.relpath(path, ROOT)}:{line} imports {top}"
                for line, top in _imports(path) if top in FORBIDDEN[package]]
  assert not bad, "\n".join(bad)


def test_the_check_sees_function_local_imports(tmp_path):
  """A deferred import inside a function is an import too (models/planner.py had two)."""
  path = tmp_path / "m.py"
  path.write_text("def f():\n  from configs import common\n  return common\n")
  assert list(_imports(str(path))) == [(2, "configs")]
