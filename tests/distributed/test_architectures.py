"""Model shapes that torch's test models leave out, under data_parallel on 2
CPU ranks, against one process: the harness of ``test_torch_models`` (a
few AdamW steps with clipping; rank-averaged losses and final parameters)
for every executor (uncompiled, eager executor, compiled with the auto plan).

- ``CNN``: convolutions and GroupNorm in nested ``nn.Sequential``s (no
  ``ModuleList``, so no repeated blocks for the per-block plan to find).
- ``ViT``: a patch-embedding convolution, parameters of the root module
  itself (class token, position embedding) read beside a submodule's, and
  ``nn.TransformerEncoderLayer`` blocks in an ``nn.Sequential``.
- ``GPT2ish``: blocks as ``nn.ModuleDict``s, a fused QKV projection,
  ``scaled_dot_product_attention``, the output head tied to the embedding.
- ``Odd``: dimensions that do not divide by 2 (uneven shards), a 0-d
  parameter, and an embedding's weight read directly instead of through
  its module.
- ``WeightNorm``: a convolution already parametrized by
  ``nn.utils.parametrizations.weight_norm`` (parameters ``original0/1``).
- ``LoRA``: frozen base weights beside small trainable adapters;
  ``LoRABf16`` with the base stored in bf16, so each block mixes dtypes (the
  eager executor splits such a bucket by dtype, as the compiled pass does).
- ``Albert``: one block applied four times per forward (each of its
  parameters gathered four times).
- ``ParallelResidual``: GPT-NeoX's block, whose two output biases get one
  gradient (compiled: one reduce-scatter with two waits after CSE).
- ``DataclassOut``: blocks and the root return dataclass instances.
"""

from __future__ import annotations

import dataclasses

import test_torch_models as harness
import torch
import torch.nn as nn
import torch.nn.functional as F

from simplefsdp.testing import run_distributed


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 12, 3, padding=1)
        self.stages = nn.Sequential(
            *[
                nn.Sequential(nn.Conv2d(12, 12, 3, padding=1), nn.GroupNorm(3, 12), nn.ReLU())
                for _ in range(3)
            ]
        )
        self.head = nn.Linear(12, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)).mean((2, 3)))


class ViT(nn.Module):
    def __init__(self, dim: int = 24, depth: int = 3) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, stride=4)
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, 17, dim) * 0.02)
        self.blocks = nn.Sequential(
            *[
                nn.TransformerEncoderLayer(
                    dim, 4, 2 * dim, dropout=0.0, batch_first=True, norm_first=True
                )
                for _ in range(depth)
            ]
        )
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


class GPT2ish(nn.Module):
    def __init__(self, vocab: int = 50, dim: int = 32, n_layers: int = 3, ctx: int = 16) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(ctx, dim)
        self.h = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln_1": nn.LayerNorm(dim),
                    "c_attn": nn.Linear(dim, 3 * dim),
                    "c_proj": nn.Linear(dim, dim),
                    "ln_2": nn.LayerNorm(dim),
                    "fc": nn.Linear(dim, 4 * dim),
                    "proj": nn.Linear(4 * dim, dim),
                }
            )
            for _ in range(n_layers)
        )
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        batch, length = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(length))
        for b in self.h:
            q, k, v = b["c_attn"](b["ln_1"](x)).split(x.shape[-1], -1)
            q, k, v = (t.view(batch, length, 4, -1).transpose(1, 2) for t in (q, k, v))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + b["c_proj"](a.transpose(1, 2).reshape(batch, length, -1))
            x = x + b["proj"](F.gelu(b["fc"](b["ln_2"](x)), approximate="tanh"))
        return self.lm_head(self.ln_f(x))


class Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(13, 7), nn.Linear(7, 11, bias=False)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.emb = nn.Embedding(9, 13)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(F.gelu(self.l1(x + self.emb.weight.sum(0)))) * self.scale


class ParallelResidual(nn.Module):
    """GPT-NeoX's block: ``x + attn(ln1(x)) + mlp(ln2(x))``. The two output
    biases get the same gradient tensor, so AOTAutograd's CSE merges their
    reduce-scatters into one with two waits (Note: [One wait per collective])."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln1": nn.LayerNorm(16),
                    "ln2": nn.LayerNorm(16),
                    "attn_out": nn.Linear(16, 16),
                    "fc": nn.Linear(16, 32),
                    "mlp_out": nn.Linear(32, 16),
                }
            )
            for _ in range(2)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = (
                x
                + b["attn_out"](torch.tanh(b["ln1"](x)))
                + b["mlp_out"](F.gelu(b["fc"](b["ln2"](x))))
            )
        return x


@dataclasses.dataclass
class Hidden:
    value: torch.Tensor
    note: str = "no pytree node"


class HiddenBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> Hidden:
        return Hidden(torch.tanh(self.lin(x)))


class DataclassOut(nn.Module):
    """Blocks and the root return dataclass instances, which are no pytree
    nodes: the eager executor's regather before backward hooks their tensors
    (``output_tensors``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(HiddenBlock() for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> Hidden:
        for block in self.blocks:
            x = block(x).value
        return Hidden(self.head(x))


class WeightNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.utils.parametrizations.weight_norm(nn.Conv1d(4, 8, 3, padding=1))
        self.lin = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(F.relu(self.conv(x)).mean(-1))


class LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out).requires_grad_(False)
        self.A = nn.Parameter(torch.randn(rank, d_in) * 0.1)
        self.B = nn.Parameter(torch.randn(d_out, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.A.t() @ self.B.t()


class LoRA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LoRALinear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class LoRABf16Linear(LoRALinear):
    """A frozen bf16 base (stored bf16, computed in fp32, as a dequantised
    weight) beside fp32 adapters: blocks whose parameters differ in dtype."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__(d_in, d_out)
        self.base.to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        base = F.linear(x, self.base.weight.float(), self.base.bias.float())
        return base + x @ self.A.t() @ self.B.t()


class LoRABf16(LoRA):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(LoRABf16Linear(16, 16) for _ in range(4))


class Albert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(16, 16), nn.Linear(16, 4)
        self.shared = nn.Sequential(
            nn.LayerNorm(16), nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for _ in range(4):
            h = h + self.shared(h)
        return self.out(h)


def _images(gen: torch.Generator, n: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(n, 3, 16, 16, generator=gen),)


def _signals(gen: torch.Generator, n: int) -> tuple[torch.Tensor, ...]:
    return (torch.randn(n, 4, 10, generator=gen),)


def _tokens(gen: torch.Generator, n: int) -> tuple[torch.Tensor, ...]:
    return (torch.randint(0, 50, (n, 16), generator=gen),)


Case, seeded, square_mean = harness.Case, harness._seeded, harness._square_mean
CASES = {
    # A convolution's weight gradient sums over batch and positions, in
    # another order on half the batch: one entry of stages.0.0.weight whose
    # gradient is near 0 moved by 1.7e-5 in 3 AdamW steps of lr 1e-2 (the
    # same for every executor, uncompiled too); 1e-4 is 1% of a step.
    "CNN": Case(seeded(CNN), _images, square_mean, param_atol=1e-4),
    # The key bias of a fused QKV projection gets a round-off gradient
    # (softmax cancels it), as in test_torch_models' nn.MultiheadAttention.
    "ViT": Case(
        seeded(ViT), _images, square_mean, roundoff_entries=(("in_proj_bias", slice(24, 48)),)
    ),
    "GPT2ish": Case(
        seeded(GPT2ish),
        _tokens,
        harness._lm_loss,
        roundoff_entries=(("c_attn.bias", slice(32, 64)),),
    ),
    "Odd": Case(seeded(Odd), harness._rand(13), square_mean),
    "WeightNorm": Case(seeded(WeightNorm), _signals, square_mean),
    "ParallelResidual": Case(seeded(ParallelResidual), harness._rand(16), square_mean),
    "DataclassOut": Case(
        seeded(DataclassOut), harness._rand(16), lambda out, inputs: square_mean(out.value, inputs)
    ),
    "LoRA": Case(seeded(LoRA), harness._rand(16), square_mean),
    "LoRABf16": Case(seeded(LoRABf16), harness._rand(16), square_mean),
    "Albert": Case(seeded(Albert), harness._rand(16), square_mean),
}
harness.CASES.update(CASES)  # also in each rank's process, which imports this module


def _body(configs: list[tuple[str, str, str]]) -> list[str]:
    return harness._parity_body(configs)


def test_architectures_fully_sharded() -> None:
    configs = [(name, "fully_shard", ex) for name in CASES for ex in harness.EXECUTORS]
    failures = run_distributed(_body, 2, args=(configs,), timeout_s=600)
    errors = sorted(set().union(*failures))
    assert not errors, f"{len(errors)} of {len(configs)} failed:\n" + "\n".join(errors)
