"""RL algorithms as pure torch functions: advantage estimators, policy losses, KL and entropy, in registries chosen by name."""

from raytool.algos.advantages import ADV_ESTIMATORS, get_adv_estimator, grpo, rloo
from raytool.algos.losses import AGG_MODES, POLICY_LOSSES, get_policy_loss, masked_aggregate, ppo_clip
from raytool.algos.regularizers import KL_ESTIMATORS, entropy_from_logits, get_kl_estimator, kl_penalty

__all__ = [
    "ADV_ESTIMATORS", "get_adv_estimator", "grpo", "rloo",
    "AGG_MODES", "POLICY_LOSSES", "get_policy_loss", "masked_aggregate", "ppo_clip",
    "KL_ESTIMATORS", "get_kl_estimator", "kl_penalty", "entropy_from_logits",
]
