"""Stopping a run cleanly on SIGINT (Ctrl-C) or SIGTERM (schedulers, torchrun).

Note: [Clean stop]
    A SIGINT or SIGTERM only sets a flag; the step in progress finishes.
    After every step the ranks agree (one all-reduce of a flag) whether any of
    them was asked to stop, so they all stop after the same step, save a
    checkpoint of it (when checkpoints are on) and exit with 128 + the signal
    number, rank 0 printing one line. On Ctrl-C the terminal signals every
    process; torchrun's agent then also sends SIGTERM to its workers and kills
    them 30 s later, which bounds how long the final save may take (a save cut
    short leaves the previous checkpoint intact: saves are atomic).
"""

from __future__ import annotations

import signal
from types import FrameType

__all__ = ["StopRequest"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    """Records SIGINT/SIGTERM while installed (a context manager, main thread only).

    Attributes:
        signum: the first signal received, or ``None``.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        for sig in _SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._previous.clear()

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.signum is None:  # later signals (e.g. the agent's SIGTERM after
            self.signum = signum  # the terminal's SIGINT) change nothing

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    @property
    def exit_code(self) -> int:
        return 128 + self.signum if self.signum is not None else 0
