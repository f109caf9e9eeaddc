"""`dropless verify RUN_DIR`: a run's config, every checkpoint's digests and its data's
identity, checked and listed (`dropless.train.loop.verify_run`); exit status 1 if any fails."""

import dataclasses
from typing import Annotated

import tyro

from dropless.train.loop._verify_run import verify_run


@dataclasses.dataclass(frozen=True)
class VerifyCommand:
    """A run's config, every checkpoint's digests and its data's identity, checked and listed;
    exit status 1 if any check fails."""

    run_dir: Annotated[tyro.conf.Positional[str], tyro.conf.arg(metavar="RUN_DIR")]
    """A run's --out-dir."""
    data_hashes: bool = False
    """Also hash the token files against meta.json (reads them whole)."""


def run(args: VerifyCommand) -> int:
    """Prints a line per check; 0 when all hold."""
    checks = verify_run(args.run_dir, data_hashes=args.data_hashes)
    width = max(len(c.what) for c in checks)
    for c in checks:
        print(f"{c.what:<{width}}  {'ok  ' if c.ok else 'FAIL'}  {c.detail}")
    return 0 if all(c.ok for c in checks) else 1
