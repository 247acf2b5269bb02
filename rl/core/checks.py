"""InputError, what a launcher prints as one line, and the field checks that section checkers
share. It imports nothing of the project: every module that checks a config section (or reads
input files) can import it."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any


class InputError(ValueError):
  """Bad input named in the message (a config field, a path, a data record with its file and
  line): the launchers print it as one line and exit with status 2."""


def allowed(field: str, value: Any, choices: Iterable) -> None:
  """ValueError unless `value` is one of `choices`; `field` is the dotted name under config."""
  choices = list(choices)
  if value not in choices:
    raise ValueError(f"config.{field}={value!r}: must be one of {choices}")


def positive(section: Mapping[str, Any], name: str, *fields: str) -> None:
  """Each of `fields` of config.<name> is positive and finite."""
  for f in fields:
    value = section[f]
    if not (value > 0 and math.isfinite(value)):  # NaN compares False: it fails here too
      raise ValueError(f"config.{name}.{f}={value!r}: must be positive and finite")


def non_negative(section: Mapping[str, Any], name: str, *fields: str) -> None:
  """Each of `fields` of config.<name> is >= 0 and finite."""
  for f in fields:
    value = section[f]
    if not (value >= 0 and math.isfinite(value)):
      raise ValueError(f"config.{name}.{f}={value!r}: must be >= 0 and finite")


def domain_values(text: str, value_name: str = "value") -> dict[str, float]:
  """"math=0.01,code=0" -> {"math": 0.01, "code": 0.0}: the one reader of per-domain numbers in
  a config string. ValueError "'<item>' is not domain=<value_name> (each domain once, <value_name>
  finite and >= 0)" on the first bad item."""
  values: dict[str, float] = {}
  for item in filter(None, (i.strip() for i in text.split(","))):
    domain, sep, number = (p.strip() for p in item.partition("="))
    try:
      value = float(number)
    except ValueError:
      value = -1.0
    if not sep or not domain or domain in values or not (value >= 0 and math.isfinite(value)):
      raise ValueError(f"{item!r} is not domain={value_name} (each domain once, {value_name} "
                       "finite and >= 0)")
    values[domain] = value
  return values
