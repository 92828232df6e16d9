"""``simplefsdp plan``: predict per-GPU memory and step time of training jobs
on GPU clusters, on a machine without GPUs.

A job is a flavor of a model family (its ``ModelSpec`` and config, from
:mod:`simplefsdp.models.registry`), a layout and a hardware profile;
:func:`predict` predicts it by the spec's ``plan_method``: from traced graphs
(bf16 or float8) or, for expert-parallel models, from the config's shapes.
Either way the result is one :class:`Prediction`.

See ``docs/scale.md`` for the model and its validation against published
measurements.
"""

from simplefsdp.plan.hardware import PROFILES, HardwareProfile, get_profile, load_profile
from simplefsdp.plan.predict import Layout, predict, validate
from simplefsdp.plan.prediction import Prediction
