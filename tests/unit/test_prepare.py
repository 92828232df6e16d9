"""``simplefsdp data prepare`` and training on its memory-mapped token shards.

The prepared shards give the loader exactly the stream (and fingerprint) the
in-memory corpus gives for the same folder, so batches are equal at every
step and world size; a loader state saved on one resumes on the other. An
interrupted prepare resumes, a damaged shard or another tokenizer is one
line, and an unreadable file is one line naming it.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from simplefsdp.data import DistributedTokenLoader, build_data
from simplefsdp.data.prepare import INDEX_NAME, main, prepare


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "\u00e9t\u00e9", "x = 1", "def f():"]
    for i in range(12):
        text = " ".join(rng.choice(words, size=200 + 37 * i))
        (folder / ("sub" if i % 3 else ".") / f"f{i:02d}.txt").write_text(text)
    lines = [json.dumps({"text": f"record {i} " * (i + 5), "id": i}) for i in range(30)]
    (folder / "records.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _cfg(path, **kw):
    base = dict(path=str(path), seq_len=16, batch_size=2, val_fraction=0.2, tokenizer="byte",
                num_workers=0, max_bytes=None, text_field="text")  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def test_shards_give_the_in_memory_stream_and_batches(corpus, tmp_path):
    index = prepare(corpus, tmp_path / "tok", val_fraction=0.2, workers=2, progress=False)
    assert index["dtype"] == "uint16" and index["tokenizer"]["vocab_size"] == 260
    assert len(index["train"]["shards"]) > 1 and index["val"]["tokens"] > 0
    for world in (1, 2):
        for rank in range(world):
            mem = build_data(_cfg(corpus), rank=rank, world_size=world, seed=5).loader
            mapped = build_data(_cfg(tmp_path / "tok"), rank=rank, world_size=world, seed=5)
            assert mapped.loader.fingerprint == mem.fingerprint
            assert mapped.loader.num_windows == mem.num_windows
            for _ in range(mem.steps_per_epoch + 2):  # across an epoch boundary
                a, b = next(mem), next(mapped.loader)
                assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                assert mapped.loader._ahead is not None  # the next batch is read ahead
            val_a, val_b = list(mem.val_batches()), list(mapped.loader.val_batches())
            assert len(val_a) == len(val_b) > 0
            assert all(torch.equal(x[0], y[0]) for x, y in zip(val_a, val_b, strict=True))


def test_resume_gives_the_next_batch_at_another_world_size(corpus, tmp_path):
    prepare(corpus, tmp_path / "tok", val_fraction=0.2, progress=False)
    cfg = _cfg(tmp_path / "tok")
    run = build_data(cfg, rank=0, world_size=1, seed=3, global_batch=True).loader
    for _ in range(7):
        next(run)
    state = run.state_dict()
    expected = next(run)  # the uninterrupted run's next global batch
    for world in (1, 2):
        rows = []
        for rank in range(world):
            loader = build_data(
                _cfg(tmp_path / "tok", batch_size=2 // world), rank=rank, world_size=world, seed=0
            ).loader
            loader.load_state_dict(state)
            rows.append(next(loader))
        assert torch.equal(torch.cat([r[0] for r in rows]), expected[0])
        assert torch.equal(torch.cat([r[1] for r in rows]), expected[1])


def test_interrupted_prepare_resumes_and_damaged_shard_is_refused(corpus, tmp_path):
    out = tmp_path / "tok"
    first = prepare(corpus, out, val_fraction=0.2, progress=False)
    name = first["train"]["shards"][1]["file"]  # e.g. 000003.train.bin
    (out / INDEX_NAME).unlink()  # as if interrupted before the index
    (out / "shards" / (name.split(".")[0] + ".json")).unlink()  # ... and before this record
    shard = out / "shards" / name
    shard.write_bytes(shard.read_bytes()[:5])  # a half-written shard
    again = prepare(corpus, out, val_fraction=0.2, progress=False)
    assert again == first
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ValueError, match=rf"{name} has \d+ bytes, index.json says"):
        build_data(_cfg(out))


@pytest.mark.parametrize("legacy", [False, True])
def test_other_tokenizer_is_one_line(corpus, tmp_path, legacy):
    prepare(corpus, tmp_path / "tok", progress=False)
    index = json.loads((tmp_path / "tok" / INDEX_NAME).read_text())
    if legacy:  # an index without the tokenizer's digest: compared by vocabulary and EOS
        del index["tokenizer"]["digest"]
        index["tokenizer"]["vocab_size"] = 32000
    else:
        index["tokenizer"]["digest"] = "sha256:" + "0" * 64
    (tmp_path / "tok" / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="is not the tokenizer .* was prepared with") as info:
        build_data(_cfg(tmp_path / "tok"))
    assert "\n" not in str(info.value)


def test_unreadable_file_is_one_line_naming_it(corpus, tmp_path, capsys):
    (corpus / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    code = main(["prepare", "--input", str(corpus), "--out", str(tmp_path / "tok"),
                 "--no-progress", "--workers", "1"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "bad.jsonl" in err[0] and "line 2" in err[0]
    assert not (tmp_path / "tok" / INDEX_NAME).exists()


def test_loader_reads_shards_by_memory_map(corpus, tmp_path):
    prepare(corpus, tmp_path / "tok", progress=False)
    loader = build_data(_cfg(tmp_path / "tok")).loader
    assert isinstance(loader, DistributedTokenLoader)
    assert all(isinstance(a, np.memmap) for a in loader.tokens.arrays)


def _save_to_disk(folder, rows, column="text"):
    """A folder laid out as ``datasets.Dataset.save_to_disk`` writes it (two Arrow files)."""
    pa = pytest.importorskip("pyarrow")
    folder.mkdir()
    names = []
    for i, part in enumerate((rows[: len(rows) // 2], rows[len(rows) // 2 :])):
        name = f"data-{i:05d}-of-00002.arrow"
        table = pa.table({column: part, "id": list(range(len(part)))})
        with pa.OSFile(str(folder / name), "wb") as sink:
            with pa.ipc.new_stream(sink, table.schema) as writer:
                writer.write_table(table)
        names.append({"filename": name})
    (folder / "state.json").write_text(json.dumps({"_data_files": names, "_split": "train"}))
    (folder / "dataset_info.json").write_text("{}")


def test_datasets_folder_is_read_row_by_row(tmp_path):
    rows = [f"row {i} " * (i + 3) for i in range(40)] + [""]
    _save_to_disk(tmp_path / "ds", rows)
    index = prepare(tmp_path / "ds", tmp_path / "tok", val_fraction=0.0, progress=False)
    assert index["train"]["documents"] == 40  # the empty row is skipped
    loader = build_data(_cfg(tmp_path / "tok", val_fraction=0.0)).loader
    text = "".join(r + "\n" for r in rows if r)  # each document and EOS (byte ids)
    assert loader.tokens.numel() == len(text.encode())
    with pytest.raises(ValueError, match="has no column 'body'"):
        _save_to_disk(tmp_path / "ds3", rows)
        prepare(tmp_path / "ds3", tmp_path / "tok3", text_field="body", progress=False)


def test_document_boundaries_can_be_left_out_of_the_loss(corpus, tmp_path):
    prepare(corpus, tmp_path / "tok", progress=False)
    for path in (corpus, tmp_path / "tok"):  # in memory and on shards alike
        plain = build_data(_cfg(path, batch_size=8)).loader
        masked = build_data(_cfg(path, batch_size=8, mask_document_boundaries=True)).loader
        seen = 0
        for _ in range(plain.steps_per_epoch):
            (inputs, targets), (m_inputs, m_targets) = next(plain), next(masked)
            eos = inputs == 257  # the byte tokenizer's EOS
            seen += int(eos.sum())
            assert torch.equal(inputs, m_inputs)
            assert (m_targets[eos] == -100).all() and torch.equal(m_targets[~eos], targets[~eos])
        assert seen > 0
