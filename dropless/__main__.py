"""`python -m dropless ...`: the same as the `dropless` command."""

from dropless.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
