"""``python -m simplefsdp.train``: the per-rank entry point for torchrun (see :mod:`.cli`)."""

import gc
import sys

from simplefsdp.train.cli import main

if __name__ == "__main__":
    code = main()
    gc.collect()  # Note: [Leaving a process quickly] in simplefsdp/cli.py
    gc.freeze()
    sys.exit(code)
