"""Token data that is verified, and the inputs checked before any process starts.

* A prepared folder records its tokenizer's digest, the largest id and a
  checksum per shard; ``simplefsdp train`` refuses ids that do not fit the
  model in one line, before starting processes.
* A shard damaged without a size change is found: ids outside the
  vocabulary by the batch that reads them, any other change by the
  background checksum; ``data prepare`` rebuilds it.
* Every input problem (Hugging Face folder, tokenizer, vocabulary, data) is
  one line of the launcher, all of them at once.
* ``simplefsdp data`` has a help, no carriage returns off a terminal, and
  errors named by its own flags.
* Chat data: the loss mask covers exactly the assistant's turns of a real
  chat template, and the loss is the mean over those tokens only.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from chat_data import CONVERSATIONS, make_chat_tokenizer, write_conversations
from simplefsdp.data import DataError, build_data
from simplefsdp.data.prepare import INDEX_NAME, main, prepare
from simplefsdp.train import cli


@pytest.fixture
def corpus(tmp_path):
    lines = [json.dumps({"text": f"record {i} " * (i + 20)}) for i in range(40)]
    (tmp_path / "records.jsonl").write_text("\n".join(lines) + "\n")
    (tmp_path / "notes.txt").write_text("some plain text\n" * 200)
    return tmp_path


@pytest.fixture
def prepared(corpus, tmp_path):
    out = tmp_path / "tok"
    prepare(corpus / "records.jsonl", out, val_fraction=0.1, progress=False)
    return out


def _cfg(path, **kw):
    base = dict(path=str(path), seq_len=16, batch_size=2, val_fraction=0.1, tokenizer="byte",
                max_bytes=None, text_field="text")  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


@pytest.fixture
def no_launch(monkeypatch, tmp_path):
    """``simplefsdp train`` in this process; starting workers fails the test."""
    monkeypatch.chdir(tmp_path)
    for var in ("LOCAL_RANK", "TORCHELASTIC_RUN_ID", "SIMPLEFSDP_ERROR_DIR"):
        monkeypatch.delenv(var, raising=False)

    def launched(*args, **kwargs):
        raise AssertionError("workers were started")

    monkeypatch.setattr(cli, "_launch", launched)


def _errors(capsys) -> list[str]:
    lines = capsys.readouterr().err.splitlines()
    return [line for line in lines if line.startswith("simplefsdp train: error: ")]


# --------------------------------------------------------------------------- 1: vocabulary


def test_index_records_tokenizer_largest_id_and_checksums(prepared):
    index = json.loads((prepared / INDEX_NAME).read_text())
    assert index["tokenizer"]["digest"].startswith("sha256:") and index["vocab_size"] == 260
    assert index["max_id"] == 257  # the EOS after every document
    shard = np.fromfile(prepared / "shards" / index["train"]["shards"][0]["file"], "<u2")
    assert index["train"]["shards"][0]["max_id"] == int(shard.max())
    assert all(s["checksum"].startswith("crc32:") for s in index["train"]["shards"])


def test_ids_that_do_not_fit_the_model_are_one_line_before_any_process(prepared, capsys, no_launch):
    code = cli.main(["--data.path", str(prepared), "--model.vocab_size", "200"])
    errors = _errors(capsys)
    assert code == 2 and len(errors) == 1
    assert f"data.path '{prepared}' holds token ids up to 257" in errors[0]
    assert "model.vocab_size (200 ids" in errors[0] and "--model.vocab_size 258" in errors[0]


def test_a_corpus_of_another_tokenizer_is_refused_before_any_process(
    prepared, capsys, no_launch, tmp_path
):
    index = json.loads((prepared / INDEX_NAME).read_text())
    index["tokenizer"]["digest"] = "sha256:" + "1" * 64
    (prepared / INDEX_NAME).write_text(json.dumps(index))
    assert cli.main(["--data.path", str(prepared)]) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and "is not the tokenizer" in errors[0]


# --------------------------------------------------------------------------- 2: damage


def _damage(path, value, every=7):
    shard = np.memmap(path, dtype="<u2", mode="r+")
    shard[::every] = value
    shard.flush()


def test_ids_outside_the_vocabulary_are_one_line_naming_the_shard(prepared):
    index = json.loads((prepared / INDEX_NAME).read_text())
    shard = prepared / "shards" / index["train"]["shards"][0]["file"]
    _damage(shard, 60000)
    loader = build_data(_cfg(prepared)).loader  # no verification: the batch finds it
    with pytest.raises(DataError, match=f"token shard {shard} holds token id 60000") as info:
        next(loader)
    assert "\n" not in str(info.value) and "simplefsdp data prepare --input" in str(info.value)


def test_damaged_shard_stops_the_loader_and_prepare_rebuilds_it(prepared, corpus):
    first = json.loads((prepared / INDEX_NAME).read_text())
    shard = prepared / "shards" / first["train"]["shards"][0]["file"]
    good = shard.read_bytes()
    _damage(shard, ord("x"))  # still byte ids: only the checksum can tell
    loader = build_data(_cfg(prepared), verify=(0, 1)).loader
    with pytest.raises(DataError, match=f"token shard {shard} is damaged") as info:
        loader.verifier.wait()
    with pytest.raises(DataError):
        next(loader)  # the loader stops the run
    assert "re-run simplefsdp data prepare --input" in str(info.value)
    again = prepare(corpus / "records.jsonl", prepared, val_fraction=0.1, progress=False)
    assert again == first and shard.read_bytes() == good  # rebuilt, not kept as "complete"


def test_verification_is_recorded_and_not_repeated(prepared):
    loader = build_data(_cfg(prepared), verify=(0, 1)).loader
    loader.verifier.wait()
    assert loader.verifier.verified == 2  # the train and the val shard
    assert sorted(p.name for p in (prepared / "verified").iterdir()) == [
        "000000.train.bin.json",
        "000000.val.bin.json",
    ]
    again = build_data(_cfg(prepared), verify=(0, 1)).loader
    again.verifier.wait()
    assert again.verifier.verified == 0


def test_an_old_corpus_without_checksums_still_trains_and_is_checked_on_first_use(
    prepared, capsys, no_launch
):
    index = json.loads((prepared / INDEX_NAME).read_text())
    for key in ("max_id", "checksum", "vocab_size"):
        del index[key]
    del index["tokenizer"]["digest"]
    for split in ("train", "val"):
        for s in index[split]["shards"]:
            del s["checksum"], s["max_id"]
    (prepared / INDEX_NAME).write_text(json.dumps(index))
    loader = build_data(_cfg(prepared), verify=(0, 1)).loader
    next(loader)
    loader.verifier.wait()
    assert loader.verifier.verified == 2
    from simplefsdp.train.config import load_config
    from simplefsdp.train.preflight import input_problems

    errors, notes = input_problems(load_config("debug", ["--data.path", str(prepared)]))
    assert errors == [] and len(notes) == 1 and "checked on first use" in notes[0]


# --------------------------------------------------------------------------- 4: launcher checks


def test_hugging_face_and_tokenizer_problems_are_all_reported_before_any_process(
    tmp_path, capsys, no_launch
):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{not json")
    code = cli.main(["--checkpoint.init_from_hf", "hf", "--data.tokenizer", "missing.json"])
    errors = _errors(capsys)
    assert code == 2 and len(errors) == 2
    assert any("checkpoint.init_from_hf 'hf': cannot read hf/config.json" in e for e in errors)
    assert any("data.tokenizer 'missing.json' does not exist" in e for e in errors)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing written


def test_a_hugging_face_folder_without_weights_is_one_line_before_any_process(
    tmp_path, capsys, no_launch
):
    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 260, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
              "rope_theta": 500000.0}  # fmt: skip
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    assert cli.main(["--checkpoint.init_from_hf", "hf"]) == 2
    errors = _errors(capsys)
    assert len(errors) == 1 and "has neither model.safetensors.index.json nor" in errors[0]


# --------------------------------------------------------------------------- 7: the data command


def test_data_help_exits_0_and_bare_data_shows_it(capsys):
    from simplefsdp.cli import main as simplefsdp

    assert simplefsdp(["data", "--help"]) == 0 and "prepare" in capsys.readouterr().out
    assert main([]) == 2 and "verify" in capsys.readouterr().err
    assert main(["prepare", "--help"]) == 0
    assert "--format {text,chat}" in capsys.readouterr().out


def test_prepare_writes_no_carriage_returns_off_a_terminal(corpus, tmp_path, capsys, monkeypatch):
    argv = ["prepare", "--input", str(corpus), "--out", str(tmp_path / "t"), "--workers", "1"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert "\r" not in captured.err and "\r" not in captured.out
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a terminal: one progress line
    assert main([*argv[:-4], "--out", str(tmp_path / "t2"), "--workers", "1"]) == 0
    assert "\rprepare: 1/" in capsys.readouterr().err


def test_prepare_errors_name_its_own_flags(corpus, tmp_path, capsys):
    argv = ["prepare", "--input", str(corpus / "records.jsonl"), "--out", str(tmp_path / "t"),
            "--text-field", "body", "--workers", "1"]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--text-field" in err and "data.text_field" not in err
    assert main(["prepare", "--input", str(tmp_path / "nope"), "--out", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err
    assert "input" in err and "data.path" not in err


def test_a_missing_shard_is_called_missing(prepared):
    index = json.loads((prepared / INDEX_NAME).read_text())
    (prepared / "shards" / index["train"]["shards"][0]["file"]).unlink()
    with pytest.raises(ValueError, match="000000.train.bin is missing") as info:
        build_data(_cfg(prepared))
    assert "-1 bytes" not in str(info.value)


# --------------------------------------------------------------------------- chat data


@pytest.fixture
def chat_tokenizer(tmp_path):
    """A tiny BPE tokenizer with a ChatML template, saved like a model's folder."""
    pytest.importorskip("transformers")
    return make_chat_tokenizer(tmp_path / "chat_tok")


def test_chat_loss_mask_covers_exactly_the_assistant_turns(chat_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    write_conversations(tmp_path / "chat.jsonl")
    out = tmp_path / "chat_tokens"
    index = prepare(tmp_path / "chat.jsonl", out, tokenizer=str(chat_tokenizer),
                    data_format="chat", val_fraction=0.0, progress=False)  # fmt: skip
    assert index["loss_mask"] and index["data_format"] == "chat"
    shard = index["train"]["shards"][0]
    ids = np.fromfile(out / "shards" / shard["file"], "<u2")
    mask = np.fromfile(out / "shards" / shard["mask"], np.uint8).astype(bool)
    hf = AutoTokenizer.from_pretrained(str(chat_tokenizer), local_files_only=True)
    eos = hf.convert_tokens_to_ids("<|endoftext|>")
    ends = np.flatnonzero(ids == eos)
    assert len(ends) == len(CONVERSATIONS) and not mask[ends].any()
    start = 0
    for conv, end in zip(CONVERSATIONS, ends, strict=True):
        rendered = hf.apply_chat_template(conv, tokenize=False)
        assert hf.decode(ids[start:end].tolist()) == rendered  # the template's tokens
        trained = hf.decode(ids[start:end][mask[start:end]].tolist())
        expected = "".join(m["content"] + "<|im_end|>\n" for m in conv if m["role"] == "assistant")
        assert trained == expected  # exactly the assistant's text and end of turn
        start = end + 1
    assert index["train"]["trained_tokens"] == int(mask.sum())

    # Parquet records (a list-of-structs column) give the same shards
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"messages": CONVERSATIONS}), tmp_path / "chat.parquet")
    prepare(tmp_path / "chat.parquet", tmp_path / "pq", tokenizer=str(chat_tokenizer),
            data_format="chat", val_fraction=0.0, progress=False)  # fmt: skip
    for name in (shard["file"], shard["mask"]):
        assert (tmp_path / "pq" / "shards" / name).read_bytes() == (
            out / "shards" / name
        ).read_bytes()

    # the loader leaves every other target out of the loss
    data = build_data(_cfg(out, tokenizer=str(chat_tokenizer), val_fraction=0.0, seq_len=8))
    inputs, targets = data.loader.batch_at(0, global_batch=True)
    window = data.loader._permutation(0)[:2] * 8
    for row, first in enumerate(window.tolist()):
        keep = mask[first + 1 : first + 9]
        assert torch.equal(
            targets[row][torch.from_numpy(~keep)], torch.full((int((~keep).sum()),), -100)
        )
        assert torch.equal(
            targets[row][torch.from_numpy(keep)],
            inputs.new_tensor(ids[first + 1 : first + 9][keep].astype(np.int64)),
        )
    assert data.loader.has_loss_mask


def test_the_loss_is_the_mean_over_the_trained_tokens_only():
    from simplefsdp.models.llama3.spec import cross_entropy

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=gen)
    targets = torch.randint(0, 11, (2, 5), generator=gen)
    targets[0, :3] = -100
    targets[1, 4] = -100
    keep = targets != -100
    per_token = F.cross_entropy(logits[keep], targets[keep], reduction="none")
    # the same terms summed in another order: equal to rounding
    torch.testing.assert_close(cross_entropy(logits, targets), per_token.mean(), rtol=1e-6, atol=0)
    assert not torch.isclose(cross_entropy(logits, targets), per_token.sum() / targets.numel())


def test_chat_without_a_template_or_transformers_is_one_line(chat_tokenizer, tmp_path, monkeypatch):
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": CONVERSATIONS[1]}) + "\n")
    cfg = json.loads((chat_tokenizer / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (chat_tokenizer / "tokenizer_config.json").write_text(json.dumps(cfg))
    (chat_tokenizer / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ValueError, match="has no chat template"):
        prepare(tmp_path / "c.jsonl", tmp_path / "o", tokenizer=str(chat_tokenizer),
                data_format="chat", progress=False)  # fmt: skip
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    with pytest.raises(ValueError, match="needs the 'transformers' package: pip install"):
        prepare(tmp_path / "c.jsonl", tmp_path / "o", tokenizer=str(chat_tokenizer),
                data_format="chat", progress=False)  # fmt: skip
