"""Compiled simplefsdp graphs are served from Inductor's FX graph cache by a
later process (Note: [Inductor's cache for processed graphs]).

Each run is a fresh interpreter with its own ``PYTHONHASHSEED``: Python salts
``hash()`` of strings per process, which is what made the cache key of a
DTensor graph differ between runs (Note: [Stable DeviceMesh pickles for
Inductor's cache]).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

MESH_PICKLE = textwrap.dedent(
    """
    import pickle, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from simplefsdp._compat import stable_mesh_pickling
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    before = hash(mesh)  # fills the mesh's per-process hash cache
    assert b"_hash" in pickle.dumps(mesh)
    with stable_mesh_pickling():
        data = pickle.dumps(mesh)
    assert b"_hash" not in data
    assert b"_hash" in pickle.dumps(mesh), "the default reducer is back after the block"
    again = pickle.loads(data)
    assert again == mesh and hash(again) == before and again.get_group() is mesh.get_group()
    print("OK")
    """
)

COMPILE_STEP = textwrap.dedent(
    """
    import json, torch, torch.distributed as dist
    import torch._dynamo.config as dynamo_config
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    import simplefsdp
    from simplefsdp.compiler.inductor_cache import inductor_cache_counts
    from simplefsdp.models.llama3 import Transformer, get_config

    def snapshot():
        return {{
            "inductor": inductor_config.get_config_copy(),
            "functorch": functorch_config.get_config_copy(),
            "dynamo": dynamo_config.get_config_copy(),
        }}

    def same(a, b):
        # Sets (e.g. dynamo's _save_config_ignore) may repr in another order.
        try:
            return bool(a == b)
        except Exception:
            return repr(a) == repr(b)

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)
    model = Transformer(get_config("debug", n_layers=1, dim=64, n_heads=2, n_kv_heads=2))
    before = snapshot()
    simplefsdp.data_parallel(model)
    simplefsdp.compile(model, bucketing="per_block")
    model(torch.randint(0, 64, (1, 16))).float().sum().backward()
    after = snapshot()
    changed = sorted(
        f"{{section}}.{{k}}" for section in before for k in before[section]
        if not same(before[section][k], after[section][k])
    )
    print("CONFIG_CHANGED", json.dumps(changed))
    print("COUNTS", json.dumps(inductor_cache_counts()))
    dist.destroy_process_group()
    """
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(code: str, seed: int, env_extra: dict | None = None) -> str:
    env = {**os.environ, "PYTHONHASHSEED": str(seed), "OMP_NUM_THREADS": "1", **(env_extra or {})}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_device_mesh_pickles_without_its_hash_cache_and_round_trips() -> None:
    assert _run(MESH_PICKLE, seed=1).strip() == "OK"


def _printed(out: str, tag: str):
    line = next(x for x in out.splitlines() if x.startswith(tag + " "))
    return json.loads(line.removeprefix(tag + " "))


@pytest.mark.slow
def test_a_second_process_is_served_from_inductors_cache(tmp_path) -> None:
    """Also: compiling and stepping leaves torch's dynamo, functorch and
    Inductor configs as they were, compiled afresh and from the cache."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    counts = []
    for seed in (1, 2):
        out = _run(COMPILE_STEP.format(port=_free_port()), seed, env)
        assert _printed(out, "CONFIG_CHANGED") == [], seed
        counts.append(_printed(out, "COUNTS"))
    assert counts[0]["miss"] >= 2 and counts[0]["hit"] == 0, counts  # forward and backward
    assert counts[1] == {"hit": counts[0]["miss"], "miss": 0, "bypass": 0}, counts
