"""Real text for training: tokenizers, `prepare` (text to token files) and the default corpus.

from dropless.data import prepare, load_tokenizer

meta = prepare(["notes/", "more.jsonl"], "data/notes", tokenizer="bpe", vocab_size=4096)
tok = load_tokenizer("data/notes")
"""

from dropless.data._cli import main
from dropless.data._corpus import default_corpus_dir
from dropless.data._prepare import prepare, prepare_documents
from dropless.data._sources import FOLDER_EXTENSIONS, Document
from dropless.data._tokenizer import (
    AbstractTokenizer,
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
    token_dtype,
    train_bpe,
)

__all__ = [
    "FOLDER_EXTENSIONS",
    "AbstractTokenizer",
    "ByteTokenizer",
    "Document",
    "HFTokenizer",
    "default_corpus_dir",
    "load_tokenizer",
    "main",
    "prepare",
    "prepare_documents",
    "token_dtype",
    "train_bpe",
]
