"""Training metrics: MFU, JSON lines, TensorBoard and progress lines.

Peak memory is measured by ``simplefsdp.engines.MemoryProbe``.

TensorBoard is used only when ``torch.utils.tensorboard`` imports; the
progress bar (``tqdm``, a dependency) only when stdout is a terminal;
otherwise the progress display is one plain line per log step.

Note: [Peak memory on CPU]
    On CUDA the peak is the caching allocator's ``max_memory_allocated`` (live
    tensor bytes), reset at start-up. On CPU there is no allocator statistic, so
    the peak is the process's peak resident set size (``VmHWM`` from
    ``/proc/self/status``, or ``ru_maxrss`` from ``resource.getrusage`` where
    ``/proc`` is missing) *minus* the resident size measured once at start-up,
    before the model is built (Python, torch and the corpus). Where the kernel
    allows it, the high-water mark is reset at that moment too (writing ``5``
    to ``/proc/self/clear_refs``), so a transient peak while reading the corpus
    is not counted; otherwise the reported peak may include it. It therefore
    counts model, optimizer,
    gradient and activation memory plus allocator slack. glibc's malloc would
    keep freed large blocks in its heap once its dynamic mmap threshold has
    grown, so RSS would no longer fall when tensors are freed; the trainer
    fixes the threshold (``simplefsdp.engines.lower_mmap_threshold``, ``mallopt
    M_MMAP_THRESHOLD``, :data:`MMAP_THRESHOLD_BYTES` = 4 MiB) so that large
    tensors are always mmap-ed and returned to the OS on free. The value is a
    trade-off: 1 MiB tracks small models more closely but each fresh mapping
    is zero-filled by the kernel, which cost about a quarter of the step time
    of the debug model on CPU; smaller tensors come from the reused heap. It
    is called by the trainer inside the training process only, never at
    import, and is a no-op where glibc is not available.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

logger = logging.getLogger(__name__)


#: Dense bf16 peak FLOP/s by a substring of ``torch.cuda.get_device_name()``.
#: Ordered: the first matching key wins (so "H100 PCIe" is tested before "H100").
GPU_PEAK_BF16_FLOPS: dict[str, float] = {
    "GB200": 2.5e15,
    "B200": 2.25e15,
    "H200": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,
    "H800": 989e12,
    "H20": 148e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "A10G": 70e12,
    "A10": 125e12,
    "MI355X": 2.5e15,
    "MI325X": 1307e12,
    "MI300X": 1307e12,
    "MI250X": 383e12,
}

#: Allocations at least this large are always mmap-ed (see [Peak memory on CPU]).
MMAP_THRESHOLD_BYTES = 4 << 20


def peak_flops_for(device: torch.device) -> float | None:
    """Dense bf16 peak FLOP/s of ``device`` from :data:`GPU_PEAK_BF16_FLOPS`.

    Returns ``None`` on CPU and for GPUs not in the table (MFU is then not
    reported rather than guessed).
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in GPU_PEAK_BF16_FLOPS.items():
        if key in name:
            return flops
    logger.info("peak FLOP/s of %r unknown; MFU will not be reported", name)
    return None


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation in percent, or ``None`` without a known peak."""
    if not peak_flops or tokens_per_s <= 0:
        return None
    return 100.0 * tokens_per_s * flops_per_token / peak_flops


def format_bytes(num_bytes: float | None) -> str:
    """``123.4 MiB``-style text; ``"n/a"`` for ``None``."""
    if num_bytes is None:
        return "n/a"
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"  # pragma: no cover - loop always returns


def _jsonable(value: Any) -> Any:
    """Floats that JSON can write (NaN/inf become strings), everything else as is."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsWriter:
    """Writes metric records as JSON lines and, optionally, TensorBoard scalars.

    Only the rank that should write creates one (rank 0 in the trainer).

    Args:
        output_dir: folder for ``metrics.jsonl`` and ``tensorboard/``.
        tensorboard: also write TensorBoard events when
            ``torch.utils.tensorboard`` can be imported (a warning otherwise).
        filename: name of the JSON lines file.
        run_id: written into every record (see Note: [One run per folder]).
        wandb: also log every record's numbers to Weights & Biases (the
            ``wandb`` package, ``pip install simplefsdp[wandb]``; a warning
            where it is missing). ``WANDB_MODE=offline`` keeps the run on disk
            (``<output_dir>/wandb``) for ``wandb sync`` later.
        wandb_project: the W&B project.
        wandb_run_name: the W&B run's name (default: ``run_id``); the W&B run
            id is ``run_id``, so a resumed run continues the same W&B run.
        config: the job configuration, stored with the W&B run.
    """

    def __init__(
        self,
        output_dir: str | os.PathLike[str],
        *,
        tensorboard: bool = False,
        filename: str = "metrics.jsonl",
        run_id: str = "",
        wandb: bool = False,
        wandb_project: str = "simplefsdp",
        wandb_run_name: str = "",
        config: dict[str, Any] | None = None,
    ) -> None:
        self.output_dir = Path(output_dir)
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.output_dir / filename
        self._file: TextIO | None = self.path.open("a", encoding="utf-8")
        self._tb = self._open_tensorboard() if tensorboard else None
        self.run_id = run_id
        self._wandb = (
            self._open_wandb(wandb_project, wandb_run_name or run_id, config) if wandb else None
        )

    def _open_wandb(self, project: str, name: str, config: dict[str, Any] | None) -> Any:
        try:
            import wandb
        except ImportError:
            logger.warning(
                "metrics.wandb is on but wandb is not installed (pip install "
                "'simplefsdp[wandb]'); writing JSON lines only"
            )
            return None
        return wandb.init(
            project=project,
            name=name,
            id=self.run_id or None,
            resume="allow",
            dir=str(self.output_dir),
            config=config,
        )

    def _open_tensorboard(self) -> Any:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            logger.warning(
                "metrics.tensorboard is on but TensorBoard is not installed "
                "(pip install tensorboard); writing JSON lines only"
            )
            return None
        return SummaryWriter(log_dir=str(self.output_dir / "tensorboard"))

    @property
    def tensorboard_dir(self) -> Path | None:
        """The TensorBoard folder, or ``None`` when not writing events."""
        return None if self._tb is None else self.output_dir / "tensorboard"

    def write(self, record: dict[str, Any], *, step: int) -> None:
        """Append ``record`` (plus ``step`` and a wall-clock ``time``) and flush."""
        full = {"step": step, "time": round(time.time(), 3), **record}
        if self.run_id:
            full["run_id"] = self.run_id
        if self._file is not None:
            self._file.write(json.dumps({k: _jsonable(v) for k, v in full.items()}) + "\n")
            self._file.flush()
        numbers = {
            key: value
            for key, value in record.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb is not None and numbers:
            self._wandb.log(numbers, step=step)

    def close(self) -> None:
        """Flush and close the files."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


@dataclass
class ProgressDisplay:
    """Rank-0 progress: a ``tqdm`` bar on a terminal when installed, else plain lines.

    The lines are the same either way (``format_step_line``): on a terminal
    they are written above the bar, elsewhere (a log file, a pipe) they are
    all there is.

    Args:
        total_steps: last step of the run.
        start_step: step the run starts after (non-zero when resuming).
        enabled: ``False`` on ranks other than 0 (then nothing is shown).
        stream: where to write (default: ``sys.stdout`` when created); the
            bar is shown only if it is a terminal (``isatty()``).
    """

    total_steps: int
    start_step: int = 0
    enabled: bool = True
    stream: TextIO | None = None

    def __post_init__(self) -> None:
        self._bar: Any = None
        if self.stream is None:
            self.stream = sys.stdout
        isatty = getattr(self.stream, "isatty", None)
        if not self.enabled or not (callable(isatty) and isatty()):
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(
            total=self.total_steps,
            initial=self.start_step,
            unit="step",
            dynamic_ncols=True,
            file=self.stream,
        )

    def update(self, step: int) -> None:
        """Advance the bar to ``step`` (no-op for plain lines)."""
        if self._bar is not None:
            self._bar.update(step - self._bar.n)

    def line(self, text: str) -> None:
        """Print one line of progress (above the bar, if any)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        """Close the bar."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class Heartbeat:
    """While the block runs, call ``emit(message(elapsed_s))`` every ``every_s`` seconds.

    For long silent phases (the first, compiling step): a background thread
    that only formats and prints.
    """

    def __init__(
        self, message: Callable[[float], str], emit: Callable[[str], None], every_s: float = 30.0
    ) -> None:
        self.message, self.emit, self.every_s = message, emit, every_s
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self, start: float) -> None:
        while not self._done.wait(self.every_s):
            self.emit(self.message(time.perf_counter() - start))

    def __enter__(self) -> Heartbeat:
        self._thread = threading.Thread(
            target=self._run, args=(time.perf_counter(),), name="simplefsdp-heartbeat", daemon=True
        )
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()


class CompileWatch:
    """Whether torch is compiling at this moment, for the first step's heartbeat.

    While the block runs, callbacks registered with dynamo's compile callback
    handler (removed on exit: it is process-wide) count the compilations in
    progress (dynamo's frames and AOTAutograd's lazily compiled backward), so
    that a long first step says whether it is compiling or executing.
    """

    def __init__(self) -> None:
        self.compiling = False
        self.compiled_s = 0.0
        self._started: float | None = None
        self._handler: Any = None

    def _start(self, *_: object) -> None:
        self.compiling, self._started = True, time.perf_counter()

    def _end(self, *_: object) -> None:
        if self._started is not None:
            self.compiled_s += time.perf_counter() - self._started
        self.compiling, self._started = False, None

    def message(self, elapsed_s: float) -> str:
        """The heartbeat line after ``elapsed_s`` seconds of the step."""
        if self._handler is None:  # no callbacks in this torch: cannot tell
            return f"  still compiling or running the first step: {elapsed_s:.0f}s"
        if self.compiling:
            return f"  still compiling: {elapsed_s:.0f}s"
        return (
            f"  running the compiled step: {elapsed_s:.0f}s "
            f"(compiling took {self.compiled_s:.0f}s of it)"
        )

    def __enter__(self) -> CompileWatch:
        try:
            from torch._dynamo.callback import callback_handler
        except ImportError:
            return self
        callback_handler.register_start_callback(self._start)
        callback_handler.register_end_callback(self._end)
        self._handler = callback_handler
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handler is not None:
            self._handler.remove_start_callback(self._start)
            self._handler.remove_end_callback(self._end)
            self._handler = None


def format_step_line(step: int, total_steps: int, record: dict[str, Any]) -> str:
    """One progress line: ``step 10/200 | loss 4.1234 | lr 5.0e-04 | ...``."""
    parts = [f"step {step:>{len(str(total_steps))}d}/{total_steps}"]
    parts.append(f"loss {record['loss']:.4f}")
    if "val_loss" in record:
        parts.append(f"val_loss {record['val_loss']:.4f}")
    parts.append(f"lr {record['lr']:.2e}")
    parts.append(f"grad_norm {record['grad_norm']:.3f}")
    parts.append(f"tok/s/rank {record['tokens_per_s_per_rank']:,.0f}")
    if record.get("mfu_pct") is not None:
        parts.append(f"mfu {record['mfu_pct']:.1f}%")
    parts.append(f"mem {format_bytes(record.get('peak_memory_bytes'))}")
    if record.get("moe_imbalance") is not None:
        parts.append(f"moe imb {record['moe_imbalance']:.2f}")
    if "checkpoint_blocking_s" in record:  # the time a save held up training
        parts.append(f"save blocked {record['checkpoint_blocking_s']:.2f}s")
    if record.get("checkpoint_staging_wait_s"):
        parts.append(f"save copy wait {record['checkpoint_staging_wait_s']:.2f}s")
    return " | ".join(parts)


@dataclass
class TrainSummary:
    """What a finished run reports (rank 0's view; losses are global means).

    ``tokens_per_s`` is per rank and excludes the first step (compilation).
    """

    steps: int = 0
    start_step: int = 0
    first_loss: float | None = None
    final_loss: float | None = None
    final_val_loss: float | None = None
    tokens_per_s: float | None = None
    peak_memory_bytes: int | None = None
    memory_kind: str = ""
    elapsed_s: float = 0.0
    checkpoint: str | None = None
    output_dir: str = ""
    metrics_path: str | None = None
    tensorboard_dir: str | None = None
    losses: list[float] = field(default_factory=list)
    run_id: str = ""
    compile_s: float | None = None
    interrupted_by: str = ""
    #: With a loss mask (chat data): tokens read and tokens trained on, all ranks.
    tokens_read: int | None = None
    tokens_trained: int | None = None

    def format(self) -> str:
        """A multi-line human-readable summary."""

        def num(x: float | None, fmt: str) -> str:
            return "n/a" if x is None else format(x, fmt)

        head = "training finished"
        if self.interrupted_by:
            head = f"training stopped by {self.interrupted_by} after step {self.steps}"
        lines = [
            head,
            f"  run            {self.run_id}",
            f"  steps          {self.start_step} -> {self.steps} in {self.elapsed_s:.1f}s",
            f"  loss           {num(self.first_loss, '.4f')} -> {num(self.final_loss, '.4f')}",
            f"  val loss       {num(self.final_val_loss, '.4f')}",
            f"  tokens/s/rank  {num(self.tokens_per_s, ',.0f')}",
            *(
                [
                    f"  tokens         {self.tokens_read:,} read, {self.tokens_trained:,} "
                    f"trained on ({100 * self.tokens_trained / max(self.tokens_read, 1):.0f}%, "
                    "the assistant's)"
                ]
                if self.tokens_read is not None and self.tokens_trained is not None
                else []
            ),
            f"  peak memory    {format_bytes(self.peak_memory_bytes)} ({self.memory_kind})",
            f"  compile        {num(self.compile_s, '.1f')}s (first step)"
            if self.compile_s is not None
            else "  compile        off",
            f"  checkpoint     {self.checkpoint or 'none'}",
            f"  metrics        {self.metrics_path or 'none'}",
        ]
        if self.tensorboard_dir:
            lines.append(f"  tensorboard    {self.tensorboard_dir}")
        return "\n".join(lines)
