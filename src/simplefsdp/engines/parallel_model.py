"""What an engine returns: :class:`ParallelModel`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

#: loss_fn(output, targets) -> the mean loss of a batch
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass
class ParallelModel:
    """A model made data parallel by one engine (see :func:`simplefsdp.engines.parallelize`).

    Attributes:
        module: the model whose ``parameters()``/``state_dict()`` the optimizer
            and checkpoints use (never a ``torch.compile`` or DDP wrapper).
        forward: what a training step calls: ``module``, its compiled version
            or the DDP wrapper.
        engine: the engine's name (``simplefsdp``, ``simplefsdp_eager``,
            ``fsdp2``, ``ddp`` or ``replica``).
        mesh: the data-parallel mesh.
        tp_mesh: the tensor-parallel mesh (``None`` without tensor parallelism).
        compiled: whether the engine compiles the model (on its first call).
        inductor_patches: Inductor config patches that must be active while
            the model runs (it compiles in its first step); see
            :meth:`compile_context`.
        notes: remarks for reports (e.g. settings an engine ignored).
        loss_fn: ``loss_fn(output, targets)``, the batch's mean loss, for
            :meth:`step` and :meth:`eval_loss`.
        sequence: how a step splits and masks its sequences (a
            :class:`simplefsdp.context_parallel.SequenceOptions`; ``None`` or
            inactive: the model sees the whole batch, causal): :meth:`step`
            and :meth:`eval_loss` pass the model this rank's share of each
            sequence with its context, and the loss its share of the targets.

    :class:`ParallelModel` and :class:`~simplefsdp.engines.PipelinedModel`
    share one interface, so that a training loop has no pipeline branch:
    :meth:`step` (forward and backward of a batch, returning its loss),
    :meth:`eval_loss`, :attr:`has_loss`, :attr:`can_evaluate`, ``module`` (what
    the optimizer, the gradient clip and checkpoints see), :meth:`compile_context`
    and ``notes``.
    """

    module: nn.Module
    forward: Callable[..., Any]
    engine: str
    mesh: DeviceMesh
    compiled: bool = False
    inductor_patches: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    tp_mesh: DeviceMesh | None = None
    loss_fn: LossFn | None = None
    sequence: Any = None
    _float8_weights: bool | None = field(default=None, init=False, repr=False)

    @property
    def has_loss(self) -> bool:
        """Whether :meth:`step` and :meth:`eval_loss` return this rank's loss (always)."""
        return True

    @property
    def can_evaluate(self) -> bool:
        """Whether :meth:`eval_loss` can run (always)."""
        return True

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.loss_fn is None:
            raise ValueError("this ParallelModel has no loss_fn; pass one to parallelize")
        if self.sequence is not None and self.sequence.active:
            local_inputs, local_targets, context = self.sequence.prepare(inputs, targets)
            output = self.forward(local_inputs, context=context)
            return self.sequence.local_loss(self.loss_fn, output, local_targets, targets)
        return self.loss_fn(self.forward(inputs), targets)

    def step(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        *,
        scale: float = 1.0,
        sync: bool = True,
    ) -> torch.Tensor:
        """Forward and backward of one batch; gradients go to ``param.grad``.

        Args:
            scale: multiplies the loss (e.g. ``1 / grad_accum_steps``).
            sync: reduce the gradients in this backward (``False``: keep
                them on the rank, :meth:`grad_sync`; the next synced step
                reduces all).

        Returns:
            The scaled loss (detached, a plain tensor).

        Raises:
            ValueError: the model has no ``loss_fn``.
        """
        with self.grad_sync(sync):
            loss = self._loss(inputs, targets)
            if scale != 1.0:
                loss = loss * scale
            loss.backward()
        return plain_loss(loss.detach())

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of a forward-only pass (a plain tensor).

        Raises:
            ValueError: the model has no ``loss_fn``.
        """
        return plain_loss(self._loss(inputs, targets))

    @contextlib.contextmanager
    def grad_sync(self, enabled: bool) -> Iterator[None]:
        """Skip gradient communication inside the block when ``enabled`` is false.

        For all micro-batches but the last of an accumulation step: DDP's
        ``no_sync``, FSDP2's ``set_requires_gradient_sync``, the eager
        executor's ``no_sync`` and, for compiled and uncompiled ``simplefsdp``,
        :func:`simplefsdp.no_sync` (unreduced gradients summed on each rank,
        reduced with the next synced micro-batch's). A no-op for ``replica``.
        Run each micro-batch's forward and backward inside the block.
        """
        if enabled or self.engine == "replica":
            yield
        elif self.engine == "simplefsdp":
            from simplefsdp.frontend.accumulation import no_sync

            with no_sync(self.module):
                yield
        elif self.engine == "ddp":
            with self.forward.no_sync():  # type: ignore[attr-defined]
                yield
        elif self.engine == "simplefsdp_eager":
            from simplefsdp.eager_executor import get_eager_executor

            with get_eager_executor(self.module).no_sync():
                yield
        else:
            self.module.set_requires_gradient_sync(False)  # type: ignore[operator]
            try:
                yield
            finally:
                self.module.set_requires_gradient_sync(True)  # type: ignore[operator]

    def after_optimizer_step(self) -> None:
        """What the engine does after each optimizer step.

        FSDP2 with torchao float8 all-gather weights: the next step's float8
        scales of every such weight in one all-reduce (torchao's
        ``precompute_float8_dynamic_scale_for_fsdp``, as torchtitan runs it);
        without it each weight's pre-all-gather hook all-reduces its own amax.
        simplefsdp computes the scales in the step's graph instead (one
        bucketed amax all-reduce: Note: [Float8 all-gather]). Other engines:
        nothing.
        """
        if self.engine != "fsdp2":
            return
        if self._float8_weights is None:
            from simplefsdp.frontend.float8 import is_float8_weight

            self._float8_weights = any(is_float8_weight(p) for p in self.module.parameters())
        if self._float8_weights:
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(self.module)

    @contextlib.contextmanager
    def compile_context(self) -> Iterator[None]:
        """Apply :attr:`inductor_patches` while the block runs (nothing is left changed)."""
        if not self.inductor_patches:
            yield
            return
        import torch._inductor.config as inductor_config

        with inductor_config.patch(self.inductor_patches):
            yield

    def collective_summary(self) -> dict | None:
        """Collective counts and cost-model predictions of ``simplefsdp.compile``'s graphs.

        ``None`` unless the module was compiled by ``simplefsdp.compile`` and
        has run a step. Counts add the latest forward and backward graph of
        each compiled Dynamo graph. ``predicted_step_time_s`` sums the graphs'
        predicted ``time_s`` (``None`` unless every graph has one);
        ``predicted_peak_mem_bytes`` is the largest predicted live peak of
        any graph beyond the training state (``live_peak_bytes``: what the
        bench's forward+backward phase measures; ``None`` when no graph has
        one). ``bytes`` is per kind the unsharded bytes the graphs' collectives
        move (an all-gather's output, a reduce-scatter's input).
        """
        from simplefsdp.compiler import comm_report

        try:
            report = comm_report(self.module)
        except ValueError:
            return None
        latest = {(g.graph_id, g.graph): g for g in report.graphs if g.graph != "inference"}
        counts = {kind: sum(g.count(kind) for g in latest.values()) for kind in COLLECTIVE_KINDS}
        predicted = {f"{name}{gid}": dict(g.predicted) for (gid, name), g in latest.items()}
        times = [_number(p, "time_s") for p in predicted.values()]
        peaks = [
            p for p in (_number(q, "live_peak_bytes") for q in predicted.values()) if p is not None
        ]
        return {
            "counts": counts,
            "bytes": {
                kind: sum(g.total_bytes(kind) for g in latest.values()) for kind in COLLECTIVE_KINDS
            },
            "predicted": {k: v for k, v in predicted.items() if v} or None,
            "predicted_step_time_s": (
                sum(times) if times and all(t is not None for t in times) else None  # type: ignore[misc]
            ),
            "predicted_peak_mem_bytes": int(max(peaks)) if peaks else None,
        }


def plain_loss(value: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (``loss_parallel`` returns a replicated DTensor)."""
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


def _number(values: dict, key: str) -> float | None:
    value = values.get(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None
