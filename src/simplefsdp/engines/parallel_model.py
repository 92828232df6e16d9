"""What an engine returns: :class:`ParallelModel`."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["COLLECTIVE_KINDS", "ParallelModel"]

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
    """

    module: nn.Module
    forward: Callable[..., Any]
    engine: str
    mesh: DeviceMesh
    compiled: bool = False
    inductor_patches: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    tp_mesh: DeviceMesh | None = None

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
        one).
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
            "predicted": {k: v for k, v in predicted.items() if v} or None,
            "predicted_step_time_s": (
                sum(times) if times and all(t is not None for t in times) else None  # type: ignore[misc]
            ),
            "predicted_peak_mem_bytes": int(max(peaks)) if peaks else None,
        }


def _number(values: dict, key: str) -> float | None:
    value = values.get(key)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None
