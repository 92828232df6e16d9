"""``simplefsdp train --checkpoint.init_from_hf`` and ``simplefsdp export --format hf``.

A random Llama (dim 64, 2 layers, byte vocabulary) is written as a sharded
Hugging Face checkpoint. Two ranks fine-tune it for 2 steps (data parallel)
and the result is exported in both formats: the Hugging Face export read
back equals our own export bitwise, and (with ``transformers`` installed)
``LlamaForCausalLM.from_pretrained`` of it gives our logits. A pipeline run
(pp 2) at a negligible learning rate starts from the checkpoint's weights.
A named model that is not the checkpoint's is a one-line error.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_runs import small_args, train_env

pytestmark = pytest.mark.slow

TIMEOUT_S = 300


def _args():
    from simplefsdp.models.llama3 import ModelArgs

    return ModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=260, multiple_of=32,
        rope_theta=500000.0, max_seq_len=128,
    )  # fmt: skip


def _source() -> dict[str, torch.Tensor]:
    from simplefsdp.models.llama3 import Transformer

    torch.manual_seed(3)
    return {k: v.detach().clone() for k, v in Transformer(_args()).state_dict().items()}


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


def _model(folder: Path):
    """Our model holding a Hugging Face folder's weights."""
    from simplefsdp.checkpoint.hf import HFCheckpoint, load_hf_weights
    from simplefsdp.models.llama3 import Transformer

    ckpt = HFCheckpoint(folder)
    model = Transformer(ckpt.args)
    load_hf_weights(model, ckpt)
    return model.eval()


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    from simplefsdp.checkpoint.hf import save_hf_checkpoint

    cwd = tmp_path_factory.mktemp("hfcli")
    save_hf_checkpoint(_source(), _args(), cwd / "hf_in", max_shard_size="100KB")
    proc = _train(cwd, "dp")
    assert proc.returncode == 0, proc.stderr
    out = _run(cwd, "export", "--checkpoint", "dp", "--format", "hf", "--out", "hf_out",
               "--max-shard-size", "200KB")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "Hugging Face format: LlamaForCausalLM" in out.stdout
    ours = _run(cwd, "export", "--checkpoint", "dp", "--out", "ours.safetensors")
    assert ours.returncode == 0, ours.stderr
    return cwd


def test_hf_export_reads_back_bitwise_equal_to_our_export(tuned):
    from safetensors.torch import load_file

    index = json.loads((tuned / "hf_out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    ours = load_file(str(tuned / "ours.safetensors"))
    back = _model(tuned / "hf_out").state_dict()
    assert set(back) == set(ours)
    for name, value in ours.items():
        assert torch.equal(back[name], value), name
    changed = [n for n, v in _source().items() if not torch.equal(v, ours[n])]
    assert changed, "the fine-tuned weights equal the initial ones"


def test_transformers_loads_the_export_with_our_logits(tuned):
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from simplefsdp.checkpoint.export import model_args_from_config
    from simplefsdp.models.llama3 import Transformer

    config = json.loads((tuned / "ours.config.json").read_text())
    ours = Transformer(model_args_from_config(config))
    ours.load_state_dict(load_file(str(tuned / "ours.safetensors")))
    hf = transformers.LlamaForCausalLM.from_pretrained(tuned / "hf_out").eval()
    tokens = torch.randint(0, 260, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours.eval()(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.heavy
def test_pipeline_run_starts_from_the_checkpoint(tuned):
    proc = _train(
        tuned, "pp", "--parallel.pp", "2", "--parallel.pp_schedule", "gpipe",
        "--training.lr", "1e-12", "--data.batch_size", "2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = _run(tuned, "export", "--checkpoint", "pp", "--out", "pp.safetensors")
    assert out.returncode == 0, out.stderr
    from safetensors.torch import load_file

    got = load_file(str(tuned / "pp.safetensors"))
    for name, value in _source().items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-8, msg=name)


def test_named_model_that_differs_is_one_line(tuned):
    proc = _train(tuned, "bad", "--model.name", "small")
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert (
        errors and "model.name 'small' differs from hf_in/config.json: dim=768 vs 64" in errors[0]
    )
    assert "Traceback" not in proc.stderr
