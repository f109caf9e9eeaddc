"""Evaluation with recorded routing (routing replay): the expert choice of the sequences an
evaluation scores, recorded (`record_routing`, `dropless eval --record-routing FILE`), and
recorded sequences scored with the choice they were recorded with
(`evaluate_replay`, `dropless eval --replay-routing FILE`; `dropless generate
--record-routing` records its samples). The file's format: `dropless.models.deepseek_v3.
routing_file`.

A replayed evaluation reports the cross-entropy under the recorded routing (`ce`) beside the
model's own (`ce_own_routing`), and how much of the recorded choice the model would make again
(`routing_agreement`): after training moved the routers, how far sampling-time routing and
today's differ, and what that costs.
"""

import math
import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from dropless.models.deepseek_v3 import DeepSeekV3, recorded_routing
from dropless.models.deepseek_v3._model import RoutingReplay
from dropless.models.deepseek_v3._routing_file import load_routing
from dropless.train.loop._run_eval import count_bytes
from dropless.train.step._cross_entropy import cross_entropy
from dropless.train.store._run_dir import LoadedRun

REPLAY_SPLIT = "eval_replay"  # the `split` of the records a replayed evaluation appends


@eqx.filter_jit
def _routing(model: DeepSeekV3, tokens: Int[Array, "batch window"]) -> RoutingReplay:
    return recorded_routing(model(tokens[:, :-1], return_routing=True))


def record_routing(
    model: DeepSeekV3, windows: list[Int[np.ndarray, "batch window"]]
) -> tuple[Int[np.ndarray, "rows window"], RoutingReplay]:
    """(the windows stacked, every MoE layer's expert choice for their inputs
    `windows[:, :-1]`): what `save_routing` writes. Raises ValueError for a model without
    MoE layers."""
    if model.moe_layers is None:
        raise ValueError("the model has no MoE layers: there is no routing to record")
    parts = [_routing(model, jnp.asarray(w)) for w in windows]
    main = jnp.concatenate([p[0] for p in parts], axis=1)
    mtp = None if parts[0][1] is None else jnp.concatenate([p[1] for p in parts], axis=1)
    return np.concatenate(windows), (main, mtp)


@eqx.filter_jit
def _scores(
    model: DeepSeekV3, tokens: Int[Array, "batch window"], replay: RoutingReplay
) -> tuple[Float[Array, ""], Float[Array, ""], Float[Array, ""]]:
    """(cross-entropy replayed, cross-entropy with the model's own routing, the share of the
    recorded (token, layer) choices that the model's own top-k holds too)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    replayed = model(inputs, replay=replay)
    own = model(inputs, return_routing=True)
    ids = own.moe_stats.expert_ids
    agree = (ids[..., :, None] == replay[0][..., None, :]).any(-1).mean()
    return cross_entropy(replayed.logits, targets), cross_entropy(own.logits, targets), agree


def _rows(replay_part, rows: slice, batch: int):
    if replay_part is None:
        return None
    layers, _, k = replay_part.shape
    return jnp.asarray(replay_part.reshape(layers, batch, -1, k)[:, rows].reshape(layers, -1, k))


def evaluate_replay(
    run: LoadedRun, path: str | os.PathLike, *, batch_size: int | None = None
) -> dict:
    """Cross-entropy, perplexity (and bits per byte, with a tokenizer) of `run.model` on the
    sequences in the routing file `path`, every MoE layer routing each token to the experts
    recorded there, in batches of `batch_size` sequences (default: the run's); beside them the
    cross-entropy under the model's own routing and the routing agreement."""
    tokens, (main, mtp) = load_routing(path, run.model_config)
    size = run.train_config.batch_size if batch_size is None else batch_size
    if size < 1:
        raise ValueError(f"batch size must be >= 1, got {size}")
    batch = tokens.shape[0]
    sums = np.zeros(3)
    for start in range(0, batch, size):
        rows = slice(start, min(start + size, batch))
        replay = (_rows(main, rows, batch), _rows(mtp, rows, batch))
        part = _scores(run.model, jnp.asarray(tokens[rows]), replay)
        sums += np.asarray(jax.device_get(part), np.float64) * (rows.stop - rows.start)
    ce, ce_own, agreement = sums / batch
    targets = tokens[:, 1:]
    n_bytes = None if run.tokenizer is None else count_bytes(run.tokenizer, targets)
    return {
        "step": run.step,
        "routing": str(path),
        "sequences": int(batch),
        "tokens": int(targets.size),
        "bytes": n_bytes,
        "ce": float(ce),
        "perplexity": math.exp(ce),
        "bits_per_byte": ce * targets.size / math.log(2) / n_bytes if n_bytes else None,
        "ce_own_routing": float(ce_own),
        "routing_agreement": float(agreement),
    }
