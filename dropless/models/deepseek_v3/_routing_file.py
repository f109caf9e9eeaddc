"""Recorded routing on disk: token sequences with the expert choice every MoE layer made for
them (`generate(..., return_routing=True)`, `dropless generate --record-routing`, `dropless
eval --record-routing`), for a later forward to replay (`model(tokens[:, :-1], replay=...)`,
`dropless eval --replay-routing`).

One `.npz` file: `tokens [batch seq]` (int32), `main [layers batch*(seq-1) k]` (the main MoE
layers' choice for the inputs `tokens[:, :-1]`, token `b * (seq - 1) + i` being
`tokens[b, i]`) and, when recorded, `mtp [depth batch*(seq-1) k]`.
"""

import os

import jax
import numpy as np
from jaxtyping import Int

from dropless.models.deepseek_v3._config import DeepSeekV3Config

Ids = Int[np.ndarray | jax.Array, "layers tokens k"]
HostReplay = tuple[Int[np.ndarray, "layers tokens k"], Int[np.ndarray, "depth tokens k"] | None]


def save_routing(
    path: str | os.PathLike,
    tokens: Int[np.ndarray | jax.Array, "batch seq"],
    replay: tuple[Ids, Ids | None],
) -> None:
    """Writes `tokens` and their recorded `replay` to `path` (exactly that name)."""
    tokens = np.asarray(tokens, np.int32)
    main, mtp = replay
    arrays = {"tokens": tokens, "main": np.asarray(main, np.int32)}
    if mtp is not None:
        arrays["mtp"] = np.asarray(mtp, np.int32)
    _check(arrays, str(path))
    with open(path, "wb") as f:
        np.savez(f, **arrays)


def load_routing(
    path: str | os.PathLike, config: DeepSeekV3Config | None = None
) -> tuple[Int[np.ndarray, "batch seq"], HostReplay]:
    """(tokens, replay) from a file `save_routing` wrote; with `config`, checked to fit its
    model (MoE layers, experts per token, expert ids). A bad file is one ValueError naming it."""
    try:
        with np.load(path) as data:
            arrays = {name: np.asarray(data[name]) for name in data.files}
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a routing file ({err})") from None
    _check(arrays, str(path))
    if config is not None:
        _fits(arrays, config, str(path))
    return arrays["tokens"], (arrays["main"], arrays.get("mtp"))


def _check(arrays: dict, where: str) -> None:
    missing = {"tokens", "main"} - set(arrays)
    if missing:
        raise ValueError(
            f"{where}: a routing file holds tokens and main, missing {sorted(missing)}"
        )
    tokens = arrays["tokens"]
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"{where}: tokens must be [batch seq] with seq >= 2, got {tokens.shape}")
    want = tokens.shape[0] * (tokens.shape[1] - 1)
    for name in ("main", "mtp"):
        ids = arrays.get(name)
        if ids is not None and (ids.ndim != 3 or ids.shape[1] != want):
            raise ValueError(
                f"{where}: {name} must be [layers {want} k] (batch * (seq - 1) tokens), got "
                f"{ids.shape}"
            )


def _fits(arrays: dict, config: DeepSeekV3Config, where: str) -> None:
    choices = config.n_routed_experts + config.n_zero_experts
    expected = {
        "main": (config.n_moe_layers, "MoE layers"),
        "mtp": (config.num_nextn_predict_layers, "MTP blocks"),
    }
    for name, (layers, what) in expected.items():
        ids = arrays.get(name)
        if ids is None:
            continue
        if ids.shape[0] != layers:
            raise ValueError(f"{where}: routing of {ids.shape[0]} {what}, the model has {layers}")
        if ids.shape[2] != config.num_experts_per_tok:
            raise ValueError(
                f"{where}: {ids.shape[2]} experts per token, the model routes each to "
                f"{config.num_experts_per_tok}"
            )
        if ids.size and not 0 <= ids.min() <= ids.max() < choices:
            raise ValueError(f"{where}: {name} holds expert ids outside [0, {choices})")
    tokens = arrays["tokens"]
    if not 0 <= tokens.min() <= tokens.max() < config.vocab_size:
        raise ValueError(f"{where}: token ids outside the vocabulary [0, {config.vocab_size})")
