"""``simplefsdp train --checkpoint.init_from_hf`` on a tiny transformers
GPT-OSS (2 ranks), then ``simplefsdp export --format hf`` and
``from_pretrained``: the exported model gives our logits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_runs import small_args, train_env

pytestmark = [pytest.mark.slow, pytest.mark.heavy]
transformers = pytest.importorskip("transformers")

TIMEOUT_S = 300


def _run(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "simplefsdp.cli", *argv],
        cwd=cwd, env=train_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip


def _train(cwd: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    return _run(
        cwd, "train", *small_args(2), "--nproc", "2", "--model.name", "gpt_oss_debug",
        "--metrics.output_dir", name, "--checkpoint.folder", f"{name}/ck",
        "--checkpoint.init_from_hf", "hf_in", *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    from simplefsdp.models.gpt_oss.configs import GPT_OSS_CONFIGS
    from simplefsdp.models.gpt_oss.hf_adapter import GPT_OSS_HF_ADAPTER

    cwd = tmp_path_factory.mktemp("gpt_oss_cli")
    config = GPT_OSS_HF_ADAPTER.config_to_hf(GPT_OSS_CONFIGS["gpt_oss_debug"])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.GptOssConfig(**config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not name.endswith("norm.weight"):
                param.normal_(0, 1.0 if "embed" in name else 0.05)
    model.save_pretrained(cwd / "hf_in")
    return cwd


def test_fine_tune_and_export_to_transformers(folder: Path) -> None:
    from safetensors.torch import load_file

    from simplefsdp.checkpoint.export import model_args_from_config
    from simplefsdp.models.gpt_oss.model import Transformer

    proc = _train(folder, "none")
    assert proc.returncode == 0, proc.stderr
    out = _run(folder, "export", "--checkpoint", "none", "--format", "hf", "--out", "hf_out")
    assert out.returncode == 0, out.stderr
    ours = _run(folder, "export", "--checkpoint", "none", "--out", "ours.safetensors")
    assert ours.returncode == 0, ours.stderr
    config = json.loads((folder / "ours.config.json").read_text())
    model = Transformer(model_args_from_config(config))
    model.load_state_dict(load_file(str(folder / "ours.safetensors")))
    original = load_file(str(folder / "hf_in" / "model.safetensors"))
    tuned = load_file(str(folder / "hf_out" / "model-00001-of-00001.safetensors"))
    assert not torch.equal(original["lm_head.weight"], tuned["lm_head.weight"])  # it trained
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder / "hf_out", attn_implementation="eager"
    ).eval()
    tokens = torch.randint(0, 260, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        diff = (hf(tokens).logits - model.eval()(tokens)).abs().max().item()
    print(f"gpt_oss CLI fine-tune -> export -> from_pretrained max abs logit diff: {diff:.2e}")
    assert diff < 1e-4
