"""The progress part of a training stage's log lines: percentage done, rate and ETA, from the
steps this process ran (a resumed leg's rate is its own, not diluted by the steps it skipped),
and the stage's place in a multi-stage job ("stage 1/2"), so that a line read mid-run says how
far the whole job is."""

from __future__ import annotations

import time


def duration(seconds: float) -> str:
  """A time span as a person reads it: 45s, 3m05s, 2h07m."""
  s = max(int(round(seconds)), 0)
  if s < 60:
    return f"{s}s"
  if s < 3600:
    return f"{s // 60}m{s % 60:02d}s"
  return f"{s // 3600}h{s % 3600 // 60:02d}m"


def rate(steps: int, seconds: float) -> str:
  """Steps per second when they are fast, seconds per step when they are slow."""
  if steps <= 0 or seconds <= 0:
    return "- steps/s"
  if steps >= seconds:
    return f"{steps / seconds:.1f} steps/s"
  return f"{seconds / steps:.1f} s/step"


class Progress:
  """Counts a stage's steps from `start` (the step this leg resumed at) to `total`.
  `stage` ("stage 1/2", or "" for a single-stage job) opens every line."""

  def __init__(self, total: int, *, start: int = 0, stage: str = ""):
    self.total, self.start = total, start
    self.prefix = f"[{stage}] " if stage else ""
    self.t0 = time.perf_counter()

  def eta_s(self, step: int, now: float | None = None) -> float:
    done = step - self.start
    elapsed = (time.perf_counter() if now is None else now) - self.t0
    return elapsed / done * (self.total - step) if done > 0 else float("nan")

  def suffix(self, step: int, now: float | None = None) -> str:
    """'12% 2.3 steps/s ETA 3m05s' after `step` of `total` steps."""
    now = time.perf_counter() if now is None else now
    eta = self.eta_s(step, now)
    return (f"{100 * step / max(self.total, 1):.0f}% {rate(step - self.start, now - self.t0)} "
            f"ETA {duration(eta) if eta == eta else '-'}")
