"""Reading a config back: its dotted leaves, the model preset and RL recipe it is closest to
(what the dry run, the plan and a run's results name), and what each field means (`field_notes`,
what `launch/train.py --help` lists)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import tokenize

import ml_collections

from models import config as model_config_lib
from models.config import PRESETS, get_config as get_model_config
from rl.config import defaults
from rl.core import algorithms


def leaves(c: ml_collections.ConfigDict | dict, prefix: str = "") -> dict:
  """{dotted field name: value} of every leaf of a config ("rl.clip_high", "mesh.shape.data")."""
  out = {}
  for key, value in c.items():
    if isinstance(value, (dict, ml_collections.ConfigDict)):
      out.update(leaves(value, f"{prefix}{key}."))
    else:
      out[prefix + key] = value
  return out


def closest(values: dict, named: dict[str, dict]) -> str:
  """The name in `named` whose fields `values` matches on most, with the fields that differ:
  "dapo" or "dapo (clip_high=0.3, kl_coef=0.01)"."""
  def changes(name):
    return [f"{k}={v!r}" for k, v in values.items() if named[name].get(k) != v]
  name = min(named, key=lambda n: len(changes(n)))
  return name + (f" ({', '.join(changes(name))})" if changes(name) else "")


def describe_model(c: ml_collections.ConfigDict) -> str:
  """config.model as the closest preset and the fields that differ from it."""
  presets = {p: dataclasses.asdict(get_model_config(p)) for p in sorted(PRESETS)}
  return closest(c.model.to_dict(), presets)


def describe_rl(c: ml_collections.ConfigDict) -> str:
  """config.rl as the closest recipe (rl/core/algorithms.py) and the fields that differ from it."""
  return closest(c.rl.to_dict(),
                 {r: algorithms.recipe(r) for r in sorted(algorithms.RECIPES)})


def field_notes() -> dict[str, str]:
  """{dotted field or section name: its meaning in one sentence} for base_config's schema, read
  from the comments beside the defaults, so there is one copy of each: rl/config/defaults.py
  (sections and fields), models/config.py ModelConfig (config.model) and rl/core/algorithms.py
  BASE (config.rl). A field's note is the comment on its first line, else the comment block
  just above it (a block above several fields is the first one's: its text names the others);
  a field with neither has none."""
  tree, comments = _parsed(defaults)
  base = next(n for n in ast.walk(tree)
              if isinstance(n, ast.FunctionDef) and n.name == "base_config")
  sections = [(s.targets[0].attr, s) for s in base.body
              if isinstance(s, ast.Assign) and isinstance(s.targets[0], ast.Attribute)]
  notes = _notes(sections, comments)
  for name, statement in sections:
    if name == "model":
      model_tree, model_comments = _parsed(model_config_lib)
      cls = next(n for n in ast.walk(model_tree)
                 if isinstance(n, ast.ClassDef) and n.name == "ModelConfig")
      notes.update(_notes([(f"model.{f.target.id}", f) for f in cls.body
                           if isinstance(f, ast.AnnAssign)], model_comments))
    elif name == "rl":
      rl_tree, rl_comments = _parsed(algorithms)
      table = next(n for n in ast.walk(rl_tree) if isinstance(n, ast.AnnAssign)
                   and getattr(n.target, "id", "") == "BASE")
      notes.update(_keyword_notes("rl.", table.value, rl_comments))
    else:
      notes.update(_keyword_notes(f"{name}.", statement.value, comments))
  schema = leaves(defaults.base_config())
  groups = {name.rsplit(".", 1)[0] for name in schema if "." in name}
  # ModelConfig's kernel_backend is not a config.model field (model_section drops it).
  return {name: note for name, note in notes.items() if name in schema or name in groups}


def _parsed(module) -> tuple[ast.Module, dict[int, tuple[str, bool]]]:
  """A module's syntax tree and {line: (comment text, whether the line is only the comment)};
  headings ("# --- MoE ---") name a group of fields, not one, and are left out."""
  source = inspect.getsource(module)
  comments = {}
  for token in tokenize.generate_tokens(io.StringIO(source).readline):
    if token.type == tokenize.COMMENT and not token.string.startswith("# ---"):
      comments[token.start[0]] = (token.string.lstrip("#").strip(),
                                  not token.line[:token.start[1]].strip())
  return ast.parse(source), comments


def _keyword_notes(prefix: str, node: ast.AST, comments: dict, *,
                   parent_line: int = 0) -> dict[str, str]:
  """Notes of the keywords of the dict(...) call in `node` (inside ConfigDict(...) or not),
  with those of nested dict(...) values under the keyword's name; keywords on the line of the
  one holding them (`shape=dict(data=-1, ...)`) have no comment of their own."""
  if isinstance(node, ast.Call) and not node.keywords and node.args:
    node = node.args[0]
  if not isinstance(node, ast.Call):
    return {}
  notes = _notes([(prefix + k.arg, k) for k in node.keywords if k.lineno != parent_line],
                 comments)
  for keyword in node.keywords:
    notes.update(_keyword_notes(f"{prefix}{keyword.arg}.", keyword.value, comments,
                                parent_line=keyword.lineno))
  return notes


def _notes(fields: list[tuple[str, ast.AST]], comments: dict) -> dict[str, str]:
  """{name: note} of fields (name, syntax node): the first sentence of the comment on the
  node's first line, else of the comment block just above it."""
  notes = {}
  for name, node in fields:
    text, alone = comments.get(node.lineno, ("", True))
    if alone:
      above, line = [], node.lineno - 1
      while comments.get(line, ("", False))[1]:
        above.insert(0, comments[line][0])
        line -= 1
      text = " ".join(above)
    sentence = re.split(r"(?<=\.)(?<!e\.g\.)(?<!i\.e\.)\s+(?=[A-Z(\"])", text, maxsplit=1)[0]
    if sentence:
      notes[name] = sentence
  return notes
