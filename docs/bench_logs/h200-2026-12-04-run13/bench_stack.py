"""Ways to build a stacked gradient from per-layer gradients on a GPU, by kernel time (CUPTI):
the proxy-2b expert stacks (18 layers of [64 1024 512] and [64 512 1024], bf16), each part
behind an optimisation barrier as a Pallas kernel's output would be, the stack behind another
as `cast_for_compute` puts it, then read once in float32 as the optimiser's global norm does.
A measurement aid for the thirteenth run, not library code: `python bench_stack.py` from
experiments/."""

import _timing
import jax
import jax.numpy as jnp


def stack_concat(parts):
    return jnp.stack(parts)


def stack_flat(parts):
    flat = jnp.concatenate([p.reshape(-1) for p in parts])
    return flat.reshape((len(parts), *parts[0].shape))


def stack_updates(parts):
    out = jnp.zeros((len(parts), *parts[0].shape), parts[0].dtype)
    for i, p in enumerate(parts):
        out = jax.lax.dynamic_update_index_in_dim(out, p, i, 0)
    return out


def no_stack(parts):
    return None


def make(stack):
    @jax.jit
    def step(parts):
        parts = jax.lax.optimization_barrier(parts)
        stacked = stack(parts)
        if stacked is None:  # the floor: the parts read directly
            return sum(jnp.sum(p.astype(jnp.float32) ** 2) for p in parts)
        stacked = jax.lax.optimization_barrier(stacked)
        return jnp.sum(stacked.astype(jnp.float32) ** 2)

    return step


for shape in [(64, 1024, 512), (64, 512, 1024)]:
    keys = jax.random.split(jax.random.key(0), 18)
    parts = [jax.random.normal(k, shape, jnp.bfloat16) for k in keys]
    want = make(no_stack)(parts)
    for name, stack in [
        ("no stack (floor)", no_stack),
        ("jnp.stack (concatenate)", stack_concat),
        ("flat concatenate", stack_flat),
        ("dynamic_update_slice chain", stack_updates),
    ]:
        fn = make(stack)
        got = fn(parts)
        assert jnp.allclose(got, want, rtol=1e-3), (name, got, want)
        t = _timing.kernel_time(fn, parts, iterations=10)
        print(f"== {shape} {name}: {t * 1e3:.3f} ms", flush=True)
