"""Medians and ranges of the interleaved A/B in this folder (gmm256_{keep,default}_N.log).

    python docs/bench_logs/cpu-2026-12-06-s29/summarise.py
"""

import pathlib
import re
import statistics

here = pathlib.Path(__file__).parent
for mode in ("keep", "default"):
    for routing in ("balanced", "dirichlet"):
        ratios = []
        for log in sorted(here.glob(f"gmm256_{mode}_*.log")):
            line = re.search(rf"^ +256 +{routing} .*$", log.read_text(), re.M).group(0)
            ratios.append(float(line.split()[5]))  # the fwd+bwd / dense column
        under = sum(r <= 4 for r in ratios)
        print(
            f"{mode:8} {routing:9} fwd+bwd/dense: median {statistics.median(ratios):.2f}, "
            f"{min(ratios):.2f}-{max(ratios):.2f}, {under} of {len(ratios)} at or under 4x"
        )
