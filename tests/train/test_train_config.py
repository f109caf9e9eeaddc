"""TrainConfig's validation: each bad value names its field and the rule."""

import dataclasses
import math

import pytest

from dropless.train import TrainConfig


def validate(**values) -> None:
    """TrainConfig's checks on the defaults with `values` set past the constructor: the tests'
    runtime type checks would reject a wrongly typed value first, where a user's YAML or
    `--set` value reaches the checks."""
    config = TrainConfig()
    for name, value in values.items():
        object.__setattr__(config, name, value)
    config.__post_init__()


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"steps": 2.0}, "TrainConfig.steps (2.0) must be an int"),
        ({"batch_size": True}, "TrainConfig.batch_size (True) must be an int"),
        ({"plots": "yes"}, "TrainConfig.plots ('yes') must be True or False"),
        ({"steps": 0}, "TrainConfig.steps must be >= 1, got 0"),
        ({"seed": -1}, "TrainConfig.seed must be >= 0, got -1"),
        ({"corpus_seed": -2}, "TrainConfig.corpus_seed must be >= 0, got -2"),
        ({"b1": 1.0}, "TrainConfig.b1 must be in [0, 1), got 1.0"),
        ({"b2": -0.5}, "TrainConfig.b2 must be in [0, 1), got -0.5"),
        ({"eps": 0.0}, "TrainConfig.eps must be > 0"),
        ({"lr": 0.0}, "TrainConfig.lr must be > 0, got 0.0"),
        *[
            ({name: 0}, f"TrainConfig.{name} must be >= 1, got 0")
            for name in ("seq_len", "micro_batches", "eval_batches", "keep_checkpoints")
        ],
        *[
            ({name: -1}, f"TrainConfig.{name} must be >= 0, got -1")
            for name in (
                "warmup_steps",
                "weight_decay",
                "grad_clip",
                "mtp_loss_weight",
                "balance_loss_coef",
                "seq_balance_loss_coef",
                "z_loss_coef",
                "bias_update_rate",
                "eval_every",
                "checkpoint_every",
            )
        ],  # fmt: skip
        ({"min_lr_ratio": 1.5}, "TrainConfig.min_lr_ratio must be in [0, 1], got 1.5"),
        ({"eval_fraction": 1.0}, "TrainConfig.eval_fraction must be in (0, 1), got 1.0"),
        ({"log_every": 0}, "TrainConfig.log_every must be >= 1, got 0"),
        ({"n_languages": 0}, "TrainConfig.n_languages must be >= 1, got 0"),
        ({"mesh": "data=2,bogus"}, "TrainConfig.mesh: "),
        ({"moments_dtype": "float16"}, "TrainConfig.moments_dtype must be 'float32' or"),
        ({"weight_dtype": "float16"}, "TrainConfig.weight_dtype must be 'float32' or"),
        ({"grad_accum_dtype": "int8"}, "TrainConfig.grad_accum_dtype must be 'float32' or"),
        ({"data_dtype": "int8"}, "TrainConfig.data_dtype must be 'uint16' or 'uint32'"),
    ],
)
def test_bad_values_name_the_field_and_the_rule(changes, message):
    with pytest.raises(ValueError) as err:
        validate(**changes)
    assert str(err.value).startswith(message)


def test_the_defaults_and_edge_values_are_accepted():
    validate()
    validate(b1=0.0, b2=0.0, seed=0, lr=1, eps=1e-30, mesh=None)  # an int for a float field
    assert dataclasses.replace(TrainConfig(), b1=0.5).b1 == 0.5


@pytest.mark.parametrize("field, value", [("lr", math.inf), ("weight_decay", math.nan),
                                          ("grad_clip", math.inf), ("eps", math.nan)])  # fmt: skip
def test_non_finite_numbers_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"TrainConfig\.{field} must be finite, got {value}"):
        TrainConfig(**{field: value})
