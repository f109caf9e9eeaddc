"""`TrainConfig`: every setting of a training run that is not the model's architecture."""

import dataclasses
import math
from typing import Literal

from dropless._balance_loss import BALANCE_LOSSES, AbstractBalanceLoss
from dropless._field_types import field_type_error
from dropless.sharding._mesh import parse_mesh

# A bf16 moment m moves by (1 - beta) * (x - m) a step, and a move below half an ulp (2**-9
# to 2**-8 of m) rounds away. With zero gradients that is a decay by (1 - beta) * m: at
# beta = 0.999 a bf16 second moment never shrinks. With unit Gaussian gradients over 3000
# steps a bf16 second moment ends about 4.5% high at beta = 0.99 and within 1% at 0.98
# (tests/train/step/test_optim.py), hence the bound.
MAX_BF16_BETA = 0.98


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Settings of a training run (optimiser, data, losses, checkpoints, logging).

    The defaults train the `tiny` preset on the stdlib corpus (real text, byte-level; the
    `dropless` command gives the model the tokenizer's 258 symbols) on a 2-core CPU in about two
    minutes: 500 steps, cross-entropy from 5.9 to about 1.7 nats per byte (uniform is 5.55),
    enough for the sample the command prints to look like Python. `data="synthetic"` is the
    built-in Markov corpus (cross-entropy to about 1.4 nats in 200 steps; uniform is 6.2).
    """

    # --- length and batch ---
    steps: int = 500
    """Optimiser steps in total (a resumed run continues up to this number)."""
    batch_size: int = 16
    """Sequences per batch."""
    seq_len: int = 64
    """Tokens per sequence (at most the model's `max_position_embeddings`)."""
    micro_batches: int = 1
    """Gradient accumulation: compute each step's gradient in this many passes over equal slices
    of the batch (it must divide `batch_size`; on a mesh, each slice must divide over the batch
    shards), for batches too large for one pass; evaluation runs in the same slices. The same
    step as one pass, except that the batch-wise balance loss is taken per slice."""
    mesh: str | None = None
    """Device mesh to train on, e.g. 'data=2,expert=4' (axes data, fsdp, expert; their product
    must equal the device count; axes left out have size 1). Parameters and optimiser state are
    sharded over it and each batch split over its devices; expert > 1 switches the MoE layers to
    the expert-parallel 'ep' dispatcher (the other MoE stages stay the backend's). None (default):
    one device."""
    offload_optimizer: bool = False
    """Keep Adam's moments in pinned host memory between steps; each step moves them to the
    device for the update and back (less device memory, more host-device traffic)."""
    seed: int = 0
    """Seed of the parameter initialisation and of the batch stream (batches depend only on
    (seed, step), so a resumed run sees the same data)."""

    # --- optimiser: AdamW, linear warmup then cosine decay, global-norm clipping ---
    lr: float = 3e-3
    """Peak learning rate, reached at the end of warmup."""
    warmup_steps: int = 20
    """Steps of linear warmup from 0 to `lr` (when > 0, step 0's rate is 0: that step moves
    AdamW's moments and the expert bias, not the weights)."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine decay, as a fraction of `lr` (reached at `steps`, so
    the last step runs just above it)."""
    weight_decay: float = 0.1
    """Decoupled weight decay, on matrices only (never norms, biases or other 1-D parameters)."""
    b1: float = 0.9
    """AdamW first-moment decay."""
    b2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip gradients to this global norm (0 turns clipping off)."""
    max_update_ratio: float = 1.0
    """Stop the run (before saving) at a step whose update's norm exceeds this multiple of the
    parameters' norm (0: no bound); see `dropless.train.loop._guard`."""
    moments_dtype: Literal["float32", "bfloat16"] = "float32"
    """Storage of AdamW's two moments (always computed in float32). DeepSeek-V3 keeps them in
    bf16: 4 bytes less per parameter, read and written each step. Needs b1, b2 <= 0.98 (see
    `dropless.train._config.MAX_BF16_BETA`)."""
    weight_dtype: Literal["float32", "bfloat16"] = "float32"
    """Storage of the weights that the step computes with. "bfloat16" (DeepSeek-V3's setting)
    keeps the trainable arrays in bf16 in the model (read by the forward and backward, the
    gradients come in bf16, FSDP moves bf16) and float32 master weights beside them, which the
    optimiser updates; each step's weights are the master weights rounded. Needs the model's
    `param_dtype` float32."""
    grad_accum_dtype: Literal["float32", "bfloat16"] = "float32"
    """Storage of the running sum of gradients over `micro_batches` ("bfloat16": half the
    memory of a float32 sum; with bf16 weights the gradients are bf16 already)."""

    # --- losses ---
    mtp_loss_weight: float = 0.3
    """Weight of the multi-token-prediction loss (mean over MTP depths; DeepSeek-V3 uses 0.3,
    then 0.1). Ignored when the model has no MTP modules."""
    balance_loss_coef: float = 0.0
    """Batch-wise (Switch-Transformer) load-balancing loss coefficient, summed over MoE layers,
    per micro-batch (`dropless.BatchBalanceLoss`; the balance losses as values:
    `balance_losses()`)."""
    seq_balance_loss_coef: float = 1e-4
    """DeepSeek-V3's sequence-wise balance loss coefficient (its alpha; 1e-4 there;
    `SequenceBalanceLoss`)."""
    global_balance_loss_coef: float = 0.0
    """Global-batch balance loss coefficient (Qwen's; `GlobalBatchBalanceLoss`): the batch-wise
    loss with the load fractions of the whole step's batch, gathered over data shards and
    micro-batches, so it equals the single-device loss over the whole batch. With
    micro-batches > 1 a non-zero coefficient costs one more forward pass per step (the loads
    are needed before the first slice's gradient); at 0 that pass is skipped and the term
    reads 0."""
    z_loss_coef: float = 0.0
    """Router z-loss coefficient (ST-MoE), summed over MoE layers."""
    bias_update_rate: float = 1e-3
    """Aux-loss-free balancing: step size of the expert-bias update (DeepSeek-V3's gamma).
    Applied after the optimiser, outside the gradient; 0 turns it off. Only routers with an
    `expert_bias` (the model's `topk_method="noaux_tc"`) are affected."""

    # --- data ---
    data: str = "stdlib"
    """'stdlib' (real text: the Python standard library's source and docs, byte-level, prepared
    on first use into ~/.cache/dropless), 'synthetic' (a built-in Markov corpus of known
    structure), a directory made by `dropless prepare` (its tokenizer's vocabulary size becomes
    the model's unless given), or a flat token file (.bin)."""
    data_dtype: Literal["uint16", "uint32"] = "uint16"
    """Element type of a flat token file (a prepared directory's meta.json names its own)."""
    eval_data: str | None = None
    """Token file of held-out data for a flat token file; without it the last `eval_fraction`
    of `data` is held out (a prepared directory has eval.bin, the synthetic corpus its own
    held-out stream)."""
    eval_fraction: float = 0.05
    """Fraction of a flat token file held out for evaluation when `eval_data` is not given."""
    n_languages: int = 4
    """Synthetic corpus: number of random 'languages' (Markov chains) mixed together."""
    corpus_seed: int = 0
    """Synthetic corpus: seed of the languages themselves (fixed across training seeds)."""

    # --- evaluation, checkpoints, logging ---
    eval_every: int = 50
    """Evaluate on held-out data every this many steps, and at the end (0: only at the end)."""
    eval_batches: int = 4
    """Held-out batches per evaluation (always the same batches)."""
    checkpoint_every: int = 100
    """Save a checkpoint every this many steps, and always at the end (0: only at the end)."""
    keep_checkpoints: int = 3
    """How many of the most recent checkpoints to keep."""
    resume: bool = False
    """Resume from the latest checkpoint in `<out-dir>/checkpoints` (an error if there is none);
    a corrupt, empty or half-written one is passed over, with a warning, for the newest intact
    one."""
    resume_step: int | None = None
    """With `resume`: the checkpoint step to resume from (None: the newest intact one). The
    checkpoints after it are moved to `<out-dir>/checkpoints-set-aside/`."""
    allow_data_change: bool = False
    """With `resume`: continue on data other than the run's (prepared again, or another
    folder) with the same tokenizer; a different tokenizer or vocabulary is always refused."""
    log_every: int = 1
    """Write a metrics line every this many steps."""
    dead_expert_steps: int = 100
    """Each training record's `dead_experts` counts the experts (over every MoE layer) that no
    token chose in the last this many steps (fewer at the start of a run, or of a resumed
    one); the expert-load plot shows it against step."""
    plots: bool = True
    """Write PNG plots (loss, expert load) at the end."""
    tensorboard: bool = False
    """Also write TensorBoard event files (needs `pip install tensorboardX`)."""

    def balance_losses(self) -> tuple[AbstractBalanceLoss, ...]:
        """The balance losses this run adds, as values with their coefficients (those of
        `dropless.BALANCE_LOSSES` whose `<term>_coef` is not 0)."""
        chosen = (kind(coef=getattr(self, f"{kind.term}_coef")) for kind in BALANCE_LOSSES)
        return tuple(loss for loss in chosen if loss.coef)

    def with_balance_losses(self, *losses: AbstractBalanceLoss) -> "TrainConfig":
        """This config adding exactly `losses` (each at its `coef`; the others at 0), e.g.
        `config.with_balance_losses(GlobalBatchBalanceLoss(1e-2))`."""
        kinds = [type(loss) for loss in losses]
        unknown = [k.__name__ for k in kinds if k not in BALANCE_LOSSES]
        if unknown or len(set(kinds)) < len(kinds):
            raise ValueError(
                f"TrainConfig.with_balance_losses: each of {[k.__name__ for k in BALANCE_LOSSES]} "
                f"at most once, got {[k.__name__ for k in kinds]}"
            )
        coefs = {f"{kind.term}_coef": 0.0 for kind in BALANCE_LOSSES}
        coefs.update({f"{loss.term}_coef": float(loss.coef) for loss in losses})
        return dataclasses.replace(self, **coefs)

    def __post_init__(self):
        wrong_type = field_type_error(self)
        if wrong_type:
            raise ValueError(f"TrainConfig.{wrong_type}")
        self._check_signs()
        self._check_ranges()
        self._check_choices()

    def _check_signs(self):
        """Raises unless every float is finite and the counts and weights are >= 1 or >= 0."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"TrainConfig.{field.name} must be finite, got {value}")
        positive = (
            "steps",
            "batch_size",
            "seq_len",
            "micro_batches",
            "eval_batches",
            "keep_checkpoints",
            "dead_expert_steps",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        non_negative = (
            "warmup_steps",
            "weight_decay",
            "grad_clip",
            "max_update_ratio",
            "mtp_loss_weight",
            "balance_loss_coef",
            "seq_balance_loss_coef",
            "global_balance_loss_coef",
            "z_loss_coef",
            "bias_update_rate",
            "eval_every",
            "checkpoint_every",
            "seed",
            "corpus_seed",
        )
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")

    def _check_ranges(self):
        """Raises unless the numbers with a range of their own are in it."""
        if self.batch_size % self.micro_batches:
            raise ValueError(
                f"TrainConfig.micro_batches ({self.micro_batches}) must divide batch_size "
                f"({self.batch_size})"
            )
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr}")
        for name in ("b1", "b2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be in [0, 1), got {getattr(self, name)}")
        if not self.eps > 0:
            raise ValueError(
                f"TrainConfig.eps must be > 0 (a parameter with zero gradients would get 0/0), "
                f"got {self.eps}"
            )
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"TrainConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0 < self.eval_fraction < 1:
            raise ValueError(
                f"TrainConfig.eval_fraction must be in (0, 1), got {self.eval_fraction}"
            )
        if self.resume_step is not None and self.resume_step < 1:
            raise ValueError(f"TrainConfig.resume_step must be >= 1, got {self.resume_step}")
        if self.log_every < 1:
            raise ValueError(f"TrainConfig.log_every must be >= 1, got {self.log_every}")
        if self.n_languages < 1:
            raise ValueError(f"TrainConfig.n_languages must be >= 1, got {self.n_languages}")

    def _check_choices(self):
        """Raises unless the mesh parses and every dtype is one of its choices."""
        if self.mesh is not None:
            try:
                parse_mesh(self.mesh)
            except ValueError as err:
                raise ValueError(f"TrainConfig.mesh: {err}") from None
        if self.moments_dtype not in ("float32", "bfloat16"):
            raise ValueError(
                "TrainConfig.moments_dtype must be 'float32' or 'bfloat16', got "
                f"{self.moments_dtype!r}"
            )
        if self.moments_dtype == "bfloat16":
            for name in ("b1", "b2"):
                if getattr(self, name) > MAX_BF16_BETA:
                    raise ValueError(
                        f"TrainConfig.{name}={getattr(self, name)} must be <= {MAX_BF16_BETA} "
                        "with moments_dtype='bfloat16': a bf16 moment's steps of (1 - beta) "
                        "times its distance to the new value round away below half an ulp, "
                        "which biases it (see dropless.train._config.MAX_BF16_BETA)"
                    )
        for name in ("weight_dtype", "grad_accum_dtype"):
            if getattr(self, name) not in ("float32", "bfloat16"):
                raise ValueError(
                    f"TrainConfig.{name} must be 'float32' or 'bfloat16', got "
                    f"{getattr(self, name)!r}"
                )
        if self.data_dtype not in ("uint16", "uint32"):
            raise ValueError(
                f"TrainConfig.data_dtype must be 'uint16' or 'uint32', got {self.data_dtype!r}"
            )
