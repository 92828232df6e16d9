"""Command-line entry point: ``simplefsdp <subcommand>``."""
