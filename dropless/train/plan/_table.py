"""The plan as a table, and the byte counts the command reads: `format_plan` prints every
memory term, the total, FLOPs, traffic and the fit of a `Plan`; `parse_bytes` reads '141GB'."""

import re

from dropless.train.plan._result import LINKS, Plan

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str) -> int:
    """'141GB' -> 141e9, '192GiB' -> 192 * 2**30, '1000' -> 1000 bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"plan: device memory {text!r}: expected a number of bytes with an optional unit, e.g. "
            "141GB, 192GiB or 1000000"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"


def _dtypes(d: dict[str, int]) -> str:
    parts = [f"{_gb(n)} {name}" for name, n in sorted(d.items())]
    return ", ".join(parts) if parts else _gb(0)


def format_plan(p: Plan) -> str:
    """The plan as a two-column table: every memory term, the total, FLOPs, traffic, fit."""
    mesh = ",".join(f"{a}={n}" for a, n in p.mesh.items() if n > 1) or "one device"
    where = "host (offloaded)" if p.offload_optimizer else "device"
    rows = [
        ("mesh", f"{mesh} ({p.devices} devices)"),
        ("batch", f"{p.batch_size} x {p.seq_len} tokens, {p.micro_batches} micro-batches"),
        ("remat", p.remat),
        ("parameters", f"{p.param_count / 1e9:.3f} B"),
        ("params / device", _dtypes(p.params)),
        ("grads / device", _dtypes(p.grads)),
        (f"moments ({where})", _dtypes(p.moments)),
        ("other state", _gb(p.other_state)),
        ("fsdp gathered", f"{_gb(p.fsdp_gathered)} (gradients {_gb(p.fsdp_grads)})"),
        ("stack gradient copies", _gb(p.stack_grad_copies)),
        ("activations", f"{_gb(p.activations)} (recompute {_gb(p.recompute)})"),
        ("backward peak", f"{_gb(p.backward)} (activations, or gradients at its end)"),
        ("ep buffers", _gb(p.ep_buffers)),
        ("weight copies", _gb(p.weight_copies)),
        ("total / device", _gb(p.total)),
        ("host / device", _gb(p.host)),
        ("FLOPs / step", f"{p.flops_per_step:.3e} ({p.flops_per_device:.3e} / device)"),
        ("all-gather / device", f"{_gb(p.all_gather_bytes)} / step"),
        ("reduce-scatter / device", f"{_gb(p.reduce_scatter_bytes)} / step"),
        ("all-reduce / device", f"{_gb(p.all_reduce_bytes)} / step"),
        ("all-to-all / device", f"{_gb(p.all_to_all_bytes)} / step"),
        (
            "compute / step",
            f"{p.compute_seconds:.3g} s at {p.mfu:.0%} MFU of {p.peak_flops / 1e12:.0f} TFLOP/s",
        ),
    ]
    for link, speed in LINKS.items():
        seconds = p.comm_seconds(speed)
        bound = "network-bound" if seconds > p.compute_seconds else "compute-bound"
        rows.append(
            (f"network / step ({link})", f"{seconds:.3g} s at {speed / 1e9:.0f} GB/s: {bound}")
        )
    if p.device_memory is not None:
        verdict = "yes" if p.fits else "NO"
        rows.append(("fits", f"{verdict}: {_gb(p.total)} of {_gb(p.device_memory)}"))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)
