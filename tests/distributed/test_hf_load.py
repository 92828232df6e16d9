"""A Hugging Face Llama checkpoint loaded into sharded models, on 4 CPU processes.

A shrunk Llama 3 (dim 32, 2 layers, 4 heads, 2 KV heads) written with
``save_hf_checkpoint`` (several shards) is loaded with ``load_hf_weights`` into
a 1-D ``data_parallel`` model on 4 ranks and into a (dp 2, tp 2) model (the
Llama 3 TP plan, then ``data_parallel``: ``_StridedShard`` where dp and tp
shard the same dim). Each rank reads only its regions; the gathered
parameters equal the source bitwise, and each rank read about a quarter of
the elements (not the whole model).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.distributed.tensor import DTensor

from simplefsdp.testing import run_distributed


def _args():
    from simplefsdp.models.llama3 import get_config

    return get_config("debug", dim=32, n_layers=2, n_heads=4, n_kv_heads=2)


def _source() -> dict[str, torch.Tensor]:
    from simplefsdp.models.llama3 import Transformer

    torch.manual_seed(7)
    return {k: v.detach().clone() for k, v in Transformer(_args()).state_dict().items()}


def _body(folder: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import simplefsdp
    from simplefsdp.checkpoint.hf import load_hf_weights
    from simplefsdp.models.llama3 import Transformer
    from simplefsdp.models.llama3.tensor_parallel import apply_tensor_parallel

    out = {}
    for name, (dp, tp) in {"dp4": (4, 1), "dp2_tp2": (2, 2)}.items():
        torch.manual_seed(0)
        model = Transformer(_args())
        if tp == 1:
            simplefsdp.data_parallel(model, init_device_mesh("cpu", (dp,)))
        else:
            mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
            apply_tensor_parallel(model, mesh["tp"], sequence_parallel=True)
            simplefsdp.data_parallel(model, mesh["dp"])
        read = load_hf_weights(model, folder)
        with simplefsdp.disable_parametrization():
            full = {
                n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone().numpy()
                for n, p in model.named_parameters()
            }
        out[name] = (read, full)
    return out


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    from simplefsdp.checkpoint.hf import save_hf_checkpoint

    folder = tmp_path_factory.mktemp("hf")
    save_hf_checkpoint(_source(), _args(), folder, max_shard_size=40_000)
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1
    return run_distributed(_body, 4, args=(str(folder),))


@pytest.mark.parametrize("layout", ["dp4", "dp2_tp2"])
def test_sharded_load_is_bitwise_and_reads_only_slices(loaded, layout):
    source = _source()
    total = sum(v.numel() for v in source.values())
    for rank, result in enumerate(loaded):
        read, full = result[layout]
        assert set(full) == set(source)
        for name, value in source.items():
            assert np.array_equal(full[name], value.numpy()), (layout, rank, name)
        # Norms are replicated on tp (sequence parallel) but sharded on dp: a rank's
        # reads are about a quarter of the model, never all of it.
        assert read < total * 0.4, (layout, rank, read, total)
