"""From a batch to this rank's part of it and the :class:`~.attention.SequenceContext`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .attention import BACKENDS, SequenceContext
from .sharding import (
    check_divisible,
    document_balanced_index,
    document_chunk,
    document_positions,
    head_tail_index,
)

LOAD_BALANCE = ("head_tail", "documents")


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Document numbers of packed rows: a document ends with (and includes) ``eos_id``.

    Args:
        tokens: ``(B, T)`` token ids.
        eos_id: the end-of-document token.

    Returns:
        ``(B, T)`` int64, starting at 0 in each row.
    """
    ends = (tokens == eos_id).long()
    return ends.cumsum(dim=1) - ends


@dataclass(frozen=True)
class SequenceOptions:
    """How a training step splits and masks its sequences.

    Attributes:
        cp: the context-parallel degree (ranks that split one sequence).
        rank: this rank's index in its context-parallel group.
        group: the context-parallel process group's name (``cp > 1``).
        backend: attention across ranks, one of :data:`~.attention.BACKENDS`.
        eos_id: the end-of-document token: with it, attention stays inside
            each packed document (``None``: plain causal attention).
        restart_positions: rotary positions restart at 0 in each document
            (with ``eos_id``); otherwise they count along the packed row.
        load_balance: ``head_tail`` (causal) or ``documents`` (balance the
            block-causal work of the batch; the default with ``eos_id``).
        ignore_index: the target the loss leaves out (``cross_entropy``'s).
    """

    cp: int = 1
    rank: int = 0
    group: str | None = None
    backend: str = "allgather"
    eos_id: int | None = None
    restart_positions: bool = False
    load_balance: str | None = None
    ignore_index: int = -100

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"cp_backend {self.backend!r} is not one of {', '.join(BACKENDS)}")
        if self.load_balance is not None and self.load_balance not in LOAD_BALANCE:
            raise ValueError(
                f"load_balance {self.load_balance!r} is not one of {', '.join(LOAD_BALANCE)}"
            )

    @property
    def active(self) -> bool:
        """Whether steps need a context (context parallelism or document masks)."""
        return self.cp > 1 or self.eos_id is not None

    def prepare(
        self, inputs: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, SequenceContext]:
        """This rank's tokens and targets of a ``(B, T)`` batch, and their context.

        Every rank of a context-parallel group passes the same batch.

        Raises:
            ValueError: ``T`` is not a multiple of ``2 x cp``.
        """
        seq_len = inputs.shape[1]
        check_divisible(seq_len, self.cp)
        docs = None if self.eos_id is None else document_ids(inputs, self.eos_id)
        balance = self.load_balance or ("head_tail" if docs is None else "documents")
        if self.cp == 1:
            index = torch.arange(seq_len, device=inputs.device)[None]
            run = seq_len
        elif balance == "documents" and docs is not None:
            index = document_balanced_index(docs, self.cp)
            run = document_chunk(seq_len, self.cp)
        else:
            index = head_tail_index(seq_len, self.cp, inputs.device)
            run = seq_len // (2 * self.cp)
        local = index[self.rank]
        rope = None
        if docs is not None and self.restart_positions:
            rope = document_positions(docs)[:, local]
        context = SequenceContext(
            index=index,
            rank=self.rank,
            group=self.group,
            backend=self.backend,
            document_ids=docs,
            rope_positions=rope,
            run=run,
        )
        local_targets = None if targets is None else targets[:, local]
        return inputs[:, local], local_targets, context

    def local_loss(
        self,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        output: torch.Tensor,
        local_targets: torch.Tensor,
        targets: torch.Tensor,
    ) -> torch.Tensor:
        """This rank's loss, weighted so that its mean over the context-parallel
        group is the batch's mean over every trained target.

        ``loss_fn`` is a mean over this rank's trained targets; ranks hold
        different numbers of them (targets after a document boundary, chat
        data's prompts are left out), so each mean is weighted by its share.
        A rank without a trained target returns a zero that still reaches
        every parameter (its backward runs the same collectives as the
        others').

        Args:
            loss_fn: ``loss_fn(output, targets)``, a mean.
            output: this rank's logits.
            local_targets: this rank's targets (:meth:`prepare`).
            targets: the whole batch's targets.
        """
        if self.cp == 1:
            return loss_fn(output, local_targets)
        local = (local_targets != self.ignore_index).sum()
        if int(local) == 0:
            return output.sum() * 0.0
        total = (targets != self.ignore_index).sum()
        return loss_fn(output, local_targets) * (local * self.cp / total)
