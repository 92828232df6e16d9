"""Any causal LM of ``transformers`` trains data-parallel: parity with one process.

Tiny Gemma- and Mistral-style folders (``save_pretrained``) are built by the
family ``transformers`` on the meta device, parallelised by the one recipe
(``parallelize_model``: ``data_parallel`` over the job's meshes), loaded per
rank with ``load_hf_weights`` and trained 3 AdamW steps on per-rank batches.
The mean of the ranks' losses and the final parameters equal those of
``transformers``' own model trained on the whole batch in one process
(tight tolerance: gloo and TP's split matmuls sum in another order; an
Adam step is 1e-2, the parameters agree within 5e-5). The default run covers
``fully_shard`` eager on 2 ranks; ``heavy`` covers ``replicate``,
``hybrid_shard`` (4 ranks), compilation, activation checkpointing and
tensor parallelism through the model's ``base_model_tp_plan`` (dp 2 x tp 2),
and the eager executor and FSDP2 engines.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from simplefsdp.testing import run_distributed

transformers = pytest.importorskip("transformers")

VOCAB, STEPS, BATCH, SEQ = 128, 3, 4, 16


def _configs() -> dict:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    return {
        "gemma": transformers.GemmaConfig(**common),
        "mistral": transformers.MistralConfig(**common),
    }


def _data() -> torch.Tensor:
    """``(STEPS, BATCH, SEQ + 1)`` tokens: each step's global batch."""
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=g)


def _train(
    folders: dict, mode: str, compile: bool, ac: str, mesh_shape, tp: int = 1, engine="simplefsdp"
) -> dict:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    import simplefsdp
    from simplefsdp.checkpoint.hf import hf_model_of_folder, load_hf_weights
    from simplefsdp.engines import EngineSpec
    from simplefsdp.engines.recipe import RecipeOptions, parallelize_model
    from simplefsdp.layout import Layout

    rank, world = dist.get_rank(), dist.get_world_size()
    layout = Layout.for_data_parallel(
        mode, world, mesh_shape=mesh_shape, local_world_size=world, tp=tp
    )
    meshes = layout.resolve(world).build("cpu", world)
    engine = EngineSpec(
        engine=engine,
        mode=mode,
        compile=compile,
        backend="aot_eager",
        activation_checkpoint=ac,
        tp=tp,
    )
    per_rank = BATCH // meshes.batch_size
    data = _data()[:, meshes.batch_rank * per_rank : (meshes.batch_rank + 1) * per_rank]
    out = {}
    for name, folder in folders.items():
        spec, config = hf_model_of_folder(folder)
        with torch.device("meta"):
            model = spec.build(config)
        options = RecipeOptions(sequence_parallel=False)
        parallel = parallelize_model(model, spec, meshes, engine, torch.device("cpu"), options)
        load_hf_weights(parallel.module, folder, args=config)
        optimizer = torch.optim.AdamW(parallel.module.parameters(), lr=1e-2)
        losses = []
        for step in range(STEPS):
            loss = parallel.step(data[step, :, :-1], data[step, :, 1:])
            optimizer.step()
            optimizer.zero_grad()
            # the ranks' mean (equal batches; tp ranks share theirs) is the global loss
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(float(mean) / world)
        with simplefsdp.disable_parametrization():
            params = {  # names without the activation-checkpoint wrapper's part
                n.replace("_checkpoint_wrapped_module.", ""): (
                    p.full_tensor() if isinstance(p, DTensor) else p
                )
                .detach()
                .numpy()
                .copy()
                for n, p in parallel.module.named_parameters()
            }
        out[name] = (losses, params if rank == 0 else None)
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``name -> (folder, losses, parameters)`` of ``transformers`` in one process."""
    import torch.nn.functional as F

    out = {}
    for name, config in _configs().items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, data = [], _data()
        for step in range(STEPS):
            logits = model(data[step, :, :-1]).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), data[step, :, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
        out[name] = (str(folder), losses, params)
    return out


def _check(results: list, reference: dict) -> None:
    for name, (_, losses, params) in reference.items():
        for rank_result in results:
            assert np.allclose(rank_result[name][0], losses, rtol=1e-5, atol=0), name
        ours = results[0][name][1]
        assert set(ours) == set(params), name
        for key, value in params.items():
            diff = float(np.abs(ours[key] - value).max())
            assert np.allclose(ours[key], value, rtol=1e-4, atol=5e-5), (name, key, diff)


def test_fully_shard_matches_one_process(reference):
    folders = {name: folder for name, (folder, _, _) in reference.items()}
    _check(
        run_distributed(_train, 2, args=(folders, "fully_shard", False, "none", None)), reference
    )


@pytest.mark.heavy
@pytest.mark.parametrize("engine", ["simplefsdp_eager", "fsdp2"])
def test_other_engines_match_one_process(reference, engine):
    folders = {name: folder for name, (folder, _, _) in reference.items()}
    args = (folders, "fully_shard", False, "none", None, 1, engine)
    _check(run_distributed(_train, 2, args=args, timeout_s=600), reference)


@pytest.mark.heavy
@pytest.mark.parametrize(
    ("mode", "compile", "ac", "world", "mesh_shape", "tp"),
    [
        ("replicate", False, "none", 2, None, 1),
        ("hybrid_shard", False, "full", 4, (2, 2), 1),
        ("fully_shard", True, "selective", 2, None, 1),
        ("fully_shard", False, "none", 4, None, 2),  # dp 2 x tp 2: base_model_tp_plan
    ],
)
def test_modes_compile_ac_and_tp_match_one_process(
    reference, mode, compile, ac, world, mesh_shape, tp
):
    folders = {name: folder for name, (folder, _, _) in reference.items()}
    results = run_distributed(
        _train, world, args=(folders, mode, compile, ac, mesh_shape, tp), timeout_s=600
    )
    _check(results, reference)


_CP_MODELS = {  # windows of 8 over 32 tokens: chunks across the ranks
    "mistral": {"sliding_window": 8},
    "gemma3_text": {"head_dim": 8, "query_pre_attn_scalar": 8, "sliding_window": 8,
                    "layer_types": ["sliding_attention", "full_attention"]},
}  # fmt: skip


def _cp_run() -> dict:
    """Logits and gradients of each model under cp 2, per backend, against
    one process over the whole sequence (with ``eos``: document masks, whose
    one-process path ``test_document_masks_give_each_document_its_own_logits``
    checks against ``transformers`` per document)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from simplefsdp.context_parallel import SequenceOptions
    from simplefsdp.context_parallel.attention import BACKENDS
    from simplefsdp.models.hf_transformers.config import config_from_hf
    from simplefsdp.models.hf_transformers.spec import SPEC

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    tokens = torch.randint(1, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    tokens[0, [5, 17]] = 0
    tokens[1, 11] = 0
    diffs = {}
    for (model_type, extra), eos in itertools.product(_CP_MODELS.items(), (None, 0)):
        hf = type(transformers.AutoConfig.for_model(model_type))(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            pad_token_id=0, **extra,
        )  # fmt: skip
        torch.manual_seed(0)
        model = SPEC.build(config_from_hf(hf.to_dict()))
        whole = SequenceOptions(eos_id=eos)
        ref = model(tokens, context=whole.prepare(tokens)[2]) if eos is not None else model(tokens)
        ref.square().mean().backward()
        ref_grads = [p.grad.clone() for p in model.parameters()]
        for backend in BACKENDS:
            model.zero_grad()
            options = SequenceOptions(cp=2, rank=dist.get_rank(), backend=backend, eos_id=eos,
                                      group=mesh.get_group().group_name)  # fmt: skip
            local, _, context = options.prepare(tokens)
            logits = model(local, context=context)
            (logits.square().sum() / ref.numel()).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            for grad in grads:
                dist.all_reduce(grad)
            diffs[(model_type, eos, backend)] = (
                (logits - ref.detach()[:, context.index[context.rank]]).abs().max().item(),
                max((a - b).abs().max().item() for a, b in zip(grads, ref_grads, strict=True)),
            )
    return diffs


def test_context_parallel_matches_one_process():
    """``transformers``' Mistral and Gemma 3 (sliding and full layers) split
    over 2 context-parallel ranks, every backend, causal and with document
    masks: the ranks' logits and the summed gradients equal one process's
    over the whole sequence."""
    for rank in run_distributed(_cp_run, 2):
        assert len(rank) == 12
        for case, (logits, grads) in rank.items():
            assert logits < 1e-5 and grads < 1e-7, (case, logits, grads)
