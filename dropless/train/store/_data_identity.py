"""The identity of a run's data, compared when a run continues: `--resume`, `eval`, `generate`.

A run records what it read (`DataSource.record`: the tokenizer's SHA-256 and vocabulary size,
meta.json's hash, the path, the sizes) in config.yaml and in every checkpoint. Token ids mean
text only through their tokenizer, so a different tokenizer or vocabulary is always refused.
Other data with the same tokenizer (a corpus prepared again, another folder) is refused too,
unless the switch is deliberate (`TrainConfig.allow_data_change`, `--allow-data-change`).
"""

# What identifies the token ids' meaning, and what identifies the text behind them.
TOKENIZER_KEYS = ("tokenizer_sha256", "vocab_size")
DATA_KEYS = ("source", "path", "meta_sha256", "dtype", "n_languages", "corpus_seed", "eval_path")


class DataMismatch(ValueError):
    """Data whose tokenizer, vocabulary or contents differ from what a run was trained on."""


def _differences(saved: dict, now: dict, keys: tuple[str, ...]) -> list[str]:
    return [
        f"{k}: {saved[k]!r} -> {now.get(k)!r}"
        for k in keys
        if k in saved and saved[k] != now.get(k)
    ]


def tokenizer_changes(saved: dict | None, now: dict) -> list[str]:
    """'key: saved -> now' for each way the token ids' meaning differs (none for a record from
    before these keys, which cannot say)."""
    return [] if not saved else _differences(saved, now, TOKENIZER_KEYS)


def data_changes(saved: dict | None, now: dict) -> list[str]:
    """'key: saved -> now' for each way the data differs, tokenizer aside. Prepared data is
    known by its meta.json's hash wherever it lies; a bare token file by its path."""
    if not saved:
        return []
    keys = DATA_KEYS
    if saved.get("meta_sha256") is not None:
        keys = tuple(k for k in keys if k != "path")
    return _differences(saved, now, keys)


def check_resume_data(saved: dict | None, now: dict, *, allow_change: bool) -> list[str]:
    """DataMismatch when a run trained on `saved` (its data record) would continue on `now`
    with another tokenizer, or on other data without `allow_change`; returns the data changes
    allowed (for a note)."""
    changed = tokenizer_changes(saved, now)
    if changed:
        raise DataMismatch(
            "cannot resume: the data's tokenizer differs from the one the run was trained with "
            f"({', '.join(changed)}); its token ids mean other text to this model. Train a new "
            "run on it, or resume on the run's own data"
        )
    changed = data_changes(saved, now)
    if changed and not allow_change:
        raise DataMismatch(
            f"cannot resume: the data differs from the run's ({', '.join(changed)}); pass "
            "--allow-data-change (TrainConfig.allow_data_change) to continue on it with the "
            "same tokenizer"
        )
    return changed
