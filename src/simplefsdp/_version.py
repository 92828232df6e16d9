"""The package version (read without importing torch)."""

__version__ = "0.1.0"
