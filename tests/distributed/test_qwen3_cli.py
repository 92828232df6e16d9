"""Fine-tuning a Hugging Face Qwen3-MoE folder from the command line and
exporting it back: ``simplefsdp train --model qwen3_moe_debug
--checkpoint.init_from_hf DIR --nproc 2 --parallel.ep 2``, then ``simplefsdp
export --format hf``, read by ``transformers``' ``from_pretrained``.

The tiny transformers model has ``qwen3_moe_debug``'s shape (the byte
vocabulary of the default data). Each rank reads its 4 of the 8 experts.
The export gives our exported model's logits, its weights moved, and a
named model other than the checkpoint's is one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_runs import small_args, train_env

transformers = pytest.importorskip("transformers")

TIMEOUT_S = 300


def _run(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "simplefsdp.cli", *argv],
        cwd=cwd, env=train_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip


def _train(cwd: Path, name: str, *extra: str) -> subprocess.CompletedProcess:
    return _run(
        cwd, "train", *small_args(2), "--nproc", "2", "--metrics.output_dir", name,
        "--checkpoint.folder", f"{name}/ck", "--checkpoint.init_from_hf", "hf_in", *extra,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    from simplefsdp.checkpoint.hf import hf_config_from_model_args
    from simplefsdp.models.registry import resolve_flavor

    cwd = tmp_path_factory.mktemp("qwen3cli")
    config = hf_config_from_model_args(resolve_flavor("qwen3_moe_debug")[1])
    hf_config = transformers.AutoConfig.for_model(**config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    model.save_pretrained(cwd / "hf_in")
    proc = _train(cwd, "ep", "--model.name", "qwen3_moe_debug", "--parallel.ep", "2")
    assert proc.returncode == 0, proc.stderr
    out = _run(cwd, "export", "--checkpoint", "ep", "--format", "hf", "--out", "hf_out")
    assert out.returncode == 0, out.stderr
    ours = _run(cwd, "export", "--checkpoint", "ep", "--out", "ours.safetensors")
    assert ours.returncode == 0, ours.stderr
    return cwd


@pytest.mark.heavy
def test_transformers_loads_the_fine_tuned_export_with_our_logits(tuned):
    from safetensors.torch import load_file

    from simplefsdp.checkpoint.export import model_args_from_config
    from simplefsdp.models.registry import get_spec

    config = json.loads((tuned / "ours.config.json").read_text())
    args = model_args_from_config(config)
    ours = get_spec("qwen3_moe").build(args)
    ours.load_state_dict(load_file(str(tuned / "ours.safetensors")))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tuned / "hf_out").eval()
    start = transformers.AutoModelForCausalLM.from_pretrained(tuned / "hf_in")
    moved = [n for n, p in start.state_dict().items() if not torch.equal(p, hf.state_dict()[n])]
    assert any("experts" in n for n in moved) and any("q_norm" in n for n in moved), moved
    tokens = torch.randint(0, 260, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours.eval()(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.heavy
def test_named_model_that_differs_is_one_line(tuned):
    proc = _train(tuned, "bad", "--model.name", "qwen3_debug")
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr
    assert "model.name 'qwen3_debug' is of family 'qwen3'" in errors[0], proc.stderr
    assert "holds a 'qwen3_moe' model" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
