"""The digest of what a rank gathered (Note: [Same gathers on every rank]):
the same keys in the same order give the same digest in every process (no
per-process string hashing), and any other sequence a different one."""

from __future__ import annotations

import os
import subprocess
import sys

from simplefsdp.frontend import rank_check


def _digest(keys: list[str]) -> int:
    rank_check.reset()
    for key in keys:
        rank_check.record(key)
    digest = rank_check._digest
    rank_check.reset()
    return digest


def test_order_and_content_matter() -> None:
    base = _digest(["experts.0.weight", "experts.0.bias", "head.weight"])
    assert base == _digest(["experts.0.weight", "experts.0.bias", "head.weight"])
    others = [
        _digest(["experts.3.weight", "experts.3.bias", "head.weight"]),  # other expert
        _digest(["experts.0.bias", "experts.0.weight", "head.weight"]),  # order
        _digest(["experts.0.weight", "experts.0.bias"]),  # fewer
        _digest(["experts.0.weight", "experts.0.bias", "head.weight", "head.weight"]),
        _digest([]),
    ]
    assert base not in others and len(set(others)) == len(others)
    assert 0 < base < 2**63


def test_same_digest_in_another_process() -> None:
    code = (
        "from simplefsdp.frontend import rank_check as r\n"
        "[r.record(k) for k in ('a.weight', 'graph:b,c')]\n"
        "print(r._digest)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "123"},  # str hashes differ
    )
    assert int(out.stdout) == _digest(["a.weight", "graph:b,c"])
