"""Data is a pure function of (seed, step, row): a resumed run sees exactly the batches it would have,
and each process can read only its own devices' rows. Real data: text bytes, nanoGPT's token files and
Megatron's indexed datasets (fixtures in tests/data written by `megatron_writer.py`), a held-out
validation part, and one clear line for each bad file."""

import dataclasses
import json
import shutil
import struct

import numpy as np
import pytest

from helpers import init_state, tiny_config
from helpers.megatron_writer import DATA, DOCUMENTS
from jzero.cli import main
from jzero.config import ConfigError
from jzero.train.data import SyntheticData, TokenData, data_identity, held_out_split, make_datasets, read_text
from jzero.train.indexed import read_indexed, write_indexed
from jzero.train.loop import _loop, setup
from jzero.train.preemption import Preemption


def text_data(path, seq_len, global_batch, seed):
    """The byte tokens data.kind=text reads from `path`."""
    return TokenData(read_text(path), seq_len, global_batch, seed)


def test_text_batches_are_deterministic_bytes(tmp_path):
    (tmp_path / "a.py").write_text("print('hello world')\n" * 50)
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "b.py").write_text("#" * 5000)
    data = text_data(str(tmp_path), seq_len=16, global_batch=4, seed=1)
    assert len(data.tokens) == 50 * 21  # installed packages are skipped
    b = data.batch(3)
    assert b.shape == (4, 17) and b.dtype == np.int32 and b.max() < 256
    np.testing.assert_array_equal(b, text_data(str(tmp_path), 16, 4, 1).batch(3))
    assert not np.array_equal(b, data.batch(4))


def test_synthetic_is_seeded_and_learnable():
    data = SyntheticData(vocab_size=64, seq_len=32, global_batch=8, seed=0)
    np.testing.assert_array_equal(data.batch(5), SyntheticData(64, 32, 8, 0).batch(5))
    assert not np.array_equal(data.batch(5), SyntheticData(64, 32, 8, 1).batch(5))
    # Each token has a few likely successors: the empirical next-token entropy is well below log(64).
    tokens = np.concatenate([data.batch(s) for s in range(50)])
    pairs = np.zeros((64, 64))
    np.add.at(pairs, (tokens[:, :-1].ravel(), tokens[:, 1:].ravel()), 1)
    p = pairs / pairs.sum(1, keepdims=True).clip(1)
    entropy = -(pairs * np.log(np.where(p > 0, p, 1))).sum() / pairs.sum()
    assert entropy < 0.75 * np.log(64)


@pytest.fixture
def datasets(tmp_path):
    (tmp_path / "a.py").write_text("".join(f"print({i})\n" for i in range(200)))
    return [SyntheticData(vocab_size=64, seq_len=16, global_batch=8, seed=0), text_data(str(tmp_path), 16, 8, seed=1)]


@pytest.mark.parametrize("start, stop", [(0, 8), (0, 3), (3, 8), (2, 6), (7, 8), (5, 5)])
def test_rows_are_the_batch_rows(datasets, start, stop):
    for data in datasets:
        rows = data.rows(2, start, stop)
        assert rows.shape == (stop - start, 17) and rows.dtype == np.int32
        np.testing.assert_array_equal(rows, data.batch(2)[start:stop])


class RecordingData:
    """A dataset that records the row ranges asked of it."""

    def __init__(self, data):
        self.data, self.shape, self.asked = data, data.shape, []

    def rows(self, step, start, stop):
        self.asked.append((start, stop))
        return self.data.rows(step, start, stop)


@pytest.mark.parametrize("mesh", [(8, 1, 1), (4, 1, 2), (2, 2, 2), (2, 1, 4)])  # (dp, ep, tp)
def test_device_batch_reads_only_device_rows(mesh):
    run = setup(tiny_config(mesh=mesh))
    data = RecordingData(run.dataset)
    x = dataclasses.replace(run, dataset=data).device_batch(3)
    b = data.shape[0]
    shard_rows = {idx[0].indices(b)[:2] for idx in x.sharding.devices_indices_map(x.shape).values()}
    # Each read is exactly one device's rows, each distinct range read once (tp replicas share it).
    assert sorted(data.asked) == sorted(shard_rows)
    assert all(stop - start == b // run.cfg.dp_domain_size for start, stop in data.asked)
    # ... and the ranges tile the global batch: every row read once.
    assert [r for start, stop in sorted(data.asked) for r in range(start, stop)] == list(range(b))
    np.testing.assert_array_equal(np.asarray(x), run.dataset.batch(3))


# ---------------------------------------------------------------- Megatron's indexed format, nanoGPT's files


@pytest.mark.parametrize("name", ["uint16", "int32"])
def test_reads_megatrons_files_and_writes_them_byte_for_byte(name, tmp_path):
    """The fixtures were written by Megatron's writer (transcribed in megatron_writer.py): several documents,
    one of two sequences (--split-sentences), ids that need the dtype."""
    f = read_indexed(str(DATA / f"megatron_{name}"))
    docs = DOCUMENTS[name]
    assert f.dtype == np.dtype(name) and isinstance(f.tokens, np.memmap)
    assert [[s.tolist() for s in f.document(d)] for d in range(len(docs))] == docs
    assert f.document_starts().tolist() == np.cumsum([0] + [sum(map(len, d)) for d in docs])[:-1].tolist()
    assert f.tokens.tolist() == [t for d in docs for s in d for t in s]
    write_indexed(str(tmp_path / "x"), [[np.array(s) for s in d] for d in docs], name)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"x.{ext}").read_bytes() == (DATA / f"megatron_{name}.{ext}").read_bytes()


def data_config(kind, path, **data):
    """tiny_config (seq_len 16, global batch 8) on `kind` data at `path`."""
    return tiny_config(data={"kind": kind, "path": str(path), **data}, train={"global_batch": 8})


@pytest.fixture
def token_file(tmp_path):
    """nanoGPT's train.bin: uint16 ids < 257, 3000 of them (id = position % 257, so windows are checkable)."""
    path = tmp_path / "train.bin"
    (np.arange(3000) % 257).astype(np.uint16).tofile(path)
    return path


def test_token_file_windows_split_and_are_the_same_after_a_restart(token_file):
    cfg = data_config("tokens", token_file, val_fraction=0.1)
    train, val = make_datasets(cfg)
    assert isinstance(train.tokens, np.memmap)  # memory-mapped: a process reads the rows it asks for
    b, v = train.batch(5), val.batch(0)
    assert b.shape == v.shape == (8, 17) and b.dtype == np.int32
    for row in np.concatenate([b, v]):  # consecutive tokens of the file
        np.testing.assert_array_equal(row, (row[0] + np.arange(17)) % 257)
    assert train.hi == val.lo == 2700  # the last 10% is held out: no training window reaches it
    assert (train.lo, val.hi) == (0, 3000)
    again_train, again_val = make_datasets(cfg)  # a resumed run opens the files again: the same batches
    np.testing.assert_array_equal(again_train.batch(5), b)
    np.testing.assert_array_equal(again_val.batch(0), v)
    assert not np.array_equal(train.batch(6), b) and not np.array_equal(val.batch(1), v)


def test_indexed_holds_out_whole_documents(tmp_path):
    docs = [[np.arange(n) % 200] for n in (400, 300, 50, 30, 20)]  # 800 tokens, documents start at 400, 700, 750, 780
    write_indexed(str(tmp_path / "c"), docs, np.uint16)
    train, val = make_datasets(data_config("indexed", tmp_path / "c", val_fraction=0.1))
    assert train.hi == val.lo == 700  # the document boundary nearest to token 720: the last three documents
    assert held_out_split(1000, 0.03, np.array([0, 500])) == 970  # a boundary far off (50%): split at the token
    separate = data_config("indexed", tmp_path / "c", val_path=str(DATA / "megatron_uint16"))
    with pytest.raises(ConfigError, match="holds 13 tokens, fewer than one sequence"):
        make_datasets(dataclasses.replace(separate, model=dataclasses.replace(separate.model, vocab_size=65536)))


class RecordingTokens:
    """A token array that records how many tokens are read from it."""

    def __init__(self, tokens):
        self.tokens, self.read = tokens, 0

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        out = self.tokens[index]
        self.read += out.size
        return out


def test_rows_read_only_their_windows(token_file):
    tokens = RecordingTokens(np.memmap(token_file, np.uint16, mode="r"))
    data = TokenData(tokens, seq_len=16, global_batch=8, seed=0)
    rows = data.rows(3, 2, 5)
    assert tokens.read == 3 * 17
    np.testing.assert_array_equal(rows, TokenData(np.fromfile(token_file, np.uint16), 16, 8, 0).batch(3)[2:5])


def corrupt(tmp_path, name="megatron_int32"):
    """A copy of a fixture to damage; returns its prefix."""
    for ext in ("bin", "idx"):
        shutil.copy(DATA / f"{name}.{ext}", tmp_path / f"bad.{ext}")
    return tmp_path / "bad"


def patch(path, offset, data):
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


def truncate(path, n):
    path.write_bytes(path.read_bytes()[:n])


BAD_INDEXED = {  # damage to the prefix p -> what the one line says
    "missing .idx": (lambda p: p.with_suffix(".idx").unlink(), "bad.idx does not exist"),
    "missing .bin": (lambda p: p.with_suffix(".bin").unlink(), "bad.bin does not exist"),
    "wrong magic": (lambda p: patch(p.with_suffix(".idx"), 0, b"NOTMEGA"), "bad.idx is not a Megatron index"),
    "bad version": (lambda p: patch(p.with_suffix(".idx"), 9, struct.pack("<Q", 2)), "has index version 2"),
    "unknown dtype": (lambda p: patch(p.with_suffix(".idx"), 17, b"\x09"), "has dtype code 9, not one of"),
    "float dtype": (lambda p: patch(p.with_suffix(".idx"), 17, b"\x07"), "holds float32 values"),
    "short header": (lambda p: truncate(p.with_suffix(".idx"), 20), "bad.idx is truncated: 20 bytes"),
    "truncated .idx": (lambda p: truncate(p.with_suffix(".idx"), 100), "bad.idx is truncated: 100 bytes"),
    "truncated .bin": (lambda p: truncate(p.with_suffix(".bin"), 30), "bad.bin is truncated: 30 bytes"),
    "vocab too small": (lambda p: None, "holds token id 2147483647 but model.vocab_size=257"),
}


@pytest.mark.parametrize("damage", BAD_INDEXED)
def test_bad_indexed_files_are_one_clear_line(damage, tmp_path):
    prefix = corrupt(tmp_path)
    do, needle = BAD_INDEXED[damage]
    do(prefix)
    with pytest.raises(ConfigError) as e:
        make_datasets(data_config("indexed", prefix))
    assert needle in str(e.value) and len(str(e.value).splitlines()) == 1, str(e.value)


@pytest.mark.parametrize(
    "make, data, needle",
    [
        (lambda p: None, {"val_path": "/no/val.bin"}, "data.val_path='/no/val.bin' does not exist"),
        (lambda p: p.write_bytes(b"\x01\x00\x02"), {}, "is truncated: 3 bytes is not a whole number of uint16"),
        (lambda p: np.array([5, 300], np.uint16).tofile(p), {}, "holds token id 300 but model.vocab_size=257"),
        (lambda p: np.arange(16, dtype=np.uint32).tofile(p), {"dtype": "uint32", "val_fraction": 0}, "holds 16 tokens"),
        (lambda p: np.arange(100, dtype=np.uint16).tofile(p), {}, "held-out data.val_fraction=0.03"),
    ],
    ids=["missing", "truncated", "vocab too small", "sequence longer than data", "held-out part too short"],
)
def test_bad_token_files_are_one_clear_line(make, data, needle, tmp_path):
    path = tmp_path / "train.bin"
    np.arange(100, dtype=np.uint16).tofile(path)
    make(path)
    with pytest.raises(ConfigError) as e:
        make_datasets(data_config("tokens", path, **data))
    assert needle in str(e.value) and len(str(e.value).splitlines()) == 1, str(e.value)


# ---------------------------------------------------------------- jzero data prepare, and training on it


def test_prepare_writes_the_text_files_as_byte_documents(tmp_path, capsys):
    (tmp_path / "src" / "pkg").mkdir(parents=True)
    texts = {"a.md": "# hi\n", "pkg/b.py": "x = 'é'\n", "c.txt": "z" * 40}
    for name, text in texts.items():
        (tmp_path / "src" / name).write_text(text)
    assert main(["data", "prepare", str(tmp_path / "src"), str(tmp_path / "out" / "corpus")]) == 0
    out = capsys.readouterr().out
    assert "3 documents" in out and "--set data.kind=indexed --set data.path=" in out
    f = read_indexed(str(tmp_path / "out" / "corpus"))
    assert f.dtype == np.uint16  # Megatron's optimal_dtype for a vocabulary of 256
    assert [bytes(f.document(d)[0].astype(np.uint8)).decode() for d in range(3)] == [texts[n] for n in sorted(texts)]


def test_prepare_with_a_tokenizers_file(tmp_path, capsys):
    tokenizers = pytest.importorskip("tokenizers", reason="needs the [data] extra: pip install -e '.[data]'")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("hello world foo hello")
    argv = ["data", "prepare", str(tmp_path / "src"), str(tmp_path / "c")]
    assert main([*argv, "--tokenizer", str(tmp_path / "tokenizer.json")]) == 0
    assert "vocabulary 3" in capsys.readouterr().out
    assert read_indexed(str(tmp_path / "c")).tokens.tolist() == [1, 2, 0, 1]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["/no/src", "OUT"], "SRC_DIR /no/src is not a directory"),
        (["SRC", "OUT", "--tokenizer", "/no/tokenizer.json"], "--tokenizer /no/tokenizer.json does not exist"),
    ],
)
def test_prepare_bad_input_is_one_clear_line(argv, needle, tmp_path, capsys):
    (tmp_path / "SRC").mkdir()
    (tmp_path / "SRC" / "a.txt").write_text("text")
    argv = [str(tmp_path / a) if a in ("SRC", "OUT") else a for a in argv]
    assert main(["data", "prepare", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1


@pytest.mark.parametrize("ext", ["bin", "idx"])
def test_prepare_never_overwrites_a_file_it_did_not_write(ext, tmp_path, capsys):
    """An existing OUT_PREFIX.bin or .idx (the user's): one line naming it, exit 2, the file untouched and
    nothing written beside it."""
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("text")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / f"ds.{ext}").write_text("mine\n")
    assert main(["data", "prepare", str(tmp_path / "src"), str(tmp_path / "out" / "ds")]) == 2
    err = capsys.readouterr().err
    want = f"{tmp_path / 'out' / f'ds.{ext}'} exists: jzero never overwrites a file it did not write"
    assert err.startswith("jzero: error: ") and want in err and err.count("\n") == 1, err
    assert (tmp_path / "out" / f"ds.{ext}").read_text() == "mine\n"
    assert [p.name for p in (tmp_path / "out").iterdir()] == [f"ds.{ext}"]


@pytest.mark.parametrize("prefix", ["", "out/", "out/."])
def test_prepare_refuses_a_prefix_that_names_no_file(prefix, tmp_path, capsys, monkeypatch):
    """An empty OUT_PREFIX or one ending in / would write hidden .bin/.idx files: one line, nothing written."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("text")
    assert main(["data", "prepare", "src", prefix]) == 2
    err = capsys.readouterr().err
    assert f"OUT_PREFIX {prefix!r} names no file" in err and err.count("\n") == 1, err
    assert [p.name for p in tmp_path.iterdir()] == ["src"]


def test_prepare_that_fails_midway_leaves_no_partial_files(tmp_path, capsys, monkeypatch):
    """A source file that cannot be read after others were written (simulated: root reads any file) and a
    token id that does not fit the dtype: one line, and no .bin, .idx or temporary file left behind."""
    import pathlib

    (tmp_path / "src").mkdir()
    for name in ("a.txt", "b.txt", "c.txt"):
        (tmp_path / "src" / name).write_text(name * 100)
    read_bytes = pathlib.Path.read_bytes

    def unreadable(path):
        if path.name == "c.txt":
            raise PermissionError(13, "Permission denied", str(path))
        return read_bytes(path)

    monkeypatch.setattr(pathlib.Path, "read_bytes", unreadable)
    (tmp_path / "out").mkdir()
    assert main(["data", "prepare", str(tmp_path / "src"), str(tmp_path / "out" / "ds")]) == 2
    err = capsys.readouterr().err
    assert "Permission denied" in err and err.count("\n") == 1, err
    assert list((tmp_path / "out").iterdir()) == []
    docs = [[np.array([1, 2])], [np.array([70000])]]
    with pytest.raises(ConfigError, match="do not fit uint16"):
        write_indexed(str(tmp_path / "out" / "w"), docs, np.uint16)
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.slow
def test_megatron_data_trains_with_validation_and_resumes_the_same(tmp_path):
    """`jzero data prepare` -> the training loop on the prefix: `val_loss` in metrics.jsonl every eval_every steps
    and at the last; a run resumed after step 2 (from that step's state) sees the same batches and validation
    batches: the same losses and validation losses, bitwise. (Checkpoints restore the state bitwise:
    test_checkpoint.py.)"""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"doc{i}.txt").write_text(" ".join(f"word{(i * 7 + j) % 23}" for j in range(300)))
    assert main(["data", "prepare", str(src), str(tmp_path / "corpus")]) == 0
    model = dict(n_layers=1, d_model=32, d_ff=64)
    train = dict(steps=4, global_batch=8, eval_every=2, eval_batches=2)
    data = {"kind": "indexed", "path": str(tmp_path / "corpus"), "val_fraction": 0.2}
    run = setup(tiny_config(model=model, train=train, data=data))
    first_half = dataclasses.replace(run, cfg=dataclasses.replace(run.cfg, train=dataclasses.replace(
        run.cfg.train, steps=2)))  # fmt: skip
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    with Preemption() as never:
        _loop(run, init_state(run), 0, tmp_path / "a", None, False, never)
        (_, state), _ = _loop(first_half, init_state(run), 0, tmp_path / "b", None, False, never)
        _loop(run, state, 2, tmp_path / "b", None, False, never)  # continues b's metrics.jsonl after step 2

    def rows(out):
        lines = (out / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["loss"], r["grad_norm"], r.get("val_loss")) for r in map(json.loads, lines)]

    assert [step for step, *_, val in rows(tmp_path / "a") if val is not None] == [2, 4]
    assert rows(tmp_path / "b") == rows(tmp_path / "a")


def test_resuming_on_other_data_says_what_changed(capsys):
    """The checkpoint's data identity beside the run's: one note naming each change (a key an older
    checkpoint lacks is not compared)."""
    from jzero.train.loop import _warn_if_other_data

    cfg = data_config("tokens", "a.bin")
    saved = {**data_identity(cfg), "val_fraction": 0.1, "position": 7}
    del saved["val_path"]
    _warn_if_other_data(saved, cfg)
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "val_fraction 0.1 -> 0.03" in err and "val_path" not in err
    _warn_if_other_data({**data_identity(cfg), "position": 7}, cfg)
    assert capsys.readouterr().err == ""


def test_prepare_writes_an_empty_text_as_no_sequence(tmp_path):
    """An empty file is a document of no sequence, as preprocess_data.py writes a text that tokenizes to
    nothing (Megatron's builder, transcribed in megatron_writer.py, gets `add_document([], [])`): the same
    .bin and .idx bytes, and no zero-length sequence to sample from."""
    from helpers.megatron_writer import write_fixture

    (tmp_path / "src").mkdir()
    texts = {"a.txt": "abc", "b.txt": "", "c.txt": "de"}
    for name, text in texts.items():
        (tmp_path / "src" / name).write_text(text)
    assert main(["data", "prepare", str(tmp_path / "src"), str(tmp_path / "jzero")]) == 0
    docs = [[list(t.encode())] if t else [] for _, t in sorted(texts.items())]
    write_fixture(str(tmp_path / "megatron"), docs, np.uint16)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"jzero.{ext}").read_bytes() == (tmp_path / f"megatron.{ext}").read_bytes(), ext
    f = read_indexed(str(tmp_path / "jzero"))
    assert f.document_indices.tolist() == [0, 1, 1, 2] and f.sequence_lengths.tolist() == [3, 2]
