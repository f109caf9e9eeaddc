"""`python -m dropless.data INPUT... --out DIR`, the same as `dropless prepare`."""

import sys

from dropless.data._cli import main

if __name__ == "__main__":
    sys.exit(main())
