"""Where a compiled step spends its device time: a table from a JAX profiler trace.

The trace gives each kernel (GPU) or thunk (CPU) with the HLO instruction it ran; the compiled
HLO text maps that instruction to its `op_name`, the path of `jax.named_scope`s it came from
("embed", "attention", "route", "dispatch", "experts", ...). Time is summed per scope and
direction (forward, or backward where the path holds JAX's `transpose(`), and per kernel.
"""

import collections
import gzip
import json
import pathlib
import re
import tempfile
from collections.abc import Callable

import jax

# The model's named scopes, innermost first when a path holds several.
SCOPES = ("q", "kv", "attention", "route", "dispatch", "experts", "combine", "ffn", "embed", "head")
_OP_NAME = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name="([^"]*)"')


def op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> its metadata op_name, from a compiled module's text."""
    out = {}
    for line in hlo_text.splitlines():
        m = _OP_NAME.match(line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def scope_of(op_name: str) -> str:
    parts = re.split(r"[/()]", op_name)
    where = next((s for s in reversed(parts) if s in SCOPES), "other")
    if "mtp" in parts:
        where = f"mtp/{where}"
    return f"{where} (bwd)" if "transpose(" in op_name else where


def device_events(trace: dict) -> list[dict]:
    """Kernel events on the GPU streams, or, on a CPU-only trace, the XLA thunks."""
    names = {
        e["pid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    gpu = {pid for pid, n in names.items() if "GPU" in n or "gpu" in n}
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    if gpu:
        return [e for e in events if e["pid"] in gpu and "hlo_op" in e.get("args", {})]
    return [e for e in events if "hlo_op" in e.get("args", {})]


def profile(
    run: Callable[[], object],
    hlo_text: str,
    steps: int = 2,
    trace_copy: pathlib.Path | None = None,
    top: int | None = 25,
) -> tuple[list[dict], list[dict]]:
    """Profile `steps` calls of `run` (each must block); return (per-scope rows, the `top`
    kernels by time, all of them with top=None)."""
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp):
            for _ in range(steps):
                run()
        (path,) = pathlib.Path(tmp).glob("plugins/profile/*/*.trace.json.gz")
        if trace_copy is not None:
            trace_copy.parent.mkdir(parents=True, exist_ok=True)
            trace_copy.write_bytes(path.read_bytes())
        with gzip.open(path) as f:
            trace = json.load(f)
    events = device_events(trace)
    names = op_names(hlo_text)
    by_scope: collections.Counter = collections.Counter()
    by_kernel: collections.Counter = collections.Counter()
    kernel_scope = {}
    for e in events:
        op = e["args"]["hlo_op"]
        scope = scope_of(names.get(op, ""))
        by_scope[scope] += e["dur"]
        key = (e["name"][:60], op)
        by_kernel[key] += e["dur"]
        kernel_scope[key] = scope
    total = sum(by_scope.values()) or 1.0
    scopes = [
        {"scope": s, "ms/step": t / 1e3 / steps, "share": t / total}
        for s, t in by_scope.most_common()
    ]
    kernels = [
        {"kernel": k, "hlo op": op, "scope": kernel_scope[(k, op)], "ms/step": t / 1e3 / steps}
        for (k, op), t in by_kernel.most_common(top)
    ]
    return scopes, kernels


def _layer_free(name: str) -> str:
    """A kernel or op name without the per-instance suffixes (`.12`, `_3`, `.clone`) that
    differ between the layers of an unrolled model."""
    return re.sub(r"([._](\d+|clone))+$", "", name)


def ops_by_scope(kernels: list[dict], hlo_text: str, top: int = 12) -> dict[str, list[dict]]:
    """`profile`'s kernel rows (pass top=None there) summed per scope by (kernel, the JAX op
    behind it), so that the same kernel in every layer is one row: per scope, the `top` rows by
    time, each with how many (kernel, HLO instruction) rows it merged (about one per layer)."""
    names = op_names(hlo_text)
    time = collections.defaultdict(collections.Counter)
    merged = collections.defaultdict(collections.Counter)
    for r in kernels:
        op = _layer_free(names.get(r["hlo op"], "?").split("/")[-1])
        key = (_layer_free(r["kernel"]), op)
        time[r["scope"]][key] += r["ms/step"]
        merged[r["scope"]][key] += 1
    return {
        scope: [
            {
                "kernel": k[:40],
                "op": op[-70:],
                "instructions": merged[scope][(k, op)],
                "ms/step": ms,
            }
            for (k, op), ms in counter.most_common(top)
        ]
        for scope, counter in time.items()
    }
