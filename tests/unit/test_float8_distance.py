"""Float8 tensorwise training stays close to high-precision training.

One process, a small Llama 3 memorising one batch with AdamW: the same
initial weights and batches with and without torchao's float8 conversion
(as ``simplefsdp train --float8.enable true`` converts).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchao.float8")

STEPS = 8


def _losses(float8: bool) -> list[float]:
    from simplefsdp.frontend.float8 import convert_linears_to_float8
    from simplefsdp.models.llama3 import Transformer, get_config
    from simplefsdp.models.llama3.parallelize import cross_entropy

    torch.manual_seed(0)
    model = Transformer(get_config("debug", dim=64, n_layers=2, n_heads=4, n_kv_heads=2))
    model.init_weights()
    if float8:
        convert_linears_to_float8(model, "tensorwise")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 256, (4, 65), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(STEPS):
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_float8_training_stays_within_bound_of_high_precision():
    high, float8 = _losses(False), _losses(True)
    distance = max(abs(a - b) for a, b in zip(high, float8))
    # e4m3 keeps 3 mantissa bits: each cast rounds by up to 2**-4 relative,
    # errors that mostly cancel in the matmuls' sums; measured 0.003 over a
    # loss that falls by 1.4. A bound of 0.01 (0.2% of the loss) leaves room
    # for other BLAS summation orders, and would catch a wrong scale (a loss
    # off by whole units) or a cast that saturates.
    assert distance < 0.01, (high, float8)
    assert distance > 0, "float8 changed nothing: the layers were not converted"
    assert high[-1] < high[0] - 1.0 and float8[-1] < float8[0] - 1.0, (high, float8)
