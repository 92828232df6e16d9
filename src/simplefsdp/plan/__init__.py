"""``simplefsdp plan``: predict per-GPU memory and step time of Llama 3 training
jobs on GPU clusters from traced graphs (bf16 or float8), and of
mixture-of-experts jobs with expert parallelism from their shapes
(``simplefsdp.plan.moe``), on a machine without GPUs.

See ``docs/scale.md`` for the model and its validation against published
measurements.
"""

from simplefsdp.plan.hardware import PROFILES, HardwareProfile, get_profile, load_profile
from simplefsdp.plan.predict import Layout, Prediction, predict, validate

__all__ = [
    "PROFILES",
    "HardwareProfile",
    "Layout",
    "Prediction",
    "get_profile",
    "load_profile",
    "predict",
    "validate",
]
