"""``simplefsdp train --checkpoint.init_from_hf DIR`` without ``--model``: the folder picks the family.

A random Llama folder (dim 64, 2 layers, byte vocabulary) is the native
``llama3`` family's: two ranks fine-tune it, a run resumed from its first
checkpoint continues with the same losses (bitwise), and its Hugging Face
export loads with ``from_pretrained`` to our logits. A tiny Gemma folder
(a ``model_type`` no native family reads) trains through ``transformers``'
own modeling code, compiled, and exports to a folder ``from_pretrained``
loads with the logits of our own export. Minutes long: ``heavy``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_runs import checkpoint_as_run, checkpoints, losses, only_run, small_args, train_env

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.heavy

TIMEOUT_S = 600
VOCAB = 260


def _run(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "simplefsdp.cli", *argv],
        cwd=cwd, env=train_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def _train(cwd: Path, name: str, steps: int, *extra: str) -> subprocess.CompletedProcess:
    return _run(
        cwd, "train", *small_args(steps), "--nproc", "2", "--metrics.output_dir", name,
        "--checkpoint.folder", f"{name}/ck", "--checkpoint.init_from_hf", "hf_in", *extra,
    )  # fmt: skip


def _our_export(cwd: Path, name: str) -> torch.nn.Module:
    """Our model from ``simplefsdp export`` (format simplefsdp) of run ``name``."""
    from safetensors.torch import load_file

    from simplefsdp.models.record import model_from_record

    _run(cwd, "export", "--checkpoint", name, "--out", f"{name}.safetensors")
    spec, config = model_from_record(json.loads((cwd / f"{name}.config.json").read_text()))
    model = spec.build(config)
    model.load_state_dict(load_file(str(cwd / f"{name}.safetensors")), strict=False)
    return model.eval()


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from simplefsdp.checkpoint.hf import save_hf_checkpoint
    from simplefsdp.models.llama3 import ModelArgs, Transformer

    cwd = tmp_path_factory.mktemp("llama")
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB,
                     multiple_of=32, max_seq_len=128)  # fmt: skip
    torch.manual_seed(3)
    save_hf_checkpoint(Transformer(args).state_dict(), args, cwd / "hf_in")
    _train(cwd, "A", 4)
    return cwd


def test_llama_folder_trains_resumes_and_exports(llama):
    cwd = llama
    run = only_run(cwd / "A")
    config = json.loads((checkpoints(run) / "step-4" / "config.json").read_text())
    assert config["model"]["family"] == "llama3" and config["model"]["flavor"] is None
    resumed = checkpoint_as_run(checkpoints(run) / "step-2", cwd / "B")
    _train(cwd, "B", 4, "--resume")
    full, again = losses(run / "metrics.jsonl"), losses(resumed / "metrics.jsonl")
    assert sorted(again) == [3, 4] and all(again[s] == full[s] for s in again), (again, full)
    _run(cwd, "export", "--checkpoint", "A", "--format", "hf", "--out", "hf_out")
    hf = transformers.AutoModelForCausalLM.from_pretrained(cwd / "hf_out").eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        expected = _our_export(cwd, "A")(_tokens())
        torch.testing.assert_close(hf(_tokens()).logits, expected, rtol=1e-5, atol=1e-5)


def test_any_causal_lm_trains_compiled_and_exports(tmp_path):
    config = transformers.GemmaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    source = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    source.save_pretrained(tmp_path / "hf_in")
    proc = _train(tmp_path, "G", 2, "--compile.enable", "true", "--compile.backend", "aot_eager")
    assert "training finished" in proc.stdout
    record = json.loads(
        (checkpoints(only_run(tmp_path / "G")) / "step-2" / "config.json").read_text()
    )
    assert record["model"]["family"] == "transformers"
    out = _run(tmp_path, "export", "--checkpoint", "G", "--format", "hf", "--out", "hf_out")
    assert "(Hugging Face format: GemmaForCausalLM)" in out.stdout
    written = json.loads((tmp_path / "hf_out" / "config.json").read_text())
    assert written["architectures"] == ["GemmaForCausalLM"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out").eval()
    ours = _our_export(tmp_path, "G")
    with torch.no_grad():
        assert torch.equal(hf(_tokens()).logits, ours(_tokens()))
        assert not torch.equal(source.eval()(_tokens()).logits, ours(_tokens()))  # trained
