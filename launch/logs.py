"""Console logging shared by the launch scripts: this project's INFO progress lines, and
warnings or errors from anywhere; library INFO chatter (orbax logs every checkpoint operation)
is dropped."""

import logging as pylogging
import os

from absl import logging

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _only_project_info(record) -> bool:
  return record.levelno >= pylogging.WARNING or record.pathname.startswith(_ROOT)


def setup() -> None:
  logging.set_verbosity(logging.INFO)
  logging.get_absl_handler().addFilter(_only_project_info)
