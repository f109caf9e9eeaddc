"""`TrainConfig.data`: the synthetic corpus, a prepared directory (the default stdlib corpus is
one), a flat token file; the tokenizer's vocabulary against the model's; what a run records."""

import json
import shutil

import numpy as np
import pytest
import yaml

from dropless.data import prepare
from dropless.data._datasets import SyntheticCorpus, TokenFile
from dropless.data._verify import DataChanged, verify_prepared
from dropless.models.deepseek_v3 import get_preset
from dropless.train import TrainConfig, train
from dropless.train.loop import fit_vocab, open_data
from dropless.train.loop._data_source import check_vocab
from dropless.train.loop._run_eval import prepared_eval_split

TINY = get_preset("tiny")
TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    folder = tmp_path_factory.mktemp("text")
    for i in range(40):
        (folder / f"f{i:02d}.py").write_text(TEXT * (3 + i % 5) + f"# file {i}\n")
    out = tmp_path_factory.mktemp("prepared") / "data"
    prepare([folder], out, eval_fraction=0.2, progress=False)
    return out


def test_synthetic(tmp_path):
    data = open_data(TrainConfig(data="synthetic", n_languages=2), 64)
    assert isinstance(data.train, SyntheticCorpus) and data.train.vocab_size == 64
    assert data.tokenizer is None and data.vocab_size is None
    assert data.record == {"source": "synthetic", "n_languages": 2, "corpus_seed": 0}


def test_prepared_directory(prepared):
    meta = json.loads((prepared / "meta.json").read_text())
    data = open_data(TrainConfig(data=str(prepared)), 512)
    assert isinstance(data.train, TokenFile) and data.train.dtype == meta["dtype"]
    assert data.train.path.endswith("train.bin") and data.eval.path.endswith("eval.bin")
    assert data.vocab_size == 258  # the byte tokenizer
    assert data.record["meta_sha256"] == meta["sha256"]["all"]
    assert data.record["source"] == "prepared" and data.record["path"] == str(prepared)


def test_flat_token_file(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint32).tofile(path)
    data = open_data(TrainConfig(data=str(path), data_dtype="uint32"), 2000)
    assert data.tokenizer is None and data.train.stop == 950 and data.eval.start == 950
    assert data.record == {
        "source": "token-file",
        "path": str(path),
        "dtype": "uint32",
        "eval_fraction": 0.05,
    }


def test_bad_data_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="lacks train.bin, eval.bin, tokenizer.json"):
        open_data(TrainConfig(data=str(tmp_path)), 512)
    with pytest.raises(FileNotFoundError, match="dropless prepare"):
        open_data(TrainConfig(data=str(tmp_path)), 512)
    with pytest.raises(FileNotFoundError, match="neither 'stdlib', 'synthetic'"):
        open_data(TrainConfig(data=str(tmp_path / "nothing")), 512)


def test_a_text_file_points_to_prepare(tmp_path, prepared):
    text = tmp_path / "README.md"
    text.write_text("# Notes\n\nCafé — naïve text, an odd number of bytes.\n" * 50 + "End")
    assert text.stat().st_size % 2  # what uint16 reading called "not a positive multiple of 2"
    with pytest.raises(ValueError, match=r"README.md is text, not token ids.*dropless prepare"):
        open_data(TrainConfig(data=str(text)), 512)
    # token files are not text: byte-level ids, and BPE-sized ids as uint16 and uint32
    ids = np.random.default_rng(0).integers(0, 8192, 5000)
    for dtype in ("uint16", "uint32"):
        path = tmp_path / f"ids.{dtype}"
        ids.astype(dtype).tofile(path)
        assert open_data(TrainConfig(data=str(path), data_dtype=dtype), 8192).tokenizer is None
    data = open_data(TrainConfig(data=str(prepared / "train.bin")), 512)
    assert data.record["source"] == "token-file"


def test_the_tokenizer_sets_the_vocabulary_unless_given(prepared):
    data = open_data(TrainConfig(data=str(prepared)), 512)
    assert fit_vocab(TINY, data, given=False).vocab_size == 258
    assert fit_vocab(TINY, data, given=True).vocab_size == 512  # larger: kept
    small = TINY.replace(vocab_size=200)
    for call in (lambda: fit_vocab(small, data, given=True), lambda: check_vocab(small, data)):
        with pytest.raises(ValueError, match=r"vocab_size = 200\) is smaller than .* \(258\)"):
            call()
    synthetic = open_data(TrainConfig(data="synthetic"), 512)
    assert fit_vocab(small, synthetic, given=False) == small  # no tokenizer: as it is


@pytest.mark.slow  # compiles a step of its own (vocabulary 258)
def test_training_on_a_prepared_directory_records_it(prepared, tmp_path, train_config):
    config = train_config(data=str(prepared))
    # a dense and an MoE layer, no MTP block: the run records its data whatever the model
    model = TINY.replace(vocab_size=258, num_hidden_layers=2, num_nextn_predict_layers=0)
    results = train(model, config, backend="jnp", out_dir=str(tmp_path))
    assert all(r["tokens_per_s"] > 0 and "mfu" in r for r in results.records)
    summary = json.loads((tmp_path / "summary.json").read_text())
    meta = json.loads((prepared / "meta.json").read_text())
    assert summary["data"]["meta_sha256"] == meta["sha256"]["all"]
    assert summary["tokens_per_s"] > 0 and "mfu" in summary
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert written["data"] == summary["data"]

    with pytest.raises(ValueError, match="is smaller than the tokenizer's"):
        train(TINY.replace(vocab_size=200), config, out_dir=str(tmp_path / "small"))
    assert not (tmp_path / "small").exists()


# --- data checked against meta.json when opened (issue 53) -------------------------------------


@pytest.fixture
def copy(prepared, tmp_path):
    out = tmp_path / "data"
    shutil.copytree(prepared, out)
    return out


def test_a_truncated_token_file_is_refused(copy):
    """Row 6: train.bin cut to 100 bytes no longer matches meta.json's token count."""
    with open(copy / "train.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataChanged, match=r"train\.bin has 100 bytes; meta\.json records"):
        open_data(TrainConfig(data=str(copy)), 512)


def test_a_tokenizer_swapped_in_is_refused(copy, tmp_path):
    """Row 6: a tokenizer.json from another folder differs from the hash meta.json records."""
    other = tmp_path / "other"
    prepare([copy.parent / "data" / "meta.json"], other, tokenizer="bpe", vocab_size=270,
            progress=False)  # fmt: skip
    shutil.copy(other / "tokenizer.json", copy / "tokenizer.json")
    with pytest.raises(DataChanged, match=r"tokenizer\.json differs from the SHA-256"):
        open_data(TrainConfig(data=str(copy)), 512)


def test_token_hashes_are_checked_on_request(copy):
    data = np.fromfile(copy / "train.bin", np.uint16)
    data[3] = (data[3] + 1) % 200
    data.tofile(copy / "train.bin")
    meta = json.loads((copy / "meta.json").read_text())
    verify_prepared(copy, meta)  # the sizes agree
    with pytest.raises(DataChanged, match=r"train\.bin differs from the SHA-256"):
        verify_prepared(copy, meta, hashes=True)


def test_an_id_outside_the_vocabulary_is_found_when_opened(copy, tmp_path):
    """Row 7: found at open, naming the file and the offset, not at some step."""
    data = np.fromfile(copy / "train.bin", np.uint16)
    data[1234] = 60000
    data.tofile(copy / "train.bin")
    meta = json.loads((copy / "meta.json").read_text())
    meta["sha256"].pop("train.bin")  # a consistent folder, holding a bad id
    (copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"train\.bin: token id 60000 at offset 1,234 .*258"):
        open_data(TrainConfig(data=str(copy)), 512)
    flat = tmp_path / "tokens.bin"
    np.concatenate([np.arange(100), [700], np.arange(100)]).astype(np.uint16).tofile(flat)
    with pytest.raises(ValueError, match=r"tokens\.bin: token id 700 at offset 100 \(byte 200\)"):
        open_data(TrainConfig(data=str(flat)), 512)


def test_meta_json_names_no_file_outside_its_folder(copy, tmp_path):
    """Row 9: `files.eval` = ../../outside.bin is refused, and never read."""
    (tmp_path / "outside.bin").write_bytes(np.arange(64, dtype=np.uint16).tobytes())
    meta = json.loads((copy / "meta.json").read_text())
    meta["files"]["eval"] = "../outside.bin"
    (copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(DataChanged, match=r"files\.eval.*'\.\./outside\.bin'.*not a plain name"):
        prepared_eval_split(copy)
    with pytest.raises(DataChanged, match="not a plain name"):
        open_data(TrainConfig(data=str(copy)), 512)
