"""The README's path from training to using the model, as a user runs it.

``simplefsdp train`` (2 steps of the debug model, 2 CPU processes, eager) ->
``simplefsdp export`` -> ``examples/load_exported_model.py`` in a plain
process; and the exported files' permissions. About 30-40 s on two cores.
"""

from __future__ import annotations

import json
import math
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_runs import checkpoints, only_run

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "load_exported_model.py"
TRAIN = [
    "train", "--model.name", "debug", "--training.steps", "2", "--checkpoint.interval", "2",
    "--metrics.log_interval", "1", "--compile.enable", "false",
    # keep it short: 300 kB of the corpus, small batches, no validation
    "--data.max_bytes", "300000", "--data.seq_len", "64", "--data.batch_size", "2",
    "--metrics.val_interval", "0",
]  # fmt: skip
TIMEOUT_S = 240


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert proc.returncode == 0, f"{cmd}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A 2-step run in a fresh folder, exported as the README says."""
    cwd = tmp_path_factory.mktemp("run")
    _run([sys.executable, "-m", "simplefsdp.cli", *TRAIN], cwd)
    run = only_run(cwd / "outputs" / "debug")
    assert (run / "checkpoints" / "step-2").is_dir()
    cmd = ["export", "--checkpoint", "outputs/debug", "--out", "model.safetensors"]
    proc = _run([sys.executable, "-m", "simplefsdp.cli", *cmd], cwd)
    assert "wrote model.safetensors" in proc.stdout
    return cwd


def test_example_loads_the_export_and_generates(exported):
    cwd = exported
    prompt = "import os\ndef "
    cmd = [sys.executable, str(EXAMPLE), "--model", "model.safetensors",
           "--prompt", prompt, "--max-new-tokens", "12"]  # fmt: skip
    out = _run(cmd, cwd).stdout
    lines = out.splitlines()
    assert lines[0].startswith("loaded model.safetensors: 3.28M parameters, trained 2 steps")
    assert "ByteTokenizer" in lines[0]
    loss = float(re.search(r"^prompt loss ([0-9.]+) ", out, re.M).group(1))
    n_new = int(re.search(r"^generated (\d+) tokens", out, re.M).group(1))
    assert 0 < n_new <= 12
    assert out.split("(greedy):\n", 1)[1].startswith(prompt)

    # The printed loss is what plain torch computes from the exported file.
    from safetensors.torch import load_file

    from simplefsdp.checkpoint.export import model_args_from_config
    from simplefsdp.models.llama3 import Transformer

    config = json.loads((cwd / "model.config.json").read_text())
    model = Transformer(model_args_from_config(config))
    model.load_state_dict(load_file(str(cwd / "model.safetensors")))
    tokens = torch.tensor([list(prompt.encode())])
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(model(tokens[:, :-1])[0], tokens[0, 1:])
    assert math.isclose(loss, expected.item(), abs_tol=1e-4)
    assert 3.0 < loss < 8.0  # 2 steps: well above a trained model's, near log(260) = 5.56


def test_exported_files_follow_the_umask(exported, tmp_path):
    cwd = exported
    mask = _umask()
    assert _mode(cwd / "model.safetensors") == 0o666 & ~mask
    assert _mode(cwd / "model.config.json") == 0o666 & ~mask

    from simplefsdp.checkpoint.export import export_checkpoint

    out = tmp_path / "model.safetensors"
    out.write_bytes(b"old")
    out.chmod(0o600)  # a file it replaces does not lend its mode
    old = os.umask(0o027)
    try:
        weights, config = export_checkpoint(checkpoints(only_run(cwd / "outputs" / "debug")), out)
    finally:
        os.umask(old)
    assert _mode(weights) == 0o640 and _mode(config) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.config.json", "model.safetensors"]
