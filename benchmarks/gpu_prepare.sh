#!/usr/bin/env bash
# Run on a machine with pip and the package index, before a GPU run: the wheels the GPU machine
# lacks (CPython 3.12, x86-64; it has torch, transformers, numpy, rich, matplotlib) go to .whl/
# (git-ignored), and the command to run there is printed. Carry `.whl` with the tree.
#
# .whl/transformers/ holds the newest transformers release Lockstep is tested with (and the
# huggingface-hub it needs), which the run puts first on PYTHONPATH: the suite measures with it,
# and its `compat` section also runs every family under the image's own release (the lowest).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl
mkdir -p .whl/transformers
fetch() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any "$@"
}
fetch -d .whl "msgspec==0.22.0" "cachetools==8.0.2"
highest=$(sed -n 's/^transformers==//p' constraints.txt)
hub=$(sed -n "s/^huggingface-hub==//p" tests/transformers_floor/requirements.txt)
fetch -d .whl/transformers "transformers==${highest}" "huggingface-hub==${hub}"
# The hybrid layers' field kernels (lockstep/modeling/hybrid_field.py): fla-core's Triton kernels
# (pure Python; the image's Triton compiles them) and einops, which fla-core imports. Not the
# flash-linear-attention wheel: its fla.layers / fla.models (which `import fla` loads when
# present) are not used, and causal-conv1d / mamba-ssm ship as source only (they need nvcc).
fetch -d .whl "fla-core==0.6.0" "einops==0.8.2"
rev=$(git rev-parse --short HEAD)
echo "carry: .whl ($(du -sh .whl | cut -f1))"
echo "run there, from the tree's root (quick: add --quick; a first check: --smoke):"
echo "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/tf .whl/transformers/*.whl && export PYTHONPATH=/tmp/tf:/tmp/site:\$PWD PYTHONUNBUFFERED=1 && python3 benchmarks/gpu_suite.py --profile --rev $rev --out \$OUT"
