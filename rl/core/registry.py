"""Named implementations of one concept, selected by a config field: advantage estimators
(rl/core/advantages.py), policy losses and KL estimators (rl/core/losses.py). A recipe
(rl/core/algorithms.py) is a config naming entries of these registries; validation and lookup
read the registries when they run (an entry registered by a user's module after import is
allowed) and both name the field and the registered entries when a name is unknown.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Registry:
  """Entries by name, in registration order. `field` is the config field that names an entry
  (e.g. "config.rl.estimator"); an unknown name raises a one-line ValueError naming it and the
  registered entries."""

  def __init__(self, field: str):
    self.field = field
    self._entries: dict[str, Any] = {}

  def add(self, name: str, entry: Any) -> None:
    if name in self._entries:
      raise ValueError(f"{self.field}: {name!r} is registered twice")
    self._entries[name] = entry

  def register(self, name: str) -> Callable:
    """Decorator: registers the function under `name` and returns it unchanged."""
    def decorate(fn):
      self.add(name, fn)
      return fn
    return decorate

  def remove(self, name: str) -> None:
    """Unregisters `name` (an unknown name raises like a lookup): for an entry registered for a
    while only, e.g. by a test."""
    self[name]
    del self._entries[name]

  def names(self) -> tuple[str, ...]:
    return tuple(self._entries)

  def __getitem__(self, name: str) -> Any:
    if name not in self._entries:
      raise ValueError(f"{self.field}={name!r}: must be one of {list(self._entries)}")
    return self._entries[name]
