"""How the commands' processes end: :func:`exit_quickly`.

A leaf module: it imports only the standard library.
"""

from __future__ import annotations

import gc
import sys
from typing import NoReturn


def exit_quickly(code: int | None) -> NoReturn:
    """Exit with ``code`` without Python's final pass over every object.

    Called by the entry points of ``simplefsdp`` and of the processes it
    starts (train and bench workers, the planner) once their work is done."""
    # Note: [Leaving a process quickly]
    # When Python exits it collects garbage over every object still alive:
    # torch's modules, Inductor's and our own, about a second of CPU per
    # process on 2 cores (a launcher and each of its workers). Collecting
    # once now and freezing what is left makes that last pass skip them;
    # atexit handlers still run, files are still flushed and closed, and
    # garbage made before this point is finalized by the collection here.
    gc.collect()
    gc.freeze()
    sys.exit(code)
