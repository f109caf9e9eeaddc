"""`dropless verify RUN_DIR`: a run's config, every checkpoint's digests and its data's
identity, checked and listed (`dropless.train.loop.verify_run`); exit status 1 if any fails."""

import argparse

from dropless.train.loop.verify_run import verify_run


def build_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `verify`, added to `parser`."""
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run's --out-dir")
    parser.add_argument(
        "--data-hashes",
        action="store_true",
        help="also hash the token files against meta.json (reads them whole)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    """Prints a line per check; 0 when all hold."""
    checks = verify_run(args.run_dir, data_hashes=args.data_hashes)
    width = max(len(c.what) for c in checks)
    for c in checks:
        print(f"{c.what:<{width}}  {'ok  ' if c.ok else 'FAIL'}  {c.detail}")
    return 0 if all(c.ok for c in checks) else 1
