"""The progress part of the training stages' log lines (rl/jobs/progress.py): durations as a
person reads them, the rate in the unit that keeps it readable, and a resumed leg's rate and
ETA from the steps it ran itself."""

from rl.jobs import progress


def test_duration_and_rate_formats():
  """Seconds under a minute, minutes and seconds under an hour, then hours and minutes
  (rounded to the second first); fast steps per second, slow ones seconds per step."""
  assert [progress.duration(s) for s in (0, 59.4, 59.6, 185, 3599, 7620, -3)] == [
      "0s", "59s", "1m00s", "3m05s", "59m59s", "2h07m", "0s"]
  assert progress.rate(10, 4) == "2.5 steps/s"
  assert progress.rate(2, 25) == "12.5 s/step"
  assert progress.rate(0, 5) == "- steps/s"


def test_progress_of_a_resumed_stage():
  """A stage of 100 steps resumed at step 20, 10 s after its start at step 40: 40% done, 20
  steps in 10 s (the 20 skipped steps do not count), 60 left at 2 steps/s: ETA 30 s. Before its
  first step there is no rate to extrapolate. The job stage opens the line."""
  p = progress.Progress(100, start=20, stage="stage 1/2")
  p.t0 = 0.0
  assert p.prefix == "[stage 1/2] "
  assert p.suffix(40, now=10.0) == "40% 2.0 steps/s ETA 30s"
  assert p.suffix(20, now=1.0) == "20% - steps/s ETA -"
  assert progress.Progress(5).prefix == ""
