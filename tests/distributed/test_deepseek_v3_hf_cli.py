"""``simplefsdp train --model deepseek_v3_debug --checkpoint.init_from_hf`` on a
random transformers ``DeepseekV3ForCausalLM`` of the debug shape, 2 ranks,
2 steps; ``simplefsdp export --format hf`` of the result loads with
``from_pretrained`` and gives our logits, and the weights moved.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_runs import small_args, train_env

pytestmark = pytest.mark.heavy

TIMEOUT_S = 300


def _run(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "simplefsdp.cli", *argv],
        cwd=cwd, env=train_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip


def test_fine_tune_from_transformers_and_export(tmp_path):
    transformers = pytest.importorskip("transformers")
    from simplefsdp.checkpoint.hf import HFCheckpoint, load_hf_weights
    from simplefsdp.models.deepseek_v3 import DEEPSEEK_V3_CONFIGS
    from simplefsdp.models.deepseek_v3.hf_adapter import config_to_hf
    from simplefsdp.models.registry import get_spec

    config = transformers.DeepseekV3Config(**config_to_hf(DEEPSEEK_V3_CONFIGS["deepseek_v3_debug"]))
    torch.manual_seed(0)
    source = transformers.AutoModelForCausalLM.from_config(config).float()
    source.save_pretrained(tmp_path / "hf_in")
    train = _run(
        tmp_path, "train", *small_args(2), "--training.warmup_steps", "1", "--nproc", "2",
        "--model", "deepseek_v3_debug", "--metrics.output_dir", "run",
        "--checkpoint.folder", "run/ck", "--checkpoint.init_from_hf", "hf_in",
    )  # fmt: skip
    assert train.returncode == 0, train.stderr
    export = _run(tmp_path, "export", "--checkpoint", "run", "--format", "hf", "--out", "hf_out")
    assert export.returncode == 0, export.stderr

    ckpt = HFCheckpoint(tmp_path / "hf_out")
    ours = get_spec("deepseek_v3").build(ckpt.args)
    load_hf_weights(ours, ckpt)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out").eval()
    tokens = torch.randint(0, 260, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, ours.eval()(tokens), rtol=1e-5, atol=1e-5)
    before = source.state_dict()
    changed = [n for n, v in back.state_dict().items() if not torch.equal(v, before[n])]
    assert changed, "the fine-tuned weights equal the initial ones"
