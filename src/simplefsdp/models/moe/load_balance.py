"""Load balancing and expert-load metrics of MoE layers: the shared
implementation (:mod:`simplefsdp.models.common.load_balance`) under the
family's name."""

from simplefsdp.models.common.load_balance import (
    ExpertLoad,
    expert_load,
    expert_load_metrics,
    update_expert_bias,
)

__all__ = ["ExpertLoad", "expert_load", "expert_load_metrics", "update_expert_bias"]
