"""Pipeline stages of Llama 3: run in order they are the model, and keep its names."""

from __future__ import annotations

import pytest
import torch

from simplefsdp.models.llama3 import (
    Transformer,
    get_config,
    layer_ranges,
    pipeline_split,
    stage_ids_for_rank,
)


def _model():
    torch.manual_seed(0)
    return Transformer(get_config("debug", dim=32, n_layers=4, n_heads=4, n_kv_heads=2))


@pytest.mark.parametrize(
    "num_stages,layers_per_stage,expected",
    [
        (2, None, [2, 2]),
        (3, None, [2, 1, 1]),
        (4, None, [1, 1, 1, 1]),
        (2, [1, 3], [1, 3]),
        (3, [2, 0, 2], [2, 0, 2]),
    ],
)
def test_stages_in_order_are_the_model(num_stages, layers_per_stage, expected):
    model = _model()
    tokens = torch.randint(0, model.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    stages = pipeline_split(model, range(num_stages), num_stages, layers_per_stage=layers_per_stage)
    assert [len(s.layers) for s in stages] == expected
    h = tokens
    for stage in stages:
        h = stage(h)
    assert torch.equal(h, model(tokens))
    # names are kept: the stages' state dicts partition the model's
    keys = [set(s.state_dict()) for s in stages]
    assert set().union(*keys) == set(model.state_dict())
    assert sum(len(k) for k in keys) == len(model.state_dict())
    assert stages[0].tok_embeddings is not None and stages[-1].output is not None
    assert all(s.tok_embeddings is None for s in stages[1:])
    assert all(s.output is None and s.norm is None for s in stages[:-1])


def test_meta_stage_materialises_only_what_it_holds():
    with torch.device("meta"):
        model = Transformer(get_config("debug", dim=32, n_layers=4, n_heads=4, n_kv_heads=2))
    (middle,) = pipeline_split(model, [1], 3)
    middle.to_empty(device="cpu")
    middle.init_weights(buffer_device="cpu")
    assert sorted(middle.layers) == ["2"]
    assert all(not p.is_meta for p in middle.parameters())
    assert middle(torch.randn(2, 8, 32)).shape == (2, 8, 32)


def test_interleaved_stage_ids_and_errors():
    assert stage_ids_for_rank(1, 2, stages_per_rank=2) == [1, 3]
    assert [list(r) for r in layer_ranges(5, 2)] == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="valid stage counts: 1..4"):
        layer_ranges(4, 5)
    with pytest.raises(ValueError, match=r"summing to the model's 4 layers"):
        layer_ranges(4, 2, [1, 2])
    with pytest.raises(ValueError, match=r"stage id 2 out of range for 2 stages; valid: 0..1"):
        pipeline_split(_model(), [2], 2)
    with pytest.raises(ValueError, match="pp_rank 2 out of range for pp=2"):
        stage_ids_for_rank(2, 2)
