"""``simplefsdp bench --cp``: which configurations run, and the one-line refusals."""

from __future__ import annotations

import pytest

from simplefsdp.bench.configs import CP_CONFIGS, get_workload, resolve_configs


def test_cp_selects_the_engines_that_compose() -> None:
    names = [c.name for c in resolve_configs(None, cp=2)]
    assert "fsdp2" in names and "simplefsdp-auto" in names
    assert "ddp" not in names and "simplefsdp-eager" not in names and "limit" not in names
    assert not set(CP_CONFIGS) & set(names)  # torch's: CUDA only
    assert "fsdp2-torch-cp" in [c.name for c in resolve_configs(None, cp=2, cuda=True)]
    assert get_workload("long").seq_len % 8 == 0


def test_cp_refusals_are_one_line() -> None:
    with pytest.raises(ValueError, match=r"^configuration 'fsdp2-torch-cp': torch's context "):
        resolve_configs("fsdp2-torch-cp", cp=2)
    with pytest.raises(ValueError, match=r"^configuration 'ddp' does not run with --cp 2; valid"):
        resolve_configs("ddp", cp=2)
    with pytest.raises(ValueError, match=r"run with --cp > 1; add --cp 2$"):
        resolve_configs("fsdp2-torch-cp", cuda=True)
