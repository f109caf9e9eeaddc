"""A short sample of what a trained model writes: a prompt from the start of the eval split,
continued by `dropless.models.deepseek_v3.generate` and decoded with the data's tokenizer (what
`dropless train` prints at the end)."""

import dataclasses

import jax
import numpy as np

from dropless.data import AbstractTokenizer
from dropless.data._datasets import AbstractDataset, TokenFile
from dropless.models.deepseek_v3 import DeepSeekV3
from dropless.models.deepseek_v3._generate import generate


@dataclasses.dataclass(frozen=True)
class Sample:
    """A prompt and the model's continuation of it, as text."""

    prompt: str
    text: str


def eval_prompt(dataset: AbstractDataset, n_tokens: int) -> np.ndarray | None:
    """The first `n_tokens` of an eval split held in a token file (for a prepared directory's
    eval.bin, the start of a document); None for other datasets."""
    if not isinstance(dataset, TokenFile):
        return None
    tokens = np.asarray(dataset.tokens[dataset.start : dataset.start + n_tokens], np.int32)
    return tokens if len(tokens) else None


def sample(
    model: DeepSeekV3,
    tokenizer: AbstractTokenizer,
    prompt: np.ndarray | str,
    *,
    max_new_tokens: int = 160,
    temperature: float = 0.8,
    seed: int = 0,
) -> Sample:
    """`prompt` (token ids or text) continued by `max_new_tokens` tokens sampled at
    `temperature` with `seed`, up to the tokenizer's eos; the same seed gives the same text."""
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else np.asarray(prompt, np.int32)
    limit = model.config.max_position_embeddings
    ids = ids[: max(1, limit - max_new_tokens)]
    max_new_tokens = min(max_new_tokens, limit - len(ids))
    out = generate(
        model,
        ids[None],
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        key=jax.random.key(seed),
        eos_id=tokenizer.eos_id,
    )
    new = np.asarray(out[0, len(ids) :])
    if tokenizer.eos_id is not None and (new == tokenizer.eos_id).any():
        new = new[: int(np.argmax(new == tokenizer.eos_id))]
    return Sample(
        prompt=tokenizer.decode(ids, skip_special_tokens=True),
        text=tokenizer.decode(new, skip_special_tokens=True),
    )
