"""``python -m simplefsdp.train``: the per-rank entry point for torchrun (see :mod:`.cli`)."""

import sys

from simplefsdp.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
