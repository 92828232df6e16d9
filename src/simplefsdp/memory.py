"""Process memory measurement on CPU (peak RSS) and GPU (allocator stats).

Note: [Measuring peak memory on CPU]
    glibc serves small allocations from its heap and rarely returns freed heap
    memory to the OS, so the resident set size (RSS) would not drop when a
    tensor is freed and peaks would be meaningless. ``lower_mmap_threshold``
    makes glibc serve every allocation above the threshold with its own
    ``mmap``, which ``free`` unmaps at once, so RSS follows tensor lifetimes.
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


class PeakMemory:
    """Measure peak memory of a region: CUDA allocator peak or CPU peak RSS.

    Example::

        with PeakMemory(device) as peak:
            step()
        print(peak.peak_bytes)  # above the baseline at entry
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.baseline_bytes: int | None = None
        self.peak_bytes: int | None = None

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline_bytes = torch.cuda.memory_allocated(self.device)
        else:
            self.baseline_bytes = reset_peak_rss()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self.baseline_bytes
        else:
            peak = peak_rss_bytes()
            if peak is not None and self.baseline_bytes is not None:
                self.peak_bytes = peak - self.baseline_bytes
