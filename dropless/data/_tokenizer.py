"""Tokenizers as values: a byte tokenizer, byte-level BPE trained here, or any `tokenizer.json`.

Every tokenizer saves as a Hugging Face `tokenizer.json` (with the usual `tokenizer_config.json`
beside it naming the bos/eos tokens), so every prepared data directory has one format and
`load_tokenizer` reads any of them back to an equal value.

Text is always text: a document that contains the characters `<|endoftext|>` encodes them as
ordinary symbols, never as the special token (which only `prepare` inserts, between documents).
"""

import abc
import dataclasses
import functools
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import tokenizers
from jaxtyping import Int

BOS, EOS = "<|bos|>", "<|endoftext|>"
# The names tokenizers in the wild give their bos/eos tokens, looked up when no
# tokenizer_config.json says (DeepSeek-V3's use fullwidth bars and U+2581).
_BOS_NAMES = (
    BOS,
    "<｜begin▁of▁sentence｜>",
    "<|begin_of_text|>",
    "<|startoftext|>",
    "<s>",
    "<bos>",
)
_EOS_NAMES = (EOS, "<|eos|>", "<｜end▁of▁sentence｜>", "<|end_of_text|>", "</s>", "<eos>")
CONFIG_NAME = "tokenizer_config.json"


def token_dtype(vocab_size: int) -> str:
    """The dtype of a token file for `vocab_size` ids: uint16 up to 65,536, else uint32."""
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
    return "uint16" if vocab_size <= 2**16 else "uint32"


class AbstractTokenizer(abc.ABC):
    """text <-> token ids. `encode` adds no special tokens; `decode` keeps them unless asked."""

    kind: str  # "byte" or "hf", recorded in a prepared directory's meta.json

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids, special tokens included: every id is in `[0, vocab_size)`."""

    @property
    @abc.abstractmethod
    def bos_id(self) -> int | None: ...

    @property
    @abc.abstractmethod
    def eos_id(self) -> int | None: ...

    @abc.abstractmethod
    def encode(self, text: str) -> Int[np.ndarray, " n"]:
        """The ids of `text` (int32), no special tokens added."""

    def encode_batch(self, texts: Sequence[str]) -> list[Int[np.ndarray, " n"]]:
        return [self.encode(t) for t in texts]

    @abc.abstractmethod
    def decode(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = False) -> str:
        """The text of `ids`; bytes that are not valid UTF-8 become U+FFFD."""

    @abc.abstractmethod
    def to_json(self) -> str:
        """The Hugging Face `tokenizer.json` text of this tokenizer."""

    def save(self, path: str | Path) -> Path:
        """Write `tokenizer.json` (at `path`, or inside it if `path` is a directory) and a
        `tokenizer_config.json` beside it naming the bos/eos tokens; returns the json's path."""
        path = Path(path)
        if path.is_dir() or path.suffix != ".json":
            path = path / "tokenizer.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json(), encoding="utf-8")
        config = json.dumps(self._config(), indent=2, ensure_ascii=False) + "\n"
        (path.parent / CONFIG_NAME).write_text(config, encoding="utf-8")
        return path

    def _config(self) -> dict:
        ids = {"bos_token": self.bos_id, "eos_token": self.eos_id}
        return {k: None if i is None else self._token(i) for k, i in ids.items()}

    def _token(self, i: int) -> str:
        return self.decode([i])


@dataclasses.dataclass(frozen=True)
class ByteTokenizer(AbstractTokenizer):
    """The UTF-8 bytes of the text (ids 0-255), then the special tokens (ids 256, 257, ...).

    Saved as an equivalent byte-level BPE `tokenizer.json` without merges, so Hugging Face's
    `tokenizers` gives the same ids (with `encode_special_tokens = True`).
    """

    special_tokens: tuple[str, ...] = (BOS, EOS)
    kind = "byte"

    def __post_init__(self):
        if len(set(self.special_tokens)) != len(self.special_tokens):
            raise ValueError(f"special_tokens must be distinct, got {self.special_tokens}")

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.special_tokens)

    @property
    def bos_id(self) -> int | None:
        return _find(dict(self._specials), _BOS_NAMES)

    @property
    def eos_id(self) -> int | None:
        return _find(dict(self._specials), _EOS_NAMES)

    @property
    def _specials(self) -> list[tuple[str, int]]:
        return [(t, 256 + i) for i, t in enumerate(self.special_tokens)]

    def encode(self, text: str) -> Int[np.ndarray, " n"]:
        return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

    def decode(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = False) -> str:
        ids = np.asarray(ids, np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise ValueError(f"token ids must be in [0, {self.vocab_size}), got {ids.min()}..")
        out, start = [], 0
        for k in np.flatnonzero(ids >= 256):  # cut the bytes at each special token
            out.append(bytes(ids[start:k].astype(np.uint8)).decode("utf-8", "replace"))
            if not skip_special_tokens:
                out.append(self.special_tokens[ids[k] - 256])
            start = k + 1
        out.append(bytes(ids[start:].astype(np.uint8)).decode("utf-8", "replace"))
        return "".join(out)

    def to_json(self) -> str:
        return _byte_level(self.special_tokens).to_str(pretty=True)


@dataclasses.dataclass(frozen=True)
class HFTokenizer(AbstractTokenizer):
    """A Hugging Face `tokenizers` tokenizer, held as its `tokenizer.json` text (so two are equal
    when their files are), with the names of its bos/eos tokens (None: it has none)."""

    json: str
    bos_token: str | None = None
    eos_token: str | None = None
    kind = "hf"

    def __post_init__(self):
        for field in ("bos_token", "eos_token"):
            name = getattr(self, field)
            if name is not None and self._hf.token_to_id(name) is None:
                raise ValueError(f"{field} {name!r} is not in the tokenizer's vocabulary")

    def __repr__(self) -> str:  # not the whole json
        return f"HFTokenizer(vocab_size={self.vocab_size}, eos_token={self.eos_token!r})"

    @functools.cached_property
    def _hf(self) -> tokenizers.Tokenizer:
        tok = tokenizers.Tokenizer.from_str(self.json)
        tok.encode_special_tokens = True  # text is text (module docstring)
        return tok

    @functools.cached_property
    def vocab_size(self) -> int:
        # one more than the largest id: a vocabulary may have holes
        return max(self._hf.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    @property
    def bos_id(self) -> int | None:
        return None if self.bos_token is None else self._hf.token_to_id(self.bos_token)

    @property
    def eos_id(self) -> int | None:
        return None if self.eos_token is None else self._hf.token_to_id(self.eos_token)

    def encode(self, text: str) -> Int[np.ndarray, " n"]:
        return np.asarray(self._hf.encode(text, add_special_tokens=False).ids, np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[Int[np.ndarray, " n"]]:
        out = self._hf.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, np.int32) for e in out]

    def decode(self, ids: Sequence[int] | np.ndarray, *, skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in np.asarray(ids).reshape(-1)]
        return self._hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def to_json(self) -> str:
        return self.json

    def _token(self, i: int) -> str:
        return self._hf.id_to_token(i)


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    *,
    special_tokens: tuple[str, ...] = (BOS, EOS),
    length: int | None = None,
) -> HFTokenizer:
    """Byte-level BPE (GPT-2's pre-tokenizer, no prefix space) trained on `texts`: the special
    tokens, the 256 byte symbols, then up to `vocab_size` in all with merges. The same texts and
    vocab_size give the same tokenizer. `length` (the number of texts) only feeds progress."""
    least = len(special_tokens) + 256
    if vocab_size < least:
        raise ValueError(
            f"vocab_size must be >= {least} for byte-level BPE (256 bytes + "
            f"{len(special_tokens)} special tokens), got {vocab_size}"
        )
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return _from_hf(tok, config=None)


def load_tokenizer(path: str | Path) -> AbstractTokenizer:
    """The tokenizer in `path`: a `tokenizer.json`, or a directory holding one (a prepared data
    directory, a checkpoint's). The bos/eos tokens come from `tokenizer_config.json` beside it,
    else from their usual names. A file that `ByteTokenizer` wrote loads as a `ByteTokenizer`."""
    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}")
    text = file.read_text(encoding="utf-8")
    try:
        tok = tokenizers.Tokenizer.from_str(text)
    except Exception as e:  # tokenizers raises a bare Exception
        raise ValueError(f"{file} is not a Hugging Face tokenizer.json: {e}") from None
    config_file = file.parent / CONFIG_NAME
    config = json.loads(config_file.read_text("utf-8")) if config_file.is_file() else None
    byte = _as_byte_tokenizer(json.loads(text))
    if byte is not None and (config is None or _names(config) == _names(byte._config())):
        return byte
    return _from_hf(tok, config)


def _find(specials: dict[str, int], names: tuple[str, ...]) -> int | None:
    return next((specials[n] for n in names if n in specials), None)


def _names(config: dict) -> tuple[str | None, str | None]:
    """(bos, eos) token names of a tokenizer_config.json (a string or an {"content": ...})."""

    def name(v):
        return v.get("content") if isinstance(v, dict) else v

    return name(config.get("bos_token")), name(config.get("eos_token"))


def _from_hf(tok: tokenizers.Tokenizer, config: dict | None) -> HFTokenizer:
    if config is not None:
        bos, eos = _names(config)
    else:
        added = {t.content: i for i, t in tok.get_added_tokens_decoder().items()}
        bos, eos = (_find(added, names) for names in (_BOS_NAMES, _EOS_NAMES))
        bos, eos = (None if i is None else tok.id_to_token(i) for i in (bos, eos))
    return HFTokenizer(tok.to_str(pretty=True), bos_token=bos, eos_token=eos)


def _as_byte_tokenizer(data: dict) -> ByteTokenizer | None:
    """The ByteTokenizer whose tokenizer.json is `data`, if there is one."""
    added = sorted(data.get("added_tokens") or [], key=lambda t: t["id"])
    candidate = ByteTokenizer(tuple(t["content"] for t in added))
    same = json.loads(candidate.to_json()) == data
    return candidate if same else None


@functools.cache
def _byte_level(special_tokens: tuple[str, ...]) -> tokenizers.Tokenizer:
    """A BPE without merges over the 256 byte symbols, byte b as id b."""
    # GPT-2's byte <-> printable-character map, which the ByteLevel pre-tokenizer applies
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in printable}
    chars.update({b: chr(256 + n) for n, b in enumerate(sorted(set(range(256)) - set(printable)))})
    tok = tokenizers.Tokenizer(
        tokenizers.models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[])
    )
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens(
        [tokenizers.AddedToken(t, special=True, normalized=False) for t in special_tokens]
    )
    return tok
