import fcntl
import json
import os
import stat
import sys

import numpy as np
import pytest
import tokenizers

from dropless.data import ByteTokenizer, HFTokenizer, load_tokenizer, prepare
from dropless.data._datasets import TokenFile
from dropless.data._prepare import clean_leftovers
from dropless.data._tokenizer import EOS

PROSE = "Le cœur a ses raisons que la raison ne connaît point. 😀 <|endoftext|> as text\n"


def documents(out, split):
    """The documents of a prepared split, decoded: eos after each one."""
    meta = json.loads((out / "meta.json").read_text())
    ids = np.fromfile(out / f"{split}.bin", meta["dtype"])
    tok = load_tokenizer(out)
    assert not ids.size or ids[-1] == tok.eos_id
    # cut at the eos ids, not at the text "<|endoftext|>" (which documents may hold)
    cuts = np.flatnonzero(ids == tok.eos_id)
    return [tok.decode(d) for d in np.split(ids, cuts + 1)[:-1]] if ids.size else []


def check_counts(out, meta):
    for split in ("train", "eval"):
        docs = [d.removesuffix(EOS) for d in documents(out, split)]
        tokens = np.fromfile(out / f"{split}.bin", meta["dtype"])
        c = meta[split]
        assert c["documents"] == len(docs) and c["tokens"] == tokens.size
        assert c["bytes"] == sum(len(d.encode()) for d in docs)
    return sorted(d.removesuffix(EOS) for s in ("train", "eval") for d in documents(out, s))


def test_text_file(tmp_path):
    """A file larger than max_document_bytes is cut after line ends; every piece comes back."""
    text = "".join(f"line {i}: {PROSE}" for i in range(300))
    (tmp_path / "book.txt").write_text(text)
    out = tmp_path / "out"
    meta = prepare([tmp_path / "book.txt"], out, max_document_bytes=1000, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [
        "eval.bin", "meta.json", "tokenizer.json", "tokenizer_config.json", "train.bin"
    ]  # fmt: skip
    docs = check_counts(out, meta)
    assert all(0 < len(d.encode()) <= 1000 and d.endswith("\n") for d in docs)
    assert "".join(sorted(docs, key=text.index)) == text
    assert meta["eval"]["documents"] >= 1 and meta["dtype"] == "uint16"
    assert meta["tokenizer"] == {
        "kind": "byte", "source": None, "vocab_size": 258, "bos_id": 256, "eos_id": 257
    }  # fmt: skip
    assert meta["sources"] == [
        {"path": str(tmp_path / "book.txt"), "type": "file", "files": 1,
         "bytes": len(text.encode()), "documents": len(docs)}
    ]  # fmt: skip
    assert load_tokenizer(out) == ByteTokenizer()
    # the training loader reads the files
    for split in ("train", "eval"):
        batch = TokenFile(str(out / f"{split}.bin"), meta["dtype"]).batch(
            0, seed=0, batch_size=2, seq_len=8
        )
        assert batch.tokens.shape == (2, 9) and batch.tokens.max() < 258


def write_tree(root):
    """A folder of documents: what prepare reads, and what it skips."""
    texts = {
        "a.txt": "alpha\n",
        "sub/b.md": "# bravo\n",
        "sub/deeper/c.py": "charlie = 3\n",
        "sub/d.rst": "delta\n",
        "e.jsonl": '{"text": "echo"}\n\n{"text": "foxtrot", "id": 7}\n{"text": ""}\n',
    }
    for name, text in texts.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "skip.csv").write_text("not,read\n")
    (root / ".hidden.txt").write_text("hidden\n")
    (root / ".git").mkdir()
    (root / ".git" / "x.txt").write_text("hidden\n")
    (root / "empty.txt").write_text("")
    return ["alpha\n", "# bravo\n", "charlie = 3\n", "delta\n", "echo", "foxtrot"]


def test_folder_and_jsonl(tmp_path):
    expected = write_tree(tmp_path / "in")
    meta = prepare([tmp_path / "in"], tmp_path / "out", eval_fraction=0.3, progress=False)
    assert check_counts(tmp_path / "out", meta) == sorted(expected)
    assert meta["sources"][0] | {"bytes": 0} == {
        "path": str(tmp_path / "in"), "type": "folder", "files": 5, "bytes": 0, "documents": 6
    }  # fmt: skip
    assert 1 <= meta["eval"]["documents"] < 6


def test_at_least_one_eval_document(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n{"text": "two"}\n')
    meta = prepare([tmp_path / "a.jsonl"], tmp_path / "out", eval_fraction=1e-9, progress=False)
    assert meta["split"]["moved_to_eval"] and meta["eval"]["documents"] == 1
    assert check_counts(tmp_path / "out", meta) == ["one", "two"]


def test_deterministic_bpe(tmp_path):
    expected = write_tree(tmp_path / "in")
    (tmp_path / "in" / "big.txt").write_text("".join(f"{i} {PROSE}" for i in range(200)))
    metas = [
        prepare([tmp_path / "in"], tmp_path / o, tokenizer="bpe", vocab_size=400, progress=False)
        for o in ("x", "y")
    ]
    assert metas[0] == metas[1] and metas[0]["tokenizer"]["kind"] == "bpe"
    for name in ("train.bin", "eval.bin", "tokenizer.json", "meta.json"):
        assert (tmp_path / "x" / name).read_bytes() == (tmp_path / "y" / name).read_bytes()
    tok = load_tokenizer(tmp_path / "x")
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 400
    big = (tmp_path / "in" / "big.txt").read_text()
    assert check_counts(tmp_path / "x", metas[0]) == sorted([*expected, big])
    assert metas[0]["train"]["tokens"] < metas[0]["train"]["bytes"] / 2


def test_tokenizer_file_and_uint32(tmp_path):
    """A tokenizer.json with more than 65,536 ids gives uint32 files."""
    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf.add_special_tokens(["<|endoftext|>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.jsonl").write_text('{"text": "w1 w69999"}\n{"text": "w70 w2 oov"}\n')
    meta = prepare(
        [tmp_path / "a.jsonl"], tmp_path / "out", tokenizer=tmp_path / "tokenizer.json",
        progress=False,
    )  # fmt: skip
    assert meta["dtype"] == "uint32" and meta["tokenizer"]["vocab_size"] == 70_002
    assert meta["tokenizer"]["kind"] == "file"
    ids = np.concatenate(
        [np.fromfile(tmp_path / "out" / f, np.uint32) for f in ("train.bin", "eval.bin")]
    )
    assert sorted(ids.tolist()) == sorted([1, 69999, 70_001, 70, 2, 70_000, 70_001])
    TokenFile(str(tmp_path / "out" / "train.bin"), "uint32")


def test_overwrite(tmp_path):
    (tmp_path / "a.txt").write_text("first\n")
    prepare([tmp_path / "a.txt"], tmp_path / "out", progress=False)
    with pytest.raises(FileExistsError, match="exists and is not empty.*overwrite"):
        prepare([tmp_path / "a.txt"], tmp_path / "out", progress=False)
    (tmp_path / "a.txt").write_text("second\n")
    meta = prepare([tmp_path / "a.txt"], tmp_path / "out", overwrite=True, progress=False)
    assert check_counts(tmp_path / "out", meta) == ["second\n"]
    assert meta["eval"]["documents"] == 0  # one document: nothing to hold out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "out"]
    (tmp_path / "empty").mkdir()  # an empty directory is fine
    prepare([tmp_path / "a.txt"], tmp_path / "empty", progress=False)


def bad_inputs(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "data.csv").write_text("a,b\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"txt": "no"}\n')
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    (tmp_path / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n\n')
    return [
        ("missing.txt", FileNotFoundError, "missing.txt does not exist"),
        ("empty.txt", ValueError, "empty.txt is empty"),
        ("nothing", ValueError, "nothing holds no non-empty files with the extensions"),
        ("bad.jsonl", ValueError, 'bad.jsonl:2: each line .* a string "text" field'),
        ("broken.jsonl", ValueError, "broken.jsonl:2: not valid JSON"),
        ("latin1.txt", ValueError, r"latin1.txt is not UTF-8 text \(invalid byte at offset 3\)"),
        ("blank.jsonl", ValueError, "no documents found in the inputs .*blank.jsonl"),
    ]


def test_errors_leave_nothing(tmp_path):
    (tmp_path / "good.txt").write_text("good\n")
    for name, error, match in bad_inputs(tmp_path):
        inputs = (
            [tmp_path / name] if name == "blank.jsonl" else [tmp_path / "good.txt", tmp_path / name]
        )
        with pytest.raises(error, match=match):
            prepare(inputs, tmp_path / "out", progress=False)
        assert not (tmp_path / "out").exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_argument_errors(tmp_path):
    (tmp_path / "a.txt").write_text("a\n")
    args = [tmp_path / "a.txt"], tmp_path / "out"
    for kwargs, error, match in [
        ({"eval_fraction": 0.0}, ValueError, r"eval_fraction must be in \(0, 1\)"),
        ({"vocab_size": 500}, ValueError, "vocab_size applies to tokenizer='bpe' only"),
        ({"tokenizer": "nope"}, FileNotFoundError, "must be 'byte', 'bpe' or the path"),
        ({"tokenizer": "bpe", "vocab_size": 10}, ValueError, "vocab_size must be >= 258"),
        ({"tokenizer": ByteTokenizer(("<pad>",))}, ValueError, "no end-of-text token"),
    ]:
        with pytest.raises(error, match=match):
            prepare(*args, progress=False, **kwargs)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]
    with pytest.raises(ValueError, match="no inputs given"):
        prepare([], tmp_path / "out")


def test_parquet(tmp_path):
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        (tmp_path / "a.parquet").write_bytes(b"PAR1")
        with pytest.raises(ValueError, match="needs pyarrow.*pip install pyarrow"):
            prepare([tmp_path / "a.parquet"], tmp_path / "out")
        assert not (tmp_path / "out").exists()
        return
    pq.write_table(pa.table({"text": ["one", "two", "three"]}), tmp_path / "a.parquet")
    meta = prepare([tmp_path / "a.parquet"], tmp_path / "out", progress=False)
    assert check_counts(tmp_path / "out", meta) == ["one", "three", "two"]


# --- what a killed or failed prepare leaves (issue 53 rows 11 and 13) --------------------------


def test_leftovers_of_killed_prepares_are_removed(tmp_path):
    """A SIGKILL leaves `.NAME.XXXX.tmp`; the next prepare into NAME removes the ones no live
    process holds, and keeps one that is being written."""
    (tmp_path / "a.txt").write_text(PROSE * 3)
    out = tmp_path / "data"
    killed = tmp_path / ".data.k1ll3d.tmp"
    killed.mkdir()
    (killed / ".preparing").write_text("")
    (killed / "train.bin").write_bytes(b"\0" * 1000)
    working = tmp_path / ".data.w0rk1n.tmp"
    working.mkdir()
    held = open(working / ".preparing", "w")  # noqa: SIM115
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        prepare([tmp_path / "a.txt"], out, progress=False)
        assert not killed.exists() and working.exists()
    finally:
        held.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".data.w0rk1n.tmp", "a.txt", "data"]
    assert not (out / ".preparing").exists()


def test_a_kill_between_the_renames_of_an_overwrite_is_undone(tmp_path):
    (tmp_path / "a.txt").write_text(PROSE)
    out = tmp_path / "data"
    prepare([tmp_path / "a.txt"], out, progress=False)
    old = tmp_path / ".data.x.old"
    old.mkdir()
    out.rename(old / "data")  # what a kill after the first rename leaves
    assert clean_leftovers(out) == [old]
    assert (out / "meta.json").is_file() and not old.exists()


def test_published_with_the_users_umask(tmp_path):
    (tmp_path / "a.txt").write_text(PROSE)
    previous = os.umask(0o022)
    try:
        prepare([tmp_path / "a.txt"], tmp_path / "data", progress=False)
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "data").stat().st_mode) == 0o755


def test_a_full_disk_is_one_line_with_the_space_needed(tmp_path, monkeypatch):
    """numpy's short write ("N requested and M written") becomes a no-space line naming the
    folder, the free space and about what the token files need; nothing is left behind."""
    (tmp_path / "a.txt").write_text(PROSE * 100)

    def full(*args, **kwargs):
        raise OSError("1028882 requested and 1012088 written")

    monkeypatch.setattr(sys.modules["dropless.data._prepare"], "write_bins", full)
    with pytest.raises(OSError, match=r"no space left on the device of .* free, about .* needed"):
        prepare([tmp_path / "a.txt"], tmp_path / "data", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt"]
