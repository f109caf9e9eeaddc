#!/usr/bin/env bash
# Fills .whl/ (git-ignored) with what benchmarks/h200_anchors.sh installs on the device machine
# (Python 3.12, jax 0.11.2, x86-64, no registry there): tokamax 0.0.16 (the newest that takes
# jax 0.11) and the packages it imports that the device image lacks, tyro and its needs for
# `dropless.cli`, and beartype for the tests' type checks. tokamax imports xprof's kernel-stats
# tool at start-up (32 MB and a dozen more packages); h200_anchors.sh stands an empty module in
# for it, which only tokamax's own xprof timers would call. Run from the project root.
set -euo pipefail
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl \
  tokamax==0.0.16 einshape==1.0 qwix==0.1.8 immutabledict==4.3.1 tensorboardx==2.6.5 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
  tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 beartype==0.23.1
ls .whl
