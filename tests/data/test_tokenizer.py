import json

import numpy as np
import pytest
import tokenizers
from hypothesis import given
from hypothesis import strategies as st

from dropless.data import ByteTokenizer, HFTokenizer, load_tokenizer, token_dtype, train_bpe
from dropless.data._tokenizer import BOS, EOS

TEXTS = [
    "def f(x):\n    return x + 1\n",
    "Le cœur a ses raisons que la raison ne connaît point. 😀 " * 3,
    "naïve café — 東京 — emoji 🎉 and <|endoftext|> written out",
] * 5


@given(st.text())
def test_byte_round_trip_any_unicode(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and np.all((ids >= 0) & (ids < 256))
    assert tok.decode(ids) == text


def test_byte_specials():
    tok = ByteTokenizer()
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (258, 256, 257)
    ids = np.r_[tok.bos_id, tok.encode("hé"), tok.eos_id]
    assert tok.decode(ids) == f"{BOS}hé{EOS}"
    assert tok.decode(ids, skip_special_tokens=True) == "hé"
    # written-out special tokens are text, not the special id
    assert tok.eos_id not in tok.encode(EOS)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 258\)"):
        tok.decode([258])


def test_byte_json_is_an_equivalent_hf_tokenizer(tmp_path):
    tok = ByteTokenizer()
    hf = tokenizers.Tokenizer.from_file(str(tok.save(tmp_path)))
    hf.encode_special_tokens = True
    for text in TEXTS:
        assert hf.encode(text, add_special_tokens=False).ids == tok.encode(text).tolist()
    assert hf.token_to_id(EOS) == tok.eos_id


@pytest.mark.parametrize("specials", [(BOS, EOS), ("<|endoftext|>",), ("<pad>", "<|eos|>")])
def test_byte_save_load(tmp_path, specials):
    tok = ByteTokenizer(specials)
    path = tok.save(tmp_path / "tokenizer.json")
    assert load_tokenizer(path) == tok
    assert load_tokenizer(tmp_path) == tok


def test_bpe_round_trip_and_determinism(tmp_path):
    a = train_bpe(TEXTS, 300)
    b = train_bpe(iter(TEXTS), 300)
    assert a == b and a.vocab_size == 300 and (a.bos_id, a.eos_id) == (0, 1)
    for text in TEXTS:
        ids = a.encode(text)
        assert len(ids) < len(text.encode()) and a.decode(ids) == text
    assert a.eos_id not in a.encode(EOS)
    loaded = load_tokenizer(a.save(tmp_path))
    assert isinstance(loaded, HFTokenizer) and loaded == a
    assert loaded.encode(TEXTS[1]).tolist() == a.encode(TEXTS[1]).tolist()


def test_bpe_vocab_too_small():
    with pytest.raises(ValueError, match="vocab_size must be >= 258"):
        train_bpe(TEXTS, 100)


def test_load_foreign_tokenizer(tmp_path):
    """A checkpoint's tokenizer.json: eos/bos from tokenizer_config.json, else the usual names."""
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "<s>": 3, "</s>": 4, "<stop>": 5}
    hf = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    hf.add_special_tokens(["<s>", "</s>", "<stop>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = load_tokenizer(tmp_path)
    assert (tok.vocab_size, tok.bos_id, tok.eos_id) == (6, 3, 4)
    assert tok.encode("hello world").tolist() == [1, 2]
    config = {"bos_token": None, "eos_token": {"content": "<stop>"}}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(tmp_path / "tokenizer.json")
    assert (tok.bos_id, tok.eos_id) == (None, 5)
    assert load_tokenizer(tok.save(tmp_path / "copy")) == tok


def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(ValueError, match="not a Hugging Face tokenizer.json"):
        load_tokenizer(tmp_path)


def test_token_dtype():
    assert token_dtype(258) == "uint16" and token_dtype(65536) == "uint16"
    assert token_dtype(65537) == "uint32" and token_dtype(129280) == "uint32"
    with pytest.raises(ValueError, match="vocab_size must be >= 1"):
        token_dtype(0)
