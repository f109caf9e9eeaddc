"""Which experts each synthetic "language" uses, per MoE layer, after brief training.

    python experiments/expert_specialisation.py [--size tiny|small] [--steps N] [--out DIR]

Trains on the built-in corpus (a mixture of random Markov-chain "languages", one per
sequence), then routes held-out batches layer by layer (calling each MoE layer's router on its
own input) and counts, per language, the share of its routed copies that go to each expert.
A uniform router gives 1/experts everywhere; a specialised one gives bright, language-specific
cells. `specialisation` = mean over experts of max_language share / mean_language share, over
the languages that the held-out batches hold and the experts that they use (1: no language
preference); `top_expert_share` = mean over those languages of their largest expert share.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from _common import (  # noqa: E402
    machine,
    model_config,
    moe_forward,
    moe_layers,
    parser,
    print_table,
    train_config,
    write_results,
)

from dropless import tokens_per_expert  # noqa: E402
from dropless.train import SyntheticCorpus, train  # noqa: E402


@eqx.filter_jit
def counts_per_sequence(model, tokens):
    """[layers batch experts]: routed copies of each sequence to each expert, per MoE layer."""
    _, inputs = moe_forward(model, tokens)
    b = tokens.shape[0]
    out = []
    for moe, h in zip(moe_layers(model), inputs, strict=True):
        ids = moe.router(h).expert_ids.reshape(b, -1)
        n = moe.router.spec.n_routed_experts
        out.append(jax.vmap(lambda i, n=n: tokens_per_expert(i[:, None], n))(ids))
    return jnp.stack(out)


def language_preference(share: np.ndarray, seen: np.ndarray) -> tuple[float, float]:
    """(specialisation, top_expert_share) of one layer's [languages experts] shares, over the
    `seen` languages (a language without sequences has no shares to compare) and the experts
    they use (an expert no language uses has no preference to measure); nan if none."""
    s = share[seen]
    used = s.mean(0) > 0 if len(s) else np.zeros(share.shape[1], bool)
    if not used.any():
        return float("nan"), float("nan")
    return float(np.mean(s.max(0)[used] / s.mean(0)[used])), float(s.max(1).mean())


def main(argv=None) -> list[dict]:
    p = parser("expert_specialisation", __doc__, steps=150)
    p.add_argument("--eval-batches", type=int, default=4)
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    mc = model_config(args)
    tc = train_config(args)
    model = train(mc, tc, backend="jnp", out_dir=str(out / "run")).model
    corpus = SyntheticCorpus(mc.vocab_size, n_languages=tc.n_languages, corpus_seed=tc.corpus_seed)
    n_lang, n_exp = tc.n_languages, mc.n_routed_experts
    usage = np.zeros((mc.n_moe_layers, n_lang, n_exp))
    sequences = np.zeros(n_lang, int)
    for step in range(args.eval_batches):
        batch = corpus.batch(
            step, seed=args.seed, batch_size=args.batch_size, seq_len=args.seq_len, split="eval"
        )
        c = np.asarray(counts_per_sequence(model, jnp.asarray(batch.tokens[:, :-1])))
        for lang in range(n_lang):
            usage[:, lang] += c[:, batch.language == lang].sum(1)
            sequences[lang] += int(np.sum(batch.language == lang))
    share = usage / np.maximum(usage.sum(-1, keepdims=True), 1)  # [layers lang experts]
    rows = []
    for layer in range(mc.n_moe_layers):
        spec, top = language_preference(share[layer], sequences > 0)
        rows.append(
            dict(
                layer=mc.first_k_dense_replace + layer,
                specialisation=spec,
                top_expert_share=top,
                uniform_share=1 / n_exp,
                languages_seen=int(np.sum(sequences > 0)),
                copies=int(usage[layer].sum()),
            )
        )
    meta = dict(
        machine=machine(),
        size=args.size,
        steps=args.steps,
        languages=n_lang,
        sequences_per_language=sequences.tolist(),
    )
    write_results(out, "expert_specialisation", rows, {**meta, "share": share.tolist()})
    n = mc.n_moe_layers
    fig, axes = plt.subplots(
        n, 1, figsize=(max(6, n_exp * 0.4), 1.2 + 1.1 * n * n_lang / 4), squeeze=False
    )
    for layer, ax in enumerate(axes[:, 0]):
        im = ax.imshow(share[layer], aspect="auto", cmap="viridis", vmin=0)
        ax.set(ylabel="language", title=f"layer {mc.first_k_dense_replace + layer}")
        ax.set_yticks(range(n_lang))
        fig.colorbar(im, ax=ax, label="share of copies")
    axes[-1, 0].set_xlabel("expert")
    fig.tight_layout()
    fig.savefig(out / "expert_specialisation.png", dpi=80)
    plt.close(fig)
    print_table(rows, f"expert specialisation ({meta['machine']})")
    return rows


if __name__ == "__main__":
    main()
