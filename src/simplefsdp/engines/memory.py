"""The one memory probe: peak memory of a region on CPU (peak RSS) and GPU (allocator).

Used by the trainer (``peak memory`` in the metrics), the benchmark workers
and the memory tests; see :class:`MemoryProbe`.

Note: [Measuring peak memory on CPU]
    glibc serves small allocations from its heap and rarely returns freed heap
    memory to the OS, so the resident set size (RSS) would not drop when a
    tensor is freed and peaks would be meaningless. ``lower_mmap_threshold``
    makes glibc serve an allocation above the threshold with its own
    ``mmap``, which ``free`` unmaps at once, so RSS follows tensor lifetimes;
    but only where no free chunk of the heap fits it. After a large compile
    the heap has such chunks; ``malloc_trim`` (``MemoryProbe.reset``) gives
    their pages back, and tensors placed in them later make those pages
    resident again, where they stay once the tensors are freed. A region's
    peak can therefore include a few MiB of heap that an earlier phase
    (compiling) had used (docs/benchmarks.md, "Peak memory on CPU").
    ``reset_peak_rss`` writes ``5`` to ``/proc/self/clear_refs``, which resets
    the kernel's high-water mark ``VmHWM``; the peak of a region is then
    ``VmHWM`` read afterwards minus ``VmRSS`` read at the reset (the baseline).
    Linux only; elsewhere these functions return ``None``/``False``, except
    ``read_rss_bytes``, which falls back to ``ru_maxrss`` (the peak).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

import torch

logger = logging.getLogger(__name__)

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter number


def _libc():
    """The C library on Linux, or ``None`` (elsewhere, or when it cannot be
    loaded). A libc without ``mallopt``/``malloc_trim`` makes callers return False."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def lower_mmap_threshold(threshold_bytes: int = 64 * 1024) -> bool:
    """Ask glibc to mmap allocations above ``threshold_bytes``; True on success.

    Process-wide and irreversible: call it in a training or benchmark
    process, never on import. See Note: [Measuring peak memory on CPU].
    """
    libc = _libc()
    try:
        return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, int(threshold_bytes)))
    except AttributeError:
        return False


def malloc_trim() -> bool:
    """Return freed glibc heap memory to the OS (``malloc_trim(0)``); True on success."""
    libc = _libc()
    try:
        return libc is not None and bool(libc.malloc_trim(0))
    except AttributeError:
        return False


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def current_rss_bytes() -> int | None:
    kib = _status_kib("VmRSS")
    return None if kib is None else kib * 1024


def peak_rss_bytes() -> int | None:
    """The kernel's RSS high-water mark since start or the last reset."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


def read_rss_bytes() -> tuple[int, int]:
    """``(current_rss, peak_rss)`` of this process in bytes (0 when unknown).

    Without ``/proc`` (macOS, BSD), both are ``ru_maxrss``, the peak.
    """
    current, peak = current_rss_bytes(), peak_rss_bytes()
    if current is not None and peak is not None:
        return current, peak
    try:
        import resource
    except ImportError:  # pragma: no cover - non-POSIX
        return 0, 0
    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    max_rss *= 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
    return max_rss, max_rss


def reset_peak_rss() -> int | None:
    """Reset the RSS high-water mark; returns the current RSS (the baseline)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return None
    return current_rss_bytes()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class MemoryProbe:
    """Peak memory of this process above a baseline: CUDA allocator or CPU peak RSS.

    The baseline is taken at construction (for a training process: after
    start-up, before the model is built; on CPU after ``malloc_trim``). :meth:`reset` starts a measured
    region (CPU: ``malloc_trim`` then a reset of the kernel's high-water mark;
    CUDA: a reset of the allocator's peak), :meth:`peak_bytes` reads the peak
    since the last reset, above the baseline. On CPU the numbers follow tensor
    lifetimes only after :func:`lower_mmap_threshold` (see Note: [Measuring
    peak memory on CPU]). Also a context manager for one region::

        with MemoryProbe(device) as probe:
            step()
        print(probe.peak)  # bytes above the level at entry

    Attributes:
        kind: what is measured (``"cuda_max_allocated_over_baseline"`` or
            ``"cpu_peak_rss_over_baseline"``), for reports.
        baseline_bytes: the level at construction (``None``: unknown here).
        start_bytes: the level when the last :meth:`reset` ran, above the baseline.
        reset_ok: whether the last reset of the CPU high-water mark worked
            (without it the peak also covers what ran before the reset).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.kind = "cuda_max_allocated_over_baseline" if cuda else "cpu_peak_rss_over_baseline"
        _synchronize(self.device)
        if not cuda:
            malloc_trim()  # freed heap pages must not inflate the baseline
        self.baseline_bytes: int | None = self._current()
        self.start_bytes: int | None = None
        self.reset_ok = True
        self.peak: int | None = None

    def _current(self) -> int | None:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return current_rss_bytes()

    def _above_baseline(self, value: int | None) -> int | None:
        if value is None or self.baseline_bytes is None:
            return None
        return int(value - self.baseline_bytes)

    def reset(self) -> None:
        """Start a measured region: reset the peak, remember the level now."""
        _synchronize(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start_bytes = self._above_baseline(self._current())
            return
        malloc_trim()
        rss = reset_peak_rss()
        self.reset_ok = rss is not None
        self.start_bytes = self._above_baseline(rss if rss is not None else current_rss_bytes())

    def level_bytes(self) -> int | None:
        """The level now, above the baseline (CPU: after ``malloc_trim``); no reset."""
        _synchronize(self.device)
        if self.device.type != "cuda":
            malloc_trim()
        return self._above_baseline(self._current())

    def peak_bytes(self) -> int | None:
        """The peak since the last :meth:`reset`, above the baseline (``None``: unknown)."""
        _synchronize(self.device)
        if self.device.type == "cuda":
            return self._above_baseline(int(torch.cuda.max_memory_allocated(self.device)))
        if self.baseline_bytes is None:
            return None
        return max(0, read_rss_bytes()[1] - self.baseline_bytes)

    def __enter__(self) -> MemoryProbe:
        self.baseline_bytes = None
        self.reset()
        self.baseline_bytes, self.start_bytes, self.peak = self._current(), 0, None
        return self

    def __exit__(self, *exc: object) -> None:
        self.peak = self.peak_bytes()
