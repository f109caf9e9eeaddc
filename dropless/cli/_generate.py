"""`dropless generate RUN_DIR --prompt TEXT` (or `--hf PATH`): what a model writes after a
prompt, decoded with its tokenizer (a trained run's data tokenizer, or the tokenizer.json
beside a Hugging Face checkpoint). A model without a tokenizer (a run on the synthetic corpus)
takes `--prompt-ids` and prints ids. Ids that the tokenizer lacks (a model vocabulary larger
than the tokenizer's) print as nothing."""

import dataclasses
import sys
from pathlib import Path
from typing import Annotated

import jax
import numpy as np
import tyro

from dropless.data._tokenizer import AbstractTokenizer, load_tokenizer
from dropless.models.deepseek_v3 import DeepSeekV3, from_pretrained, generate
from dropless.models.deepseek_v3._routing_file import save_routing
from dropless.train.store._layout import TOKENIZER_FILE
from dropless.train.store._run_dir import load_run


@dataclasses.dataclass(frozen=True)
class GenerateCommand:
    """Text from a trained run, or from a Hugging Face checkpoint, after a prompt."""

    run_dir: Annotated[tyro.conf.Positional[str | None], tyro.conf.arg(metavar="RUN_DIR")] = None
    """A run's --out-dir (or give --hf)."""
    hf: str | None = None
    """A Hugging Face checkpoint directory instead of a run."""
    prompt: str | None = None
    """The text to continue."""
    prompt_ids: str | None = None
    """The prompt as comma-separated token ids, 1,2,3 (a run with no tokenizer)."""
    max_new_tokens: int = 200
    """Tokens to write after the prompt."""
    temperature: float = 0.8
    """Sampling temperature; 0: greedy."""
    top_k: int | None = None
    """Sample from the K likeliest tokens only."""
    top_p: float | None = None
    """Nucleus sampling: from the likeliest tokens holding this probability mass."""
    seed: int = 0
    """The same seed, the same text."""
    step: int | None = None
    """The run's checkpoint (default: the latest)."""
    num_samples: int = 1
    """Samples to draw."""
    record_routing: str | None = None
    """Also write every sample's tokens with the expert choice each MoE layer made for them
    to this .npz file (routing replay: `dropless eval RUN_DIR --replay-routing FILE`, or
    `load_routing` and `model(tokens[:, :-1], replay=...)` in Python)."""


def _model(args) -> tuple[DeepSeekV3, AbstractTokenizer | None, bool]:
    """(model, tokenizer, whether prompts start with the bos token) of the run or checkpoint."""
    if (args.run_dir is None) == (args.hf is None):
        raise ValueError("give a RUN_DIR or --hf PATH (one of them)")
    if args.hf is None:
        run = load_run(args.run_dir, args.step)
        # a run's documents start without a bos token: its prompts do too
        return run.model, run.tokenizer, False
    if args.step is not None:
        raise ValueError("--step is for a run's checkpoints, not --hf")
    model, _ = from_pretrained(args.hf, mtp=False)
    tokenizer_file = Path(args.hf) / TOKENIZER_FILE
    tokenizer = load_tokenizer(tokenizer_file) if tokenizer_file.is_file() else None
    return model, tokenizer, True


def _prompt(args, tokenizer: AbstractTokenizer | None, bos: bool) -> np.ndarray:
    if (args.prompt is None) == (args.prompt_ids is None):
        raise ValueError("give --prompt TEXT or --prompt-ids 1,2,3 (one of them)")
    if args.prompt_ids is not None:
        try:
            ids = np.asarray([int(i) for i in args.prompt_ids.split(",") if i.strip()], np.int32)
        except ValueError:
            raise ValueError(
                f"--prompt-ids {args.prompt_ids!r}: expected comma-separated integers"
            ) from None
        return ids
    if tokenizer is None:
        raise ValueError(
            "--prompt needs a tokenizer, and this model has none (a run on the synthetic corpus, "
            "or no tokenizer.json beside the checkpoint): give --prompt-ids 1,2,3"
        )
    ids = tokenizer.encode(args.prompt)
    if bos and tokenizer.bos_id is not None:
        ids = np.concatenate([[tokenizer.bos_id], ids]).astype(np.int32)
    return ids


def run(args: GenerateCommand) -> int:
    """Generates as `args` say and prints each sample (text, or ids without a tokenizer)."""
    if args.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
    for flag, value in (("--prompt", args.prompt), ("--prompt-ids", args.prompt_ids)):
        if value is not None and not value.replace(",", "").strip():
            raise ValueError(f"{flag} is empty: give the text to continue")
    model, tokenizer, bos = _model(args)
    prompt = _prompt(args, tokenizer, bos)
    eos = None if tokenizer is None else tokenizer.eos_id
    record = args.record_routing is not None
    if record and model.moe_layers is None:
        raise ValueError("--record-routing: the model has no MoE layers, so no routing")
    if record and args.max_new_tokens < 1:
        raise ValueError("--record-routing needs --max-new-tokens >= 1")
    out = generate(
        model,
        np.tile(prompt, (args.num_samples, 1)),
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        key=jax.random.key(args.seed),
        eos_id=eos,
        return_routing=record,
    )
    if record:
        out, routing = out
        save_routing(args.record_routing, np.asarray(out), routing)
    for i, row in enumerate(np.asarray(out)):
        if args.num_samples > 1:
            print(f"--- sample {i + 1} ---")
        new = row[len(prompt) :]
        if eos is not None and (new == eos).any():
            new = new[: int(np.argmax(new == eos))]  # what follows the first eos is eos only
        if tokenizer is None:
            print(",".join(str(int(t)) for t in row[: len(prompt) + len(new)]))
        else:
            shown = args.prompt if args.prompt is not None else tokenizer.decode(prompt)
            # ids past the tokenizer's (a model vocabulary padded beyond it) stand for no text
            print(shown + tokenizer.decode(new[new < tokenizer.vocab_size]))
    if record:
        print(f"routing of {args.num_samples} sample(s) recorded in {args.record_routing}",
              file=sys.stderr)  # fmt: skip
    return 0
