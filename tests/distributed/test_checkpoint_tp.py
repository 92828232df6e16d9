"""simplefsdp.checkpoint across tensor-parallel layouts, on 4 CPU processes.

A shrunk Llama 3 (dim 32, 2 layers, 4 heads, 2 KV heads) under the Llama 3 TP
plan (``apply_tensor_parallel``, sequence parallel: norms are ``Replicate``
on tp) then ``data_parallel`` on (dp 2, tp 2) trains one AdamW step and is
saved; its parameters are DTensors on the 2-D mesh (``_StridedShard`` where
dp and tp shard the same dim) and the optimizer state likewise. The
checkpoint loads bitwise into a 1-D dp4 model, a fresh (dp2, tp2) model and
a (dp1, tp4) model (an FFN-and-embeddings plan: ``n_kv_heads=2`` rules out
the attention plan at tp4); a dp4 checkpoint loads back into (dp2, tp2).
The safetensors export of the 2-D checkpoint equals that of the 1-D one,
key for key, bitwise.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from simplefsdp.testing import run_distributed

BATCH, SEQ = 4, 8  # SEQ divisible by every TP size (sequence parallel)


def _args():
    from simplefsdp.models.llama3 import get_config

    return get_config("debug", dim=32, n_layers=2, n_heads=4, n_kv_heads=2)


def _ffn_plan(model) -> dict:
    """A TP plan that tp=4 allows here: embeddings, output and feed-forwards only."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(len(model.layers)):
        ffn = f"layers.{i}.feed_forward."
        plan[ffn + "w1"] = ColwiseParallel()
        plan[ffn + "w3"] = ColwiseParallel()
        plan[ffn + "w2"] = RowwiseParallel()
    return plan


def _model(dp: int, tp: int):
    """The model on a (dp, tp) mesh (``tp == 1``: 1-D data parallel), and its optimizer."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    import simplefsdp
    from simplefsdp.models.llama3 import Transformer
    from simplefsdp.models.llama3.tensor_parallel import apply_tensor_parallel

    torch.manual_seed(0)
    model = Transformer(_args())
    if tp == 1:
        simplefsdp.data_parallel(model, init_device_mesh("cpu", (dp,)))
    else:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        if tp == 2:
            apply_tensor_parallel(model, mesh["tp"], sequence_parallel=True)
        else:
            parallelize_module(model, mesh["tp"], _ffn_plan(model))
        simplefsdp.data_parallel(model, mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full(tensor: torch.Tensor) -> np.ndarray:
    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return full.detach().clone().numpy()


def _gathered(model, optimizer) -> dict[str, np.ndarray]:
    """Every parameter's and AdamW state tensor's full value, by name."""
    import simplefsdp

    out = {}
    with simplefsdp.disable_parametrization():
        for name, param in model.named_parameters():
            out[name] = _full(param)
            for key, value in optimizer.state.get(param, {}).items():  # no new entries
                out[f"{name}.{key}"] = _full(value)
    return out


def _placements(model) -> dict[str, str]:
    import simplefsdp

    with simplefsdp.disable_parametrization():
        return {n: str(p.placements) for n, p in model.named_parameters()}


def _train_step(model, optimizer, dp: int) -> None:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, _args().vocab_size, (BATCH, SEQ + 1), generator=g)
    rank = dist.get_rank() // (dist.get_world_size() // dp)  # the dp coordinate
    rows = tokens[rank * BATCH // dp : (rank + 1) * BATCH // dp]
    logits = model(rows[:, :-1])
    F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def _body(folder_2d: str, folder_1d: str) -> dict:
    import simplefsdp.checkpoint as ckpt
    from simplefsdp.checkpoint import CONFIG_NAME

    config = {CONFIG_NAME: {"model_args": dataclasses.asdict(_args())}}
    out = {}
    model, optimizer = _model(2, 2)
    _train_step(model, optimizer, dp=2)
    out["placements"] = _placements(model)
    ckpt.save(model, optimizer, folder_2d, json_files=config, step=1)
    out["saved"] = _gathered(model, optimizer)
    for name, (dp, tp) in {"dp4": (4, 1), "dp2_tp2": (2, 2), "dp1_tp4": (1, 4)}.items():
        model, optimizer = _model(dp, tp)
        if name == "dp2_tp2":
            out["fresh"] = _gathered(model, optimizer)  # initial weights, no AdamW state
        ckpt.load(model, optimizer, folder_2d)
        out[name] = _gathered(model, optimizer)
        if name == "dp4":  # the same weights and state saved 1-D ...
            ckpt.save(model, optimizer, folder_1d, json_files=config, step=1)
    model, optimizer = _model(2, 2)  # ... and loaded back into (dp2, tp2)
    ckpt.load(model, optimizer, folder_1d)
    out["dp4_to_dp2_tp2"] = _gathered(model, optimizer)
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from simplefsdp.checkpoint import step_dir_name

    root = tmp_path_factory.mktemp("ckpt_tp")
    folders = (root / "dp2_tp2" / step_dir_name(1), root / "dp4" / step_dir_name(1))
    ranks = run_distributed(_body, 4, args=tuple(str(f) for f in folders))
    return folders, ranks


def test_saved_layout_is_two_dimensional(checkpoints):
    _, ranks = checkpoints
    placements = ranks[0]["placements"]
    assert "_StridedShard" in placements["layers.0.attention.wq.weight"]
    assert "Replicate" in placements["layers.0.attention_norm.weight"]  # sequence parallel
    assert any(k.endswith(".exp_avg_sq") for k in ranks[0]["saved"])
    fresh = ranks[0]["fresh"]
    assert fresh.keys() == set(placements)  # a fresh optimizer has no state yet ...
    # ... and the trained weights differ from the initial ones: loads are not no-ops.
    assert all(not np.array_equal(fresh[k], ranks[0]["saved"][k]) for k in fresh)


@pytest.mark.parametrize("layout", ["dp4", "dp2_tp2", "dp1_tp4", "dp4_to_dp2_tp2"])
def test_loads_bitwise_into_other_layouts(checkpoints, layout):
    _, ranks = checkpoints
    saved = ranks[0]["saved"]
    for rank, result in enumerate(ranks):
        got = result[layout]
        assert got.keys() == saved.keys(), (layout, rank)
        for key, value in saved.items():
            assert np.array_equal(got[key], value), (layout, rank, key)


def test_export_of_2d_checkpoint_equals_1d_export(checkpoints, tmp_path):
    from safetensors.torch import load_file

    from simplefsdp.checkpoint.export import export_checkpoint

    (folder_2d, folder_1d), ranks = checkpoints
    exported = {}
    for name, folder in {"2d": folder_2d, "1d": folder_1d}.items():
        weights, _ = export_checkpoint(folder, tmp_path / f"{name}.safetensors")
        exported[name] = load_file(str(weights))
    assert exported["2d"].keys() == exported["1d"].keys()
    params = {k for k in ranks[0]["saved"] if k in exported["2d"]}
    assert params == set(ranks[0]["placements"]), "every parameter is exported"
    for key, value in exported["2d"].items():
        assert value.dtype == exported["1d"][key].dtype, key
        assert torch.equal(value, exported["1d"][key]), key
        assert np.array_equal(value.numpy(), ranks[0]["saved"][key]), key
