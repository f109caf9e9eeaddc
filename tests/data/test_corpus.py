import json
from pydoc_data.topics import topics

import numpy as np
import pytest

from dropless.data import ByteTokenizer, default_corpus_dir, load_tokenizer
from dropless.data._corpus import corpus_texts


def test_corpus_texts_capped():
    texts = list(corpus_texts(600_000))
    assert 600_000 - 3 <= sum(len(t.encode()) for _, t in texts) <= 600_000  # cut at a character
    assert texts[0] == (0, topics[sorted(topics)[0]])
    assert {s for s, _ in texts} == {0, 1}  # the topics are about 0.5 MB: some source too
    assert texts[-1][0] == 1 and "def " in "".join(t for s, t in texts if s == 1)


def test_default_corpus_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DROPLESS_CACHE", str(tmp_path))
    out = default_corpus_dir(max_bytes=600_000, progress=False)
    assert out.parent == tmp_path and out.name.startswith("corpus-")
    meta = json.loads((out / "meta.json").read_text())
    assert meta["tokenizer"]["kind"] == "byte" and load_tokenizer(out) == ByteTokenizer()
    assert 600_000 - 3 <= meta["train"]["bytes"] + meta["eval"]["bytes"] <= 600_000
    assert meta["eval"]["documents"] >= 1
    assert [s["type"] for s in meta["sources"]] == ["python-docs", "python-stdlib"]
    tokens = np.fromfile(out / "train.bin", meta["dtype"])
    assert tokens.size == meta["train"]["tokens"]
    # reused, not prepared again; another cap is another directory
    stamp = (out / "meta.json").stat().st_mtime_ns
    assert default_corpus_dir(max_bytes=600_000) == out
    assert (out / "meta.json").stat().st_mtime_ns == stamp
    other = default_corpus_dir(tmp_path / "elsewhere", max_bytes=1000, progress=False)
    assert other.parent == tmp_path / "elsewhere" and other.name != out.name
    with pytest.raises(ValueError, match="max_bytes must be >= 1"):
        default_corpus_dir(tmp_path, max_bytes=0)
