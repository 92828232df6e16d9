"""simplefsdp: fully sharded data parallel as DTensor parametrization."""

__version__ = "0.1.0"
