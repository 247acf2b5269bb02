"""Remote paths (gs://bucket/..., any scheme etils.epath serves) as a run reads and writes them,
and the start-of-run check that one answers.

Checkpoints, metrics and prompt files all go through etils.epath, the filesystem layer orbax
uses (gcsfs or TensorFlow's gfile underneath). Left to themselves, those libraries meet missing
credentials or an unreachable bucket with a minute of retries and pages of tracebacks, late in
the run. `preflight` asks first, with a deadline: the credentials (gs://: Google's default
credentials, as the client libraries look them up) and an answer from the storage for the path,
each failure one InputError naming the path.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable

from etils import epath

from rl.core.checks import InputError

# Seconds the whole check may take: a healthy bucket answers in well under one; credentials on a
# VM come from its metadata server, which answers in milliseconds (off a VM, google.auth's probe
# for it gives up within a few seconds).
PREFLIGHT_TIMEOUT_S = 20.0


def is_remote(path: str | os.PathLike) -> bool:
  return "://" in os.fspath(path)


def _one_line(error: BaseException) -> str:
  return " ".join(f"{type(error).__name__}: {error}".split())[:300]


def _within(deadline: float, fn: Callable[[], Any]) -> Any:
  """fn() in a daemon thread, given until `deadline` (time.monotonic()); TimeoutError past it.
  The thread is left behind then: it holds no lock, and the run ends on the error anyway."""
  outcome: dict[str, Any] = {}

  def call():
    try:
      outcome["value"] = fn()
    except BaseException as e:  # noqa: BLE001  (handed to the caller below)
      outcome["error"] = e

  thread = threading.Thread(target=call, name="storage-preflight", daemon=True)
  thread.start()
  thread.join(max(deadline - time.monotonic(), 0.0))
  if thread.is_alive():
    raise TimeoutError
  if "error" in outcome:
    raise outcome["error"]
  return outcome["value"]


def _google_credentials() -> None:
  """Google's application default credentials, found as gcsfs and google-cloud-storage find
  them; DefaultCredentialsError when there are none. Without google-auth installed there is
  nothing to ask: the filesystem's own answer below reports the path."""
  try:
    import google.auth
  except ImportError:
    return
  google.auth.default()


def preflight(path: str | os.PathLike, what: str, *, timeout_s: float | None = None) -> None:
  """For a remote `path` (a local one is left to the caller): credentials and an answer from
  the storage (whether the path exists or not) within `timeout_s` seconds (default
  PREFLIGHT_TIMEOUT_S). Any failure is an InputError starting `{what}={path}:`."""
  path = os.fspath(path)
  if not is_remote(path):
    return
  timeout_s = PREFLIGHT_TIMEOUT_S if timeout_s is None else timeout_s
  deadline = time.monotonic() + timeout_s
  where = f"{what}={path}"
  if path.startswith("gs://"):
    try:
      _within(deadline, _google_credentials)
    except TimeoutError:
      raise InputError(f"{where}: looking up Google Cloud credentials took over {timeout_s:.0f} "
                       "s (no metadata server answering?); set GOOGLE_APPLICATION_CREDENTIALS "
                       "or run `gcloud auth application-default login`") from None
    except Exception as e:  # noqa: BLE001  (google.auth's errors, whatever their class)
      raise InputError(f"{where}: no usable Google Cloud credentials ({_one_line(e)}); run "
                       "`gcloud auth application-default login` or set "
                       "GOOGLE_APPLICATION_CREDENTIALS") from None
  try:
    _within(deadline, epath.Path(path).exists)
  except TimeoutError:
    raise InputError(f"{where}: no answer from the storage in {timeout_s:.0f} s (network, "
                     "permissions or the bucket's name?)") from None
  except ImportError as e:  # epath names the client library the scheme needs
    raise InputError(f"{where}: {_one_line(e)}") from None
  except Exception as e:  # noqa: BLE001  (the storage client's errors, whatever their class)
    raise InputError(f"{where}: the storage refused ({_one_line(e)})") from None
