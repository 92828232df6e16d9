"""What ``simplefsdp plan`` predicts for one layout: :class:`Prediction`.

Both plan methods (traced graphs and the analytic expert-parallel model, see
``docs/scale.md``) return it; the command line formats, ranks and writes it
without knowing which method made it. Imports no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Prediction:
    """Per-GPU prediction of one layout (bytes, seconds).

    Attributes:
        layout: the layout predicted (a dataclass with ``dp``, ``batch``,
            ``seq``, ``microbatches``, ``engine`` and ``describe()``).
        hardware: the hardware profile's name.
        memory: the peak's parts (``parameters``, ``gradients``,
            ``optimizer``, ``activations``, ``gathered``, ``temporary``;
            traced plans also ``accumulated``: the unreduced gradient sums
            of a step of several microbatches); they add up to
            ``peak_bytes``.
        peak_bytes, usable_bytes: predicted peak and the profile's usable
            memory per GPU.
        time: the step's parts in seconds (``compute`` with its ``copies``
            and ``hooks``, ``exposed_comm``, ``bubble``, ``optimizer``), the
            totals of each kind of communication (``dp_comm_total``,
            ``tp_comm_total``, ``ep_comm_total`` where experts are
            exchanged) and the step's ``flops``.
        step_s, tokens_per_s_per_gpu, mfu: the step time, throughput and
            model FLOPs utilisation (against the bf16 peak).
        buckets: the bucket plan (parameter FQNs per bucket); ``None`` where
            the method plans no buckets (per-block groups assumed).
        notes: lines for the reader.
        kept: parameters kept gathered from forward to backward (the
            compiled engine's keep search).
        params: parameter counts (``total``, ``activated`` per token,
            ``routed_experts``) where the method reports them.
    """

    layout: Any
    hardware: str
    memory: dict[str, float]
    peak_bytes: float
    usable_bytes: float
    time: dict[str, float]
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    buckets: list[list[str]] | None = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    params: dict[str, float] | None = None

    @property
    def fits(self) -> bool:
        """The predicted peak fits in the usable memory."""
        return self.peak_bytes <= self.usable_bytes

    def to_dict(self) -> dict:
        """The ``--json`` record of this prediction."""
        record: dict[str, Any] = {
            "layout": dataclasses.asdict(self.layout) | {"dp": self.layout.dp},
            "hardware": self.hardware,
        }
        if self.params is not None:
            record["parameters"] = self.params
        record |= {
            "fits": self.fits,
            "peak_bytes": self.peak_bytes,
            "usable_bytes": self.usable_bytes,
            "memory_bytes": self.memory,
            "time_s": self.time,
            "step_s": self.step_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
        }
        if self.buckets is not None:
            record |= {
                "num_buckets": len(self.buckets),
                "buckets": self.buckets,
                "kept_gathered": self.kept,
            }
        record["notes"] = self.notes
        return record
