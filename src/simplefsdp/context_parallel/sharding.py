"""How a sequence is split over context-parallel ranks.

A split is an index ``(cp, T / cp)`` of global token positions: row ``r`` is
what rank ``r`` holds, in increasing order. Attention reads positions (never
``arange``), so any split is exact; the split only decides the balance of
work. For causal attention the head-tail split gives rank ``r`` chunks ``r``
and ``2 cp - 1 - r`` of ``2 cp`` equal chunks (early and late queries pair
up); for packed documents :func:`document_balanced_index` balances the
number of (query, key) pairs each rank computes.
"""

from __future__ import annotations

import torch


def check_divisible(seq_len: int, cp: int) -> None:
    """Refuse a sequence length the head-tail split cannot cut.

    Raises:
        ValueError: ``seq_len`` is not a multiple of ``2 * cp``.
    """
    if cp > 1 and seq_len % (2 * cp):
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2 x cp = {2 * cp}; "
            f"use a multiple of {2 * cp}"
        )


def head_tail_index(
    seq_len: int, cp: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """The head-tail split: rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``.

    Args:
        seq_len: the sequence length ``T`` (a multiple of ``2 * cp``).
        cp: the context-parallel degree.

    Returns:
        ``(cp, T / cp)`` int64 positions.
    """
    check_divisible(seq_len, cp)
    chunks = torch.arange(seq_len, device=device).view(2 * cp, seq_len // (2 * cp))
    ranks = torch.arange(cp, device=device)
    return torch.cat([chunks[ranks], chunks[2 * cp - 1 - ranks]], dim=1)


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its document (``0`` at a document's start).

    Args:
        document_ids: ``(B, T)`` non-decreasing document numbers per row.

    Returns:
        ``(B, T)`` int64.
    """
    seq = torch.arange(document_ids.shape[1], device=document_ids.device)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.where(starts, seq, torch.zeros_like(seq)).cummax(dim=1).values
    return seq - first


def document_chunk(seq_len: int, cp: int) -> int:
    """The chunk :func:`document_balanced_index` deals out: ``seq_len /
    (cp x m)``, ``m`` the largest of 8, 4, 2 dividing it evenly."""
    check_divisible(seq_len, cp)
    return seq_len // (cp * next(m for m in (8, 4, 2) if seq_len % (cp * m) == 0))


def document_balanced_index(document_ids: torch.Tensor, cp: int) -> torch.Tensor:
    """A split that balances block-causal work over ``cp`` ranks.

    The sequence is cut into ``cp x m`` equal chunks (``m`` the largest of 8,
    4, 2 dividing it evenly); a chunk's cost is the number of keys its queries
    attend (their positions inside their documents, summed over the batch);
    chunks go, costliest first, to the rank with the least work among those
    still short of ``m`` chunks.

    Args:
        document_ids: ``(B, T)`` document numbers of the batch.
        cp: the context-parallel degree.

    Returns:
        ``(cp, T / cp)`` int64 positions, each row increasing.
    """
    seq_len = document_ids.shape[1]
    chunk = document_chunk(seq_len, cp)
    per_rank = seq_len // (cp * chunk)
    cost = (document_positions(document_ids) + 1).sum(dim=0)  # (T,)
    chunk_cost = cost.view(cp * per_rank, chunk).sum(dim=1).tolist()
    order = sorted(range(len(chunk_cost)), key=lambda c: -chunk_cost[c])
    load, owned = [0] * cp, [[] for _ in range(cp)]
    for c in order:
        rank = min((r for r in range(cp) if len(owned[r]) < per_rank), key=lambda r: load[r])
        owned[rank].append(c)
        load[rank] += chunk_cost[c]
    device = document_ids.device
    rows = [
        torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device) for c in sorted(cs)])
        for cs in owned
    ]
    return torch.stack(rows)
