"""What `TrainConfig.data` names, opened: the train and eval datasets, the tokenizer (when the
data has one) and the record of what was read.

    "stdlib"       the default corpus (`dropless.data.default_corpus_dir()`: the Python standard
                   library's source and documentation, byte-level), prepared on first use
    "synthetic"    the built-in Markov corpus (`SyntheticCorpus`), no tokenizer
    a directory    prepared by `dropless prepare` (train.bin, eval.bin, tokenizer.json, meta.json):
                   dtype from meta.json, the eval split from eval.bin
    a .bin file    flat token ids (`data_dtype`), eval from `eval_data` or the file's tail

The tokenizer's vocabulary size is what the model needs at least (`check_vocab`), and what the
`dropless` command sets the model's to unless the user gave one (`fit_vocab`).
"""

import dataclasses
import os

from dropless.data import AbstractTokenizer, default_corpus_dir, load_tokenizer
from dropless.data._datasets import AbstractDataset, SyntheticCorpus, TokenFile, token_file_splits
from dropless.data._verify import check_ids, read_meta, sha256_file, split_file, verify_prepared
from dropless.models.deepseek_v3 import DeepSeekV3Config
from dropless.train._config import TrainConfig
from dropless.train.store._layout import STDLIB, SYNTHETIC

PREPARED_FILES = ("train.bin", "eval.bin", "tokenizer.json", "meta.json")
_HOW_TO_PREPARE = (
    "a prepared data directory holds train.bin, eval.bin, tokenizer.json and meta.json; make one "
    "with `dropless prepare TEXT_FILES_OR_FOLDERS --out DIR` (or dropless.data._prepare)"
)


@dataclasses.dataclass(frozen=True)
class DataSource:
    """The opened data of a run. `record` is what config.yaml and summary.json say about it."""

    train: AbstractDataset
    eval: AbstractDataset
    tokenizer: AbstractTokenizer | None
    record: dict

    @property
    def vocab_size(self) -> int | None:
        """The tokenizer's vocabulary size (None: no tokenizer)."""
        return None if self.tokenizer is None else self.tokenizer.vocab_size


def open_data(train_config: TrainConfig, vocab_size: int, *, progress: bool = False) -> DataSource:
    """The data that `train_config.data` names (see the module docstring). `vocab_size` is the
    model's (the synthetic corpus spans it); `progress` shows the default corpus's preparation
    when it happens."""
    data = train_config.data
    if data == SYNTHETIC:
        corpus = SyntheticCorpus(
            vocab_size, n_languages=train_config.n_languages, corpus_seed=train_config.corpus_seed
        )
        record = {
            "source": SYNTHETIC,
            "n_languages": train_config.n_languages,
            "corpus_seed": train_config.corpus_seed,
        }
        return DataSource(corpus, corpus, None, record)
    if data == STDLIB:
        return _prepared(str(default_corpus_dir(progress=progress)), STDLIB)
    if os.path.isdir(data):
        return _prepared(data, "prepared")
    if not os.path.exists(data):
        raise FileNotFoundError(
            f"TrainConfig.data: {data!r} is neither 'stdlib', 'synthetic', a prepared data "
            f"directory nor a token file; {_HOW_TO_PREPARE}"
        )
    if _looks_like_text(data):
        raise ValueError(
            f"TrainConfig.data: {data} is text, not token ids; tokenize it first: `dropless "
            f"prepare {data} --out data/NAME`, then `--data data/NAME`"
        )
    train, held_out = token_file_splits(
        data,
        train_config.data_dtype,
        eval_path=train_config.eval_data,
        eval_fraction=train_config.eval_fraction,
    )
    for path in {train.path, held_out.path}:
        check_ids(path, train.dtype, vocab_size, "the model's")
    record = {"source": "token-file", "path": os.path.abspath(data), "dtype": train.dtype}
    if train_config.eval_data is None:
        record["eval_fraction"] = train_config.eval_fraction
    else:
        record["eval_path"] = os.path.abspath(train_config.eval_data)
    return DataSource(train, held_out, None, record)


def _looks_like_text(path: str) -> bool:
    """Whether the file starts as UTF-8 text: no NUL or other control bytes but tab and line
    breaks (a token file's ids below 256, or 8192 as uint16, have control high bytes)."""
    with open(path, "rb") as f:
        head = f.read(1 << 16)
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start < len(head) - 3:  # not a character cut at the end of the read
            return False
        text = head[: err.start].decode("utf-8")
    return bool(text) and all(c >= " " or c in "\t\n\r" for c in text)


def _prepared(directory: str, source: str) -> DataSource:
    missing = [f for f in PREPARED_FILES if not os.path.isfile(os.path.join(directory, f))]
    if missing:
        raise FileNotFoundError(
            f"TrainConfig.data: directory {directory} lacks {', '.join(missing)}; {_HOW_TO_PREPARE}"
        )
    meta = read_meta(directory)
    dtype = meta.get("dtype")
    if dtype not in ("uint16", "uint32"):
        raise ValueError(
            f"TrainConfig.data: {directory}/meta.json has dtype {dtype!r}, not 'uint16' or "
            "'uint32'; prepare the directory again"
        )
    verify_prepared(directory, meta)
    tokenizer = load_tokenizer(directory)
    files = {split: str(split_file(directory, meta, split)) for split in ("train", "eval")}
    for path in files.values():
        check_ids(path, dtype, tokenizer.vocab_size, "the tokenizer's")
    train = TokenFile(files["train"], dtype)
    held_out = TokenFile(files["eval"], dtype)
    record = {
        "source": source,
        "path": os.path.abspath(directory),
        "meta_sha256": (meta.get("sha256") or {}).get("all"),
        "format": meta.get("format"),
        "dtype": dtype,
        "tokenizer": (meta.get("tokenizer") or {}).get("kind"),
        "tokenizer_sha256": sha256_file(os.path.join(directory, "tokenizer.json")),
        "vocab_size": tokenizer.vocab_size,
        "train_tokens": (meta.get("train") or {}).get("tokens"),
        "eval_tokens": (meta.get("eval") or {}).get("tokens"),
    }
    return DataSource(train, held_out, tokenizer, record)


def check_vocab(model_config: DeepSeekV3Config, data: DataSource) -> None:
    """Raises ValueError when the model's vocabulary is smaller than the data's tokenizer's."""
    if data.vocab_size is not None and model_config.vocab_size < data.vocab_size:
        raise ValueError(
            f"the model's vocabulary (DeepSeekV3Config.vocab_size = {model_config.vocab_size}) "
            f"is smaller than the tokenizer's ({data.vocab_size}) of the data "
            f"{data.record.get('path', data.record['source'])}: set model.vocab_size >= "
            f"{data.vocab_size}, or leave it unset for the command to take the tokenizer's"
        )


def fit_vocab(model_config: DeepSeekV3Config, data: DataSource, *, given: bool) -> DeepSeekV3Config:
    """`model_config` with the tokenizer's vocabulary size, unless the user `given` one (then
    only checked by `check_vocab`) or the data has no tokenizer."""
    if not given and data.vocab_size is not None:
        model_config = dataclasses.replace(model_config, vocab_size=data.vocab_size)
    check_vocab(model_config, data)
    return model_config
