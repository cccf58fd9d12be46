"""Advantage estimators and policy losses: pure torch functions in registries, chosen by name."""

from raytool.algos.advantages import ADV_ESTIMATORS, get_adv_estimator
from raytool.algos.losses import POLICY_LOSSES, get_policy_loss, masked_aggregate

__all__ = ["ADV_ESTIMATORS", "get_adv_estimator", "POLICY_LOSSES", "get_policy_loss", "masked_aggregate"]
