"""The copies inside the while loops of a compiled capacity fwd+bwd (CPU, per_trip=4): prints each
computation that has a copy and its copies (only scalars and small index arrays here; no copy of
the [rows out] carry). Writes cap.hlo to the working directory.

    python docs/bench_logs/cpu-2026-12-06-s29/hlo_copies_probe.py
"""
import jax, jax.numpy as jnp, re
from dropless.backends.jnp import capacity_grouped_matmul
rows, E, I, O = 4096, 16, 256, 512
lhs = jnp.ones((rows, I)); rhs = jnp.ones((E, I, O)); gs = jnp.full((E,), rows // E, jnp.int32)
f = jax.jit(jax.grad(lambda a, b, g: capacity_grouped_matmul(a, b, g, 320, 256, 4).sum(), argnums=(0, 1)))
txt = f.lower(lhs, rhs, gs).compile().as_text()
open("cap.hlo", "w").write(txt)
comps = re.split(r"\n(?=\S.*\{\n)", txt)
for c in comps:
    head = c.split("\n", 1)[0]
    copies = [l.strip()[:160] for l in c.split("\n") if re.search(r"= \S+ copy\(", l)]
    if copies:
        print(head[:100]); [print("   ", x) for x in copies]
