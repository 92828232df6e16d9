"""``python -m simplefsdp.train``: the per-rank entry point for torchrun (see :mod:`.cli`)."""

from simplefsdp._exit import exit_quickly
from simplefsdp.train.cli import main

if __name__ == "__main__":
    exit_quickly(main())
