"""Named RL recipes: each is a set of defaults for the `rl` section of a config, assembled from
the pure pieces in rl/core/advantages.py, rl/core/losses.py and rl/rewards/shaping.py
(docs/rl_algorithms.md gives every formula and default).

A config selects one with `config.rl = recipe("dapo")` and may override any field from the
command line (`--config.rl.clip_high=0.3`). Unknown recipe names and bad values fail in
`validate_rl` with the field and the allowed values. A recipe names entries of the registries
(rl/core/registry.py): its advantage estimator, policy loss and KL estimator; the allowed
names are the registries' entries when `validate_rl` runs, so an entry registered in a user's
module (`@advantages.register_estimator`, `@losses.register_policy_loss`) is a valid value
once that module is imported. The estimator's entry decides whether the run trains a critic
(`needs_critic`).
"""

from __future__ import annotations

from typing import Any

from rl.core import advantages, losses
from rl.core.checks import domain_values

REWARD_MODES = ("verify", "dapo")
CRITIC_INITS = ("policy", "random")

# Every recipe starts from these and changes what its paper changes.
BASE: dict[str, Any] = dict(
    estimator="grpo",  # advantage estimator (rl/core/advantages.py)
    gamma=1.0,  # discount of later tokens' rewards (GAE, REINFORCE++)
    lam=1.0,  # GAE lambda of the policy's advantages
    lam_critic=1.0,  # GAE lambda of the critic's returns (decoupled GAE when != lam)
    length_adaptive_alpha=0.0,  # > 0: lam_policy = 1 - 1/(alpha * length) (VAPO)
    clip_low=0.2,  # the PPO ratio is clipped below at 1 - clip_low
    clip_high=0.2,  # ... and clipped above at 1 + clip_high (DAPO's clip-higher: 0.28)
    clip_c=0.0,  # dual-clip constant (> 1 turns it on)
    policy_loss="ppo_clip",  # the PPO clipped surrogate (spec section 1)
    loss_agg_mode="token-mean",  # how token losses average into one (rl/core/losses.py AGG_MODES)
    kl_coef=0.0,  # beta; 0 skips the reference model entirely
    kl_kind="k3",  # estimator of the KL to the reference policy
    # "domain=beta,...": a row's beta by its domain (a puzzle's task, else the record's
    # domain), overriding kl_coef (DeepSeek-V3.2); `kl_coefs_by_domain` parses it.
    kl_coef_per_domain="",
    entropy_coef=0.0,  # weight of the entropy bonus
    # The critic's start: "policy" (the policy's starting weights, e.g. its SFT checkpoint, with
    # a fresh scalar head; VAPO, verl) or "random" (its own initialisation).
    critic_init="policy",
    critic_warmup_steps=0,  # value pretraining steps before any actor update (VAPO)
    value_clip=0.5,  # clip range of the critic's value update
    nll_coef=0.0,  # positive-example LM loss weight mu (VAPO)
    dynamic_sampling=False,  # drop groups whose accuracy has zero std, refill (DAPO)
    max_num_gen_batches=4,  # dynamic sampling: generation batches per step at most
    # At that cap with the batch still short: False stops the run with an error naming the
    # fields; True fills the rest with the uniform groups seen (all-correct or all-wrong: zero
    # GRPO advantage unless shaping varies the scores) and counts them (`filled_groups`).
    fill_at_cap=False,
    overlong_buffer=0,  # L_cache in tokens; 0 turns overlong shaping off
    overlong_factor=1.0,  # the overlong penalty at the end of the budget
    overlong_filter=False,  # truncated responses get zero loss weight
    offpolicy_mask_delta=0.0,  # > 0: DeepSeek-V3.2 off-policy sequence masking
    indexer_coef=0.0,  # DSA models: weight of the indexer KL loss during RL (0: indexer frozen)
    keep_routing=False,  # the update replays the rollout's MoE routing (DeepSeek-V3.2)
    keep_sampling_mask=False,  # the update uses the sampler's top-p / top-k kept set (V3.2)
    reward_mode="verify",  # "dapo": +1 correct / -1 wrong
    ppo_epochs=1,  # passes over each step's batch
)

RECIPES: dict[str, dict[str, Any]] = {
    "ppo": dict(estimator="gae", lam=0.95, lam_critic=0.95),
    "grpo": dict(loss_agg_mode="seq-mean-token-mean", kl_coef=0.04, kl_kind="k3"),
    "dr_grpo": dict(estimator="dr_grpo", loss_agg_mode="seq-mean-token-sum-norm"),
    "rloo": dict(estimator="rloo"),
    "reinforce_pp": dict(estimator="reinforce_pp"),
    "dapo": dict(clip_low=0.2, clip_high=0.28, dynamic_sampling=True, overlong_buffer=4096,
                 reward_mode="dapo"),
    "vapo": dict(estimator="gae", critic_warmup_steps=10, lam=1.0,
                 lam_critic=1.0, length_adaptive_alpha=0.05, clip_low=0.2, clip_high=0.28,
                 nll_coef=0.1, reward_mode="dapo"),
    # DeepSeek-V3.2 section 3.1: A_i = R_i - mean(R), the group mean alone (no std division).
    "grpo_v32": dict(estimator="dr_grpo", loss_agg_mode="seq-mean-token-mean", kl_coef=0.01,
                     kl_kind="unbiased", offpolicy_mask_delta=0.1, keep_routing=True,
                     keep_sampling_mask=True),
}


def recipe(name: str) -> dict[str, Any]:
  """The full `rl` section for a named recipe."""
  if name not in RECIPES:
    raise ValueError(f"RL recipe {name!r}: must be one of {sorted(RECIPES)}")
  return {**BASE, **RECIPES[name]}


def kl_coefs_by_domain(text: str) -> dict[str, float]:
  """"math=0.01,code=0" -> {"math": 0.01, "code": 0.0}; ValueError naming the field and a bad
  item (each beta finite and >= 0, each domain once)."""
  try:
    return domain_values(text, "beta")
  except ValueError as e:
    raise ValueError(f"config.rl.kl_coef_per_domain={text!r}: {e}") from None


def needs_critic(rl: Any) -> bool:
  """Whether the run trains a critic: the registered estimator `rl["estimator"]` reads its
  values (`needs_values`); the trainer, the placement planner and the dry run ask this."""
  return advantages.ESTIMATOR_REGISTRY[rl["estimator"]].needs_values


def kl_on(rl: Any) -> bool:
  """Whether the update has a KL term to the reference policy (and so the run keeps a reference
  model and the batch its log-probs): kl_coef or kl_coef_per_domain set."""
  return bool(rl["kl_coef"] or rl["kl_coef_per_domain"])


def validate_rl(rl: Any) -> None:
  """Checks the `rl` section; raises ValueError naming the field and the allowed values (the
  registries' entries at call time)."""
  def check(field, allowed):
    value = rl[field]
    if value not in allowed:
      raise ValueError(f"config.rl.{field}={value!r}: must be one of {list(allowed)}")
  advantages.ESTIMATOR_REGISTRY[rl["estimator"]]  # an unknown name: the registry's error
  losses.POLICY_LOSS_REGISTRY[rl["policy_loss"]]
  losses.KL_REGISTRY[rl["kl_kind"]]
  check("loss_agg_mode", losses.AGG_MODES)
  check("reward_mode", REWARD_MODES)
  check("critic_init", CRITIC_INITS)
  if not 0 <= rl["clip_low"] < 1:
    raise ValueError(f"config.rl.clip_low={rl['clip_low']}: must be in [0, 1)")
  if rl["clip_high"] < 0:
    raise ValueError(f"config.rl.clip_high={rl['clip_high']}: must be >= 0")
  if rl["clip_c"] and rl["clip_c"] <= 1:
    raise ValueError(f"config.rl.clip_c={rl['clip_c']}: dual-clip needs c > 1 (0 turns it off)")
  if rl["ppo_epochs"] < 1:
    raise ValueError(f"config.rl.ppo_epochs={rl['ppo_epochs']}: must be >= 1")
  kl_coefs_by_domain(rl["kl_coef_per_domain"])
  if rl["max_num_gen_batches"] < 1:
    raise ValueError(f"config.rl.max_num_gen_batches={rl['max_num_gen_batches']}: must be >= 1")
