"""Mixture-of-experts code nobody here wrote, under simplefsdp, against one process.

The model is a small decoder whose MoE layer is written the way Hugging Face
``transformers`` writes GPT-OSS (``GptOssTopKRouter``, ``GptOssExperts``):
a linear router with a bias whose top-k logits are softmaxed into routing
weights, and experts stored as 3-D parameters with a fused, interleaved
``gate_up_proj`` ``(E, D, 2H)`` and ``down_proj`` ``(E, H, D)``, each with a
2-D bias ``(E, ...)``, and a clamped SwiGLU (``alpha`` 1.702, ``limit`` 7).
Nothing in it knows about simplefsdp.

Two ways of writing the experts, both trained for a few SGD steps on 2 CPU
processes, each rank on its half of a global batch, and compared with the
same model trained in one process on the global batch (rank-averaged loss of
every step and the final parameters, fp32):

- ``dense``: GPT-OSS's all-experts path (every token through every expert,
  weighted by its routing weights, zero for experts it was not routed to):
  no data-dependent reads, so plain ``data_parallel`` shards the 3-D expert
  weights like any other parameter, uncompiled and (``heavy``: about a
  minute) under ``simplefsdp.compile(backend="aot_eager")``.
- ``sorted``: the same experts rewritten as a user's experts module following
  the ``(tokens sorted by expert, num_tokens_per_expert)`` convention of
  ``ExpertParallel``, with the layer doing its own sort and unsort; the
  experts get ``parallelize_module(..., ExpertParallel())`` over ``ep`` = 2
  (through ``apply_expert_parallel``) and the model ``data_parallel`` with
  ``expert_mesh``, so tokens cross ranks by all-to-all.

With ``transformers`` installed (it is not a dependency), its own
``GptOssExperts`` is also checked against this file's copy of the design, so
the copy stays the design it claims to be.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from simplefsdp.testing import run_distributed

VOCAB, DIM, HIDDEN, EXPERTS, TOP_K, HEADS = 29, 16, 8, 4, 2, 2
BATCH, SEQ, STEPS, LR = 4, 6, 3, 0.2
ALPHA, LIMIT = 1.702, 7.0


def _swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's clamped SwiGLU on interleaved ``(gate, up)`` columns."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=LIMIT)
    up = up.clamp(min=-LIMIT, max=LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * ALPHA))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class DenseExperts(nn.Module):
    """GPT-OSS experts, all-experts path: ``forward(x (T, D), weights (T, E))``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(EXPERTS, DIM, 2 * HIDDEN) * 0.3)
        self.gate_up_proj_bias = nn.Parameter(torch.randn(EXPERTS, 2 * HIDDEN) * 0.1)
        self.down_proj = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * 0.3)
        self.down_proj_bias = nn.Parameter(torch.randn(EXPERTS, DIM) * 0.1)

    def forward(self, x: torch.Tensor, routing_weights: torch.Tensor) -> torch.Tensor:
        hidden = x.unsqueeze(0).expand(EXPERTS, -1, -1)  # (E, T, D)
        gate_up = torch.bmm(hidden, self.gate_up_proj) + self.gate_up_proj_bias[:, None, :]
        out = torch.bmm(_swiglu(gate_up), self.down_proj) + self.down_proj_bias[:, None, :]
        return (out * routing_weights.t()[..., None]).sum(0)  # (T, D)


class SortedExperts(DenseExperts):
    """The same weights as a user's experts module for ``ExpertParallel``:
    ``forward(tokens sorted by expert (R, D), num_tokens_per_expert (E,))``."""

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        gate_up_w, gate_up_b = _local(self.gate_up_proj), _local(self.gate_up_proj_bias)
        down_w, down_b = _local(self.down_proj), _local(self.down_proj_bias)
        chunks = torch.split(x, num_tokens_per_expert.tolist())
        outs = [
            _swiglu(chunk @ gate_up_w[e] + gate_up_b[e]) @ down_w[e] + down_b[e]
            for e, chunk in enumerate(chunks)
        ]
        return torch.cat(outs)


class MoELayer(nn.Module):
    """GPT-OSS's router, then the experts (``dense`` or ``sorted``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.router = nn.Linear(DIM, EXPERTS)  # GptOssTopKRouter: weight and bias
        self.experts = DenseExperts() if kind == "dense" else SortedExperts()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = h.reshape(-1, DIM)
        top_value, top_index = torch.topk(self.router(x), TOP_K, dim=-1)  # (T, k)
        top_value = F.softmax(top_value, dim=-1, dtype=top_value.dtype)
        if self.kind == "dense":
            weights = torch.zeros(x.shape[0], EXPERTS).scatter(1, top_index, top_value)
            return self.experts(x, weights).view_as(h)
        flat = top_index.reshape(-1)  # (T*k,) token slots, expert of each
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=EXPERTS)
        routed = self.experts(x[order // TOP_K], counts)  # (T*k, D) in expert order
        slots = torch.empty_like(routed).index_copy(0, order, routed)
        return (slots.view(-1, TOP_K, DIM) * top_value[..., None]).sum(1).view_as(h)


class Block(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM, bias=False)
        self.mlp_norm = nn.RMSNorm(DIM)
        self.mlp = MoELayer(kind)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, _ = h.shape
        q, k, v = self.qkv(self.attn_norm(h)).view(b, t, 3, HEADS, -1).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.proj(attn.transpose(1, 2).reshape(b, t, DIM))
        return h + self.mlp(self.mlp_norm(h))


class Decoder(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(kind) for _ in range(2))
        self.norm = nn.RMSNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(h))


def _model(kind: str) -> Decoder:
    torch.manual_seed(0)
    return Decoder(kind)


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def _train(model: nn.Module, forward, rows: slice) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for tokens in _batches():
        tokens = tokens[rows]
        logits = forward(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _parity_body(kind: str, backends: tuple[str | None, ...]) -> dict[str, float]:
    from torch.distributed.device_mesh import init_device_mesh

    import simplefsdp
    from simplefsdp.frontend.data_parallel import parallelize_experts_and_data
    from simplefsdp.frontend.expert_parallel import build_expert_parallel_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    ref = _model(kind)
    ref_losses = _train(ref, ref, slice(None))
    ref_params = {k: v.detach() for k, v in ref.named_parameters()}
    worst = {}
    for backend in backends:
        torch._dynamo.reset()
        if kind == "dense":
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
            model = simplefsdp.data_parallel(_model(kind), mesh)
            # The 3-D expert weights are sharded over the data-parallel ranks.
            stored = dict(model.named_parameters())["layers.0.mlp.experts.gate_up_proj"]
            assert stored.to_local().shape[0] == EXPERTS // world
        else:
            ep_mesh, dp_mesh = build_expert_parallel_mesh("cpu", world, world, EXPERTS)
            model = parallelize_experts_and_data(_model(kind), ep_mesh, dp_mesh)
            stored = dict(model.named_parameters())["layers.0.mlp.experts.gate_up_proj"]
            assert stored.device_mesh.mesh_dim_names == ("dp_shard_mod_ep", "ep")
            assert stored.to_local().shape[0] == EXPERTS // world  # this rank's experts
        forward = model
        if backend is not None:
            forward = simplefsdp.compile(model, backend=backend, fullgraph=kind == "dense")
        losses = torch.tensor(_train(model, forward, rows))
        dist.all_reduce(losses)
        torch.testing.assert_close(losses / world, torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
        diffs = []
        for fqn, param in model.named_parameters():
            full = param.detach().full_tensor()
            torch.testing.assert_close(
                full, ref_params[fqn], rtol=1e-5, atol=1e-6, msg=lambda m, f=fqn: f"{f}: {m}"
            )
            diffs.append((full - ref_params[fqn]).abs().max().item())
        worst[backend or "uncompiled"] = max(diffs)
    return worst


def test_gpt_oss_style_moe_under_data_parallel_matches_one_process():
    results = run_distributed(_parity_body, world_size=2, args=("dense", (None,)), timeout_s=300)
    print("dense GPT-OSS-style experts, max |param - reference|:", results[0])


@pytest.mark.heavy
def test_gpt_oss_style_moe_compiled_matches_one_process():
    # aot_eager compiles forward and backward of the whole model: about a minute.
    results = run_distributed(
        _parity_body, world_size=2, args=("dense", ("aot_eager",)), timeout_s=300
    )
    print("dense GPT-OSS-style experts, aot_eager, max |param - reference|:", results[0])


def test_users_sorted_experts_under_expert_parallel_match_one_process():
    results = run_distributed(_parity_body, world_size=2, args=("sorted", (None,)), timeout_s=300)
    print("user's experts under ExpertParallel (ep 2), max |param - reference|:", results[0])


def test_the_copy_is_transformers_gpt_oss_experts():
    """This file's dense experts compute what transformers' ``GptOssExperts`` does."""
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    from transformers import GptOssConfig

    config = GptOssConfig(
        hidden_size=DIM,
        intermediate_size=HIDDEN,
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
    )
    theirs = modeling.GptOssExperts(config).eval()
    ours = _model("dense").layers[0].mlp.experts
    with torch.no_grad():
        for name, param in ours.named_parameters():
            getattr(theirs, name).copy_(param)
    x = torch.randn(5, DIM, generator=torch.Generator().manual_seed(2))
    weights = torch.rand(5, EXPERTS, generator=torch.Generator().manual_seed(3))
    router_indices = torch.arange(EXPERTS).expand(5, -1)
    with torch.no_grad():
        try:  # the signature of transformers 4.55-4.57
            expected = theirs(x[None], router_indices=router_indices, routing_weights=weights)
        except TypeError as e:
            pytest.skip(f"this transformers' GptOssExperts.forward takes other arguments: {e}")
    torch.testing.assert_close(ours(x, weights), expected.reshape(5, DIM))
