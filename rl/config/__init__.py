"""The run config's schema: what every `configs/*.py` recipe starts from and what checks it.

  defaults.py    base_config(): every section and field with its default
  validation.py  validate() (start-up checks, one per section) and check_paths() (run start)
  describe.py    a config's dotted leaves; the preset / recipe it is closest to

A section's checker lives beside the code that reads the section (rl/data/entries.py,
rl/data/curriculum.py, rl/tool_use/environments.py, rl/parallel/placement.py,
rl/rollout/fp8.py, rl/core/algorithms.py); validation.py calls each of them and holds the
cross-section checks and those of sections whose reader has none. The field checks they share
(and InputError) are rl/core/checks.py; config.model -> ModelConfig and the policy it builds are
rl/core/policy.py (both below every section's reader).
"""
