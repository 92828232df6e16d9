"""Small non-transformer models shared by the tests, with uneven dimensions."""

from __future__ import annotations

import torch
import torch.nn as nn


class MLP(nn.Module):
    """Two-layer MLP whose sizes do not divide by 2 or 4 (uneven shards)."""

    def __init__(self, d_in: int = 13, d_hidden: int = 31, d_out: int = 7) -> None:
        super().__init__()
        self.in_proj = nn.Linear(d_in, d_hidden)
        self.out_proj = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.relu(self.in_proj(x)))


class TiedEmbeddingModel(nn.Module):
    """Embedding tied to the output projection, a 0-d and a 1-d parameter, a buffer."""

    def __init__(self, vocab: int = 19, dim: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.temperature = nn.Parameter(torch.tensor(0.9))  # 0-d
        self.register_buffer("offset", torch.linspace(-0.1, 0.1, dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.offset  # (B, T, D)
        h = self.norm(torch.nn.functional.gelu(self.hidden(h)))
        return self.head(h) * self.temperature  # (B, T, V)


class SmallCNN(nn.Module):
    """Conv + GroupNorm + pooling + linear head: not a transformer."""

    def __init__(self, channels: int = 5, classes: int = 3) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, channels, kernel_size=3, padding=1)
        self.gn = nn.GroupNorm(1, channels)
        self.conv2 = nn.Conv2d(channels, channels, kernel_size=3, padding=1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.gn(self.conv1(x)))  # (B, C, H, W)
        h = torch.relu(self.conv2(h)).mean(dim=(2, 3))  # (B, C)
        return self.fc(h)


def make_batch(model_name: str, step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic (inputs, targets) global batch for ``model_name``."""
    gen = torch.Generator().manual_seed(1000 + step)
    if model_name == "mlp":
        return torch.randn(global_batch, 13, generator=gen), torch.randn(
            global_batch, 7, generator=gen
        )
    if model_name == "tied":
        tokens = torch.randint(0, 19, (global_batch, 6), generator=gen)
        return tokens, torch.randint(0, 19, (global_batch, 6), generator=gen)
    if model_name == "cnn":
        return torch.randn(global_batch, 3, 8, 8, generator=gen), torch.randint(
            0, 3, (global_batch,), generator=gen
        )
    if model_name.startswith("blocks"):
        tokens = torch.randint(0, 23, (global_batch, 5), generator=gen)
        return tokens, torch.randint(0, 23, (global_batch, 5), generator=gen)
    raise ValueError(f"unknown toy model {model_name!r}")


def build(model_name: str) -> nn.Module:
    torch.manual_seed(0)
    if model_name.startswith("blocks"):
        # "blocks[-attn][-full|-selective]": with attention blocks and/or
        # activation checkpointing
        parts = model_name.split("-")[1:]
        checkpoint = next((p for p in parts if p in ("full", "selective")), "none")
        return BlockStack(checkpoint=checkpoint, attention="attn" in parts)
    return {"mlp": MLP, "tied": TiedEmbeddingModel, "cnn": SmallCNN}[model_name]()


def loss_fn(model_name: str, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if model_name == "mlp":
        return nn.functional.mse_loss(output.float(), target)
    if model_name == "tied" or model_name.startswith("blocks"):
        return nn.functional.cross_entropy(output.float().flatten(0, 1), target.flatten())
    return nn.functional.cross_entropy(output.float(), target)


class ResidualBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 2 * dim + 1)
        self.down = nn.Linear(2 * dim + 1, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.silu(self.up(self.norm(x))))


class AttentionBlock(nn.Module):
    """Pre-norm causal self-attention (``scaled_dot_product_attention``) + MLP."""

    def __init__(self, dim: int, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)
        self.mlp = ResidualBlock(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, -1).unbind(2)
        attn = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )  # (B, H, T, hd)
        return self.mlp(x + self.out(attn.transpose(1, 2).reshape(b, t, d)))


class BlockStack(nn.Module):
    """Embedding -> residual blocks in a ModuleList -> norm -> head.

    ``checkpoint``: ``"none"``, ``"full"`` (torch.utils.checkpoint per block)
    or ``"selective"`` (a policy saving matmuls, recomputing the rest).
    ``attention``: attention + MLP blocks instead of MLP blocks.
    """

    def __init__(
        self,
        vocab: int = 23,
        dim: int = 12,
        n_blocks: int = 3,
        checkpoint: str = "none",
        attention: bool = False,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        block = AttentionBlock if attention else ResidualBlock
        self.blocks = nn.ModuleList(block(dim) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.checkpoint = checkpoint

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)  # (B, T, D)
        for block in self.blocks:
            if self.checkpoint == "full":
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
            elif self.checkpoint == "selective":
                h = torch.utils.checkpoint.checkpoint(
                    block, h, use_reentrant=False, context_fn=_selective_context
                )
            else:
                h = block(h)
        return self.head(self.norm(h))  # (B, T, V)


def _save_matmuls(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_save_matmuls)


class BiasFreeMLP(nn.Module):
    """Three bias-free linears; with inputs that require grad, every gathered
    weight is needed again in backward."""

    def __init__(self, dim: int = 9) -> None:
        super().__init__()
        self.l1 = nn.Linear(dim, 2 * dim, bias=False)
        self.l2 = nn.Linear(2 * dim, 2 * dim, bias=False)
        self.l3 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


class DropoutAttentionStack(nn.Module):
    """Attention blocks with dropout in attention and after each sub-layer
    (three random ops per block), optionally under full activation checkpointing."""

    def __init__(self, checkpoint: bool, vocab: int = 29, dim: int = 16, n_blocks: int = 2) -> None:
        super().__init__()
        self.checkpoint = checkpoint
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_DropoutAttentionBlock(dim) for _ in range(n_blocks))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            if self.checkpoint:
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)
        return self.head(h)


class _DropoutAttentionBlock(nn.Module):
    def __init__(self, dim: int, heads: int = 2, p: float = 0.1) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.ff = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = torch.nn.functional
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, -1).unbind(2)
        attn = f.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            dropout_p=self.p,
            is_causal=True,
        )
        x = x + f.dropout(self.out(attn.transpose(1, 2).reshape(b, t, d)), self.p)
        return x + f.dropout(f.gelu(self.ff(x)), self.p)
