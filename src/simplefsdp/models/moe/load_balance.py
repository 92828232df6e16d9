"""Load balancing and expert-load metrics of MoE layers: the shared
implementation (:mod:`simplefsdp.models.common.load_balance`) under the
family's name."""

from simplefsdp.models.common.load_balance import (  # noqa: F401 (re-exported for the moe package)
    ExpertLoad,
    expert_load,
    update_expert_bias,
)
