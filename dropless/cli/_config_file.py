"""Run configs from YAML: a `--config` file (sections preset, backend, model, train) and
`--set section.field=value` overrides, checked field by field."""

import dataclasses
import difflib
import os
import typing
from collections.abc import Sequence

import yaml

from dropless.models.deepseek_v3 import DeepSeekV3Config
from dropless.train._config import TrainConfig

# `data` records what a run read (`DataSource.record`) and `stages` the MoE strategies that ran
# (`dropless.train.step._sharded_state.stages`): written into config.yaml, not read back
# (`train.data` and `backend` say what to use).
SECTIONS = ("preset", "backend", "model", "train", "data", "stages")


def parse_yaml(text, where: str):
    """`text` (a string or an open file) parsed as YAML; a syntax error is a ValueError that
    names `where` and the place in the text."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ValueError(f"{where}: not valid YAML ({' '.join(str(err).split())})") from None


def load_yaml_config(path: str) -> dict:
    """A run config file: a mapping with (some of) the sections preset, backend, model, train."""
    if os.path.isdir(path):
        raise ValueError(
            f"--config {path} is a folder, not a YAML file (a run's own is <run>/config.yaml)"
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file not found: {path}")
    with open(path) as f:
        data = parse_yaml(f, path) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping with sections {', '.join(SECTIONS)}")
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ValueError(
            f"{path}: unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}"
        )
    return data


def replace_checked(config, values: object, where: str):
    """`config` with `values` (from YAML) replaced: unknown names are errors, and numbers that
    YAML read as strings (PyYAML reads 1e-3 as a string) become numbers, and "None" (YAML's
    null is `null`) becomes None where a field takes None."""
    if not isinstance(values, dict):
        raise ValueError(f"{where}: must be a mapping of field: value, got {values!r}")
    types = {f.name: f.type for f in dataclasses.fields(config)}
    unknown = sorted(set(values) - set(types))
    if unknown:
        near = {name: difflib.get_close_matches(name, types, n=1) for name in unknown}
        hints = [
            f"{name} (did you mean {near[name][0]}?)" if near[name] else name for name in unknown
        ]
        raise ValueError(
            f"{where}: unknown field(s) {', '.join(hints)}; known: {', '.join(sorted(types))}"
        )
    values = dict(values)
    for name, value in values.items():
        kind = types[name]
        if value == "None" and type(None) in typing.get_args(kind):
            values[name] = None
            continue
        convert = (kind is float and isinstance(value, int | str)) or (
            kind is int and isinstance(value, str)
        )
        if convert and not isinstance(value, bool):
            try:
                values[name] = kind(value)
            except ValueError:
                wanted = "an int" if kind is int else "a number"
                raise ValueError(f"{where}: {name} must be {wanted}, got {value!r}") from None
    if isinstance(config, DeepSeekV3Config):  # its own rules (layer types follow the depth)
        return config.replace(**values)
    return dataclasses.replace(config, **values)


def apply_overrides(
    model: DeepSeekV3Config, train: TrainConfig, overrides: Sequence[str]
) -> tuple[DeepSeekV3Config, TrainConfig]:
    """Applies `section.field=value` overrides (value parsed as YAML) to the two configs."""
    changes: dict[str, dict] = {"model": {}, "train": {}}
    for item in overrides:
        key, sep, raw = item.partition("=")
        section, dot, field = key.strip().partition(".")
        if not sep or not dot or section not in changes:
            raise ValueError(
                f"--set {item!r}: expected model.<field>=<value> or train.<field>=<value>"
            )
        changes[section][field.replace("-", "_")] = parse_yaml(raw, f"--set {item!r}")
    model = replace_checked(model, changes["model"], "--set model")
    train = replace_checked(train, changes["train"], "--set train")
    return model, train
