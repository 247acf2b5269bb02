"""The layer contracts of pyproject.toml, checked by import-linter (`lint-imports`, also run by
CI on its own): launch -> configs -> rl -> models -> kernels with no upward imports; inside rl,
o1_coder -> jobs -> config -> tool_use -> data | parallel | rollout -> rewards | core; and no
import cycle between sibling modules or packages anywhere.

configs/ holds only recipes; the schema they fill in, its defaults and its checks are rl/config/,
so rl never reads configs.
"""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lint_imports(cwd: str, *args: str) -> subprocess.CompletedProcess:
  env = dict(os.environ, PYTHONPATH=cwd)
  main = "import sys; from importlinter.cli import lint_imports_command as m; sys.exit(m())"
  return subprocess.run([sys.executable, "-c", main, *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=300)


def test_the_repository_keeps_its_layer_contracts():
  out = _lint_imports(ROOT)
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
  assert "3 kept, 0 broken" in out.stdout, out.stdout[-2000:]


def test_a_function_local_upward_import_breaks_the_contract(tmp_path):
  """The checker sees a deferred import inside a function (models/planner.py once had two),
  the way the repository's contracts are written."""
  for package in ("low", "high"):
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
  (tmp_path / "high" / "a.py").write_text("import low\n")
  (tmp_path / "low" / "b.py").write_text(textwrap.dedent("""\
      def f():
        from high import a
        return a
      """))
  (tmp_path / ".importlinter").write_text(textwrap.dedent("""\
      [importlinter]
      root_packages =
          high
          low

      [importlinter:contract:layers]
      name = high -> low
      type = layers
      layers =
          high
          low
      """))
  out = _lint_imports(str(tmp_path), "--config", ".importlinter")
  assert out.returncode != 0 and "low.b -> high.a" in out.stdout, out.stdout[-2000:]
