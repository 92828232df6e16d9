"""Tests for simplefsdp.data: tokenizers, corpus, splits and the distributed loader."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
import torch

import simplefsdp.data as D
from simplefsdp.data import (
    ByteTokenizer,
    DistributedTokenLoader,
    build_corpus,
    build_data,
    data_fingerprint,
    iter_val_batches,
    list_corpus_files,
    load_tokenizer,
    read_documents,
)
from simplefsdp.train.config import DataConfig

TEXT = "héllo wörld — naïve café, 日本語テキスト, emoji 🚀🔥, Ελληνικά, \x00 tab\tend\n"


# --------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip_non_ascii():
    tok = ByteTokenizer()
    assert tok.vocab_size == 260
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.spare_id) == (256, 257, 258, 259)
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == TEXT
    framed = tok.encode(TEXT, bos=True, eos=True)
    assert framed[0] == 256 and framed[-1] == 257 and framed[1:-1] == ids
    assert tok.decode(framed) == TEXT  # specials dropped
    assert tok.decode(torch.tensor(framed)) == TEXT
    assert tok.encode_to_tensor(TEXT, eos=True).tolist() == ids + [257]
    assert tok.encode("") == [] and tok.decode([]) == ""


def test_byte_tokenizer_decode_invalid_utf8_and_bad_ids():
    tok = ByteTokenizer()
    assert tok.decode([0xFF, 0x41]) == "\ufffdA"
    assert tok.decode(tok.encode("é")[:1]) == "\ufffd"
    with pytest.raises(ValueError, match="260"):
        tok.decode([260])
    with pytest.raises(ValueError, match="-1"):
        tok.decode([-1])


def test_load_tokenizer_byte_and_missing_path(tmp_path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    missing = tmp_path / "no_such_tokenizer.json"
    with pytest.raises(ValueError, match="no_such_tokenizer.json.*does not exist"):
        load_tokenizer(str(missing))


def test_load_tokenizer_without_libraries(tmp_path, monkeypatch):
    path = tmp_path / "tokenizer.json"
    path.write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ValueError) as info:
        load_tokenizer(str(path))
    msg = str(info.value)
    assert str(path) in msg and "tokenizers" in msg and "transformers" in msg


class _FakeEncoding:
    def __init__(self, ids):
        self.ids = ids


class _FakeHFTokenizer:
    """Word-level stand-in for tokenizers.Tokenizer with a large vocabulary."""

    specials = {"<|begin_of_text|>": 40000, "<|end_of_text|>": 40001}

    def __init__(self):
        self.words: dict[str, int] = {}

    @classmethod
    def from_file(cls, path):
        assert path.endswith("tokenizer.json")
        return cls()

    def get_vocab_size(self, with_added_tokens=True):
        return 40002

    def token_to_id(self, token):
        return self.specials.get(token)

    def encode(self, text, add_special_tokens=True):
        return _FakeEncoding([self.words.setdefault(w, len(self.words)) for w in text.split()])

    def decode(self, ids, skip_special_tokens=True):
        inverse = {v: k for k, v in self.words.items()}
        return " ".join(inverse[i] for i in ids if i in inverse)


def test_load_tokenizer_with_tokenizers_library(tmp_path, monkeypatch):
    folder = tmp_path / "llama3"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")
    fake = types.ModuleType("tokenizers")
    fake.Tokenizer = _FakeHFTokenizer
    monkeypatch.setitem(sys.modules, "tokenizers", fake)
    monkeypatch.setitem(sys.modules, "transformers", None)
    for spec in (str(folder), str(folder / "tokenizer.json")):
        tok = load_tokenizer(spec)
        assert isinstance(tok, D.HFTokenizer)
        assert (tok.vocab_size, tok.eos_id, tok.bos_id) == (40002, 40001, 40000)
        assert tok.decode(tok.encode("a b a c")) == "a b a c"

    corpus_dir = tmp_path / "corpus"
    corpus_dir.mkdir()
    (corpus_dir / "a.txt").write_text("one two three " * 50)
    corpus = build_corpus(str(corpus_dir), tok, val_fraction=0.0)
    assert corpus.train.dtype == torch.int32  # vocab > 32768
    assert corpus.train.numel() == 151 and corpus.train[-1].item() == 40001


def test_token_dtype():
    assert D.token_dtype(260) == torch.int16
    assert D.token_dtype(32768) == torch.int16
    assert D.token_dtype(128256) == torch.int32


# --------------------------------------------------------------------------- corpus


@pytest.fixture(scope="module")
def stdlib_corpus():
    return build_corpus(None, "byte", val_fraction=0.05)


def test_stdlib_corpus_default(stdlib_corpus):
    c = stdlib_corpus
    assert c.vocab_size == 260 and c.eos_id == 257
    assert c.train.dtype == torch.int16 and c.val.dtype == torch.int16
    assert c.num_train_docs > 100 and c.num_val_docs > 0
    total = c.train.numel() + c.val.numel()
    assert 7_000_000 < total < 9_500_000  # ~8 MB cap (bytes + one EOS per document)
    assert int((c.train == 257).sum()) == c.num_train_docs
    assert int(c.train.max()) <= 257 and int(c.train.min()) >= 0
    assert c.train[-1].item() == 257


def test_stdlib_documents_sorted_and_deterministic():
    docs = read_documents(None, max_bytes=200_000)
    again = read_documents(None, max_bytes=200_000)
    assert docs == again and len(docs) > 3
    names = [d.name for d in docs]
    assert names == sorted(names)
    assert all(n.endswith(".py") and "site-packages" not in n for n in names)
    root, files = list_corpus_files(None)
    assert root == D.stdlib_dir()
    rel = [f.relative_to(root).as_posix() for f in files]
    prefix = rel[: rel.index(names[-1]) + 1]
    assert names == [n for n in prefix if (root / n).stat().st_size > 0]  # empty files skipped
    assert not any("site-packages" in p.parts for p in files)


def test_stdlib_corpus_deterministic(stdlib_corpus):
    small = build_corpus(None, val_fraction=0.05, max_bytes=500_000)
    again = build_corpus(None, val_fraction=0.05, max_bytes=500_000)
    assert torch.equal(small.train, again.train) and torch.equal(small.val, again.val)
    assert data_fingerprint(small.train) == data_fingerprint(again.train)
    assert data_fingerprint(small.train) != data_fingerprint(stdlib_corpus.train)


def test_user_file_uses_tail_split(tmp_path):
    path = tmp_path / "book.txt"
    path.write_text(TEXT * 100, encoding="utf-8")
    c = build_corpus(str(path), val_fraction=0.1)
    stream = ByteTokenizer().encode(TEXT * 100, eos=True)
    assert c.train.tolist() + c.val.tolist() == stream
    assert c.val.numel() == round(len(stream) * 0.1)
    c0 = build_corpus(str(path), val_fraction=0.0)
    assert c0.train.tolist() == stream and c0.val.numel() == 0


def _make_folder(root, names):
    for name in names:
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"<<{name}>> " + "body text " * 20, encoding="utf-8")


def test_user_folder_recursive_text_files(tmp_path):
    _make_folder(tmp_path, ["a.txt", "sub/b.md", "sub/deep/c.py", "NOTES"])
    (tmp_path / "d.jsonl").write_text('{"text": "a record"}\n')  # one document per record
    (tmp_path / "model.bin").write_bytes(b"\x00\x01binary")
    (tmp_path / "blob").write_bytes(b"abc\x00def")  # no suffix, has NUL -> binary
    (tmp_path / ".hidden.txt").write_text("hidden")
    (tmp_path / "bad.txt").write_bytes(b"ok \xff\xfe bytes")
    (tmp_path / "empty.txt").write_text("")
    docs = read_documents(tmp_path)
    names = [d.name for d in docs]
    assert names == ["NOTES", "a.txt", "bad.txt", "d.jsonl:1", "sub/b.md", "sub/deep/c.py"]
    assert docs[2].text == "ok \ufffd\ufffd bytes"


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def test_jsonl_is_read_by_its_text_field(tmp_path, caplog):
    records = [{"id": i, "text": f"record {i} " * 5, "meta": "x"} for i in range(20)]
    path = _jsonl(tmp_path / "data.jsonl", [*records, {"id": 99}, {"body": "no text"}])
    with caplog.at_level("WARNING", logger="simplefsdp.data.corpus"):
        docs = read_documents(path)
    assert [d.text for d in docs] == [r["text"] for r in records]  # the text, not the JSON
    assert docs[3].name == "data.jsonl:4"
    assert [r.getMessage() for r in caplog.records] == [
        f"{path}: 2 of 22 lines have no string field 'text' (skipped)"
    ]
    other = _jsonl(tmp_path / "b.jsonl", [{"content": "hello"}])
    assert [d.text for d in read_documents(other, text_field="content")] == ["hello"]
    with pytest.raises(ValueError, match=r"b.jsonl' has no string field 'text' .*\['content'\]"):
        read_documents(other)


def test_data_config_text_field_reaches_the_corpus(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"body": "x" * 400}, {"body": "y" * 400}])
    cfg = DataConfig(path=str(path), seq_len=8, batch_size=2, val_fraction=0.0, text_field="body")
    bundle = build_data(cfg)
    assert bundle.corpus.train.numel() == 802  # two records and their EOS tokens


def test_parquet_is_read_by_its_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["first row", None, "third"], "n": [1, 2, 3]}), path)
    assert [d.text for d in read_documents(path)] == ["first row", "third"]
    with pytest.raises(ValueError, match=r"no string field 'body' .*\['text', 'n'\]"):
        read_documents(path, text_field="body")


def test_parquet_without_pyarrow_is_one_line(tmp_path, monkeypatch):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1 not read")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    for check in (lambda: read_documents(path), lambda: D.sniff_data_file(path)):
        try:
            problem = check()
        except ValueError as exc:
            problem = str(exc)
        assert "d.parquet' is Parquet" in problem and "pip install pyarrow" in problem


def test_undecodable_bytes_are_counted_and_reported_once(tmp_path, caplog):
    (tmp_path / "a.txt").write_bytes(b"caf\xe9 au lait, " * 10)  # Latin-1, not UTF-8
    (tmp_path / "b.txt").write_bytes(b"na\xefve " * 10 + b"ok " * 50)
    (tmp_path / "c.txt").write_bytes("fine UTF-8: café".encode())
    with caplog.at_level("WARNING", logger="simplefsdp.data.corpus"):
        docs = read_documents(tmp_path)
    assert docs[0].text.startswith("caf\ufffd au lait")
    assert [r.getMessage() for r in caplog.records] == [
        f"20 bytes that are not UTF-8 in 2 file(s) (first: {tmp_path / 'a.txt'}) "
        "were replaced by U+FFFD"
    ]


@pytest.mark.parametrize("content", [bytes(range(256)) * 64, b"\x00" * 5000 + b"text"])
def test_a_file_that_is_mostly_not_text_is_refused(tmp_path, content):
    path = tmp_path / "weights.txt"  # the suffix does not make it text
    path.write_bytes(b"some text first\n" + content)
    with pytest.raises(ValueError, match=r"weights.txt' is mostly not text \(\d+% of its bytes"):
        read_documents(path)
    assert "is mostly not text" in D.sniff_data_file(path)


def test_folder_split_is_stable_when_files_are_added(tmp_path):
    tok = ByteTokenizer()
    first = [f"doc{i:02d}.txt" for i in range(30)]
    _make_folder(tmp_path, first)

    def val_names(corpus):
        text = tok.decode(corpus.val)
        return {n for n in first if f"<<{n}>>" in text}

    c1 = build_corpus(str(tmp_path), val_fraction=0.3)
    assert 0 < c1.num_val_docs < 30
    _make_folder(tmp_path, [f"extra{i:02d}.txt" for i in range(30)])
    c2 = build_corpus(str(tmp_path), val_fraction=0.3)
    assert val_names(c1) == val_names(c2)
    assert c2.num_train_docs + c2.num_val_docs == 60


def test_missing_and_empty_paths(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        build_corpus(str(missing))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="empty.*no readable"):
        build_corpus(str(empty))
    with pytest.raises(ValueError, match="val_fraction"):
        build_corpus(str(empty), val_fraction=1.0)


# --------------------------------------------------------------------------- loader

N_TOKENS = 4097  # 256 windows of seq_len 16


def _tokens(n: int = N_TOKENS) -> torch.Tensor:
    return torch.arange(n, dtype=torch.int32)


def _loader(tokens: torch.Tensor | None = None, **kw) -> DistributedTokenLoader:
    args = {"seq_len": 16, "batch_size": 4, "seed": 0, **kw}
    return DistributedTokenLoader(_tokens() if tokens is None else tokens, **args)


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def _same(a, b):
    return len(a) == len(b) and all(
        torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b)
    )


def test_loader_batches_shapes_and_targets():
    x, y = next(_loader())
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y - x, torch.ones_like(x))  # arange stream: targets are next tokens
    assert bool((x[:, 0] % 16 == 0).all())  # windows start at multiples of seq_len


def test_loader_deterministic_and_seeded():
    assert _same(_take(_loader(), 5), _take(_loader(), 5))
    assert not _same(_take(_loader(), 5), _take(_loader(seed=1), 5))


def test_loader_resume_mid_epoch():
    ref = _loader()
    _take(ref, 7)
    state = ref.state_dict()
    assert all(type(v) is int for v in state.values())
    assert set(state) == {"epoch", "position", "seed", "seq_len", "num_tokens", "data_hash"}
    expected = _take(ref, 30)  # crosses the epoch boundary (16 steps per epoch)

    resumed = _loader(seed=123)  # the saved seed wins
    resumed.load_state_dict(state)
    assert _same(_take(resumed, 30), expected)


def test_resume_with_other_world_size_same_global_batch():
    ref = _loader(batch_size=4)  # G = 4
    _take(ref, 5)
    state = ref.state_dict()
    expected = _take(ref, 3)
    ranks = [_loader(batch_size=2, rank=r, world_size=2) for r in range(2)]
    for loader in ranks:
        loader.load_state_dict(state)
    for want in expected:
        parts = [next(loader) for loader in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), want[0])


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_rank_slices_concatenate_to_global_batch(world_size):
    g = 8
    single = _take(_loader(batch_size=g), 40)  # several epochs (32 steps per epoch)
    ranks = [
        _loader(batch_size=g // world_size, rank=r, world_size=world_size)
        for r in range(world_size)
    ]
    for step, (gx, gy) in enumerate(single):
        parts = [next(loader) for loader in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), gx), step
        assert torch.equal(torch.cat([p[1] for p in parts]), gy), step
    # global_batch flag gives the whole global batch from any rank's loader
    full = _loader(batch_size=g // world_size, rank=1, world_size=world_size, global_batch=True)
    assert _same(_take(full, 40), single)


def test_batch_at_matches_iteration():
    loader = _loader(batch_size=2, rank=1, world_size=2)
    batches = _take(_loader(batch_size=2, rank=1, world_size=2), 70)
    assert _same([loader.batch_at(s) for s in range(70)], batches)
    assert loader.state_dict()["position"] == 0  # batch_at does not advance
    full = _take(_loader(batch_size=4), 3)
    assert _same([loader.batch_at(s, global_batch=True) for s in range(3)], full)


def test_epoch_wrap():
    loader = _loader(tokens=_tokens(16 * 10 + 1), batch_size=3)  # 10 windows, 3 steps/epoch
    assert loader.num_windows == 10 and loader.steps_per_epoch == 3
    epoch0 = _take(loader, 3)
    seen = torch.cat([x[:, 0] for x, _ in epoch0]) // 16
    assert len(set(seen.tolist())) == 9  # no repeats within an epoch
    assert loader.state_dict()["epoch"] == 0
    epoch1 = _take(loader, 3)
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["position"] == 9
    assert not _same(epoch0, epoch1)  # reshuffled
    _take(loader, 1)
    assert loader.state_dict()["epoch"] == 2


def test_fingerprint_mismatch():
    state = _loader().state_dict()
    other = _loader(tokens=torch.arange(1, N_TOKENS + 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="data_hash"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="num_tokens"):
        _loader(tokens=_tokens(N_TOKENS + 16)).load_state_dict(state)
    with pytest.raises(ValueError, match="seq_len"):
        _loader(seq_len=8).load_state_dict(state)
    with pytest.raises(ValueError, match="missing keys"):
        _loader().load_state_dict({"epoch": 0})
    # the fingerprint does not depend on the storage dtype
    _loader(tokens=_tokens().to(torch.int16)).load_state_dict(state)


def test_loader_argument_errors():
    with pytest.raises(ValueError, match="global batch"):
        _loader(tokens=_tokens(16 * 3 + 1), batch_size=4)
    with pytest.raises(ValueError, match="rank"):
        _loader(rank=2, world_size=2)
    with pytest.raises(ValueError, match="seq_len"):
        _loader(seq_len=0)
    with pytest.raises(ValueError, match="integer"):
        _loader(tokens=torch.zeros(100))


def test_val_batches_deterministic_rank_sliced():
    val = _tokens(16 * 20 + 1)  # 20 windows
    loader = _loader(val_tokens=val)
    batches = list(loader.val_batches())
    assert len(batches) == 5  # 20 windows / (1 x 4)
    assert batches[0][0][:, 0].tolist() == [0, 16, 32, 48]  # in order, unshuffled
    assert _same(batches, list(loader.val_batches()))
    assert len(list(loader.val_batches(2))) == 2
    ranks = [
        list(iter_val_batches(val, seq_len=16, batch_size=2, rank=r, world_size=2))
        for r in range(2)
    ]
    assert len(ranks[0]) == len(ranks[1]) == 5
    for k in range(5):
        assert torch.equal(torch.cat([ranks[0][k][0], ranks[1][k][0]]), batches[k][0])
    assert list(iter_val_batches(_tokens(10), seq_len=16, batch_size=1)) == []
    with pytest.raises(ValueError, match="no validation tokens"):
        _loader().val_batches()


def test_build_data_from_config(tmp_path):
    _make_folder(tmp_path, [f"f{i}.txt" for i in range(20)])
    cfg = DataConfig(path=str(tmp_path), seq_len=32, batch_size=2, val_fraction=0.2)
    bundle = build_data(cfg, rank=1, world_size=2, seed=3)
    x, y = next(bundle.loader)
    assert x.shape == (2, 32) and isinstance(bundle.tokenizer, ByteTokenizer)
    assert torch.equal(bundle.loader.val_tokens, bundle.corpus.val)
    assert len(list(bundle.loader.val_batches(1))) == 1


def test_data_package_imports_nothing_else_of_simplefsdp():
    code = (
        "import sys, simplefsdp.data; "
        "print(*sorted(m for m in sys.modules if m.startswith('simplefsdp')), sep='\\n')"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    allowed = {"simplefsdp", "simplefsdp._version"}
    others = [m for m in out.split() if m not in allowed and not m.startswith("simplefsdp.data")]
    assert others == []
