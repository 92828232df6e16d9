"""The eager executor's plan split by dtype: one flat buffer holds one dtype."""

from __future__ import annotations

import torch
import torch.nn as nn

from simplefsdp.bucket_plan import Bucket, BucketPlan
from simplefsdp.eager_executor.api import split_by_dtype


def _model() -> nn.Module:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.LayerNorm(4))
    model[1].to(torch.bfloat16)
    return model


def test_a_mixed_bucket_splits_by_dtype_in_order_of_first_appearance() -> None:
    fqns = ("0.weight", "1.weight", "0.bias", "1.bias", "2.weight", "2.bias")
    plan = BucketPlan((Bucket("blk", fqns), Bucket("rest", ("2.weight",))))
    split = split_by_dtype(_model(), plan, None)
    assert [(b.name, b.param_fqns) for b in split.buckets] == [
        ("blk[float32]", ("0.weight", "0.bias", "2.weight", "2.bias")),
        ("blk[bfloat16]", ("1.weight", "1.bias")),
        ("rest", ("2.weight",)),
    ]


def test_a_param_dtype_unifies_the_bucket() -> None:
    plan = BucketPlan((Bucket("blk", ("0.weight", "1.weight")),))
    assert split_by_dtype(_model(), plan, torch.bfloat16) == plan
