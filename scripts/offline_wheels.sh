#!/usr/bin/env bash
# Download the wheels an offline GPU machine needs to `megatron-rocm install` a patched tree:
# megatron-rocm's own dependencies and the training-side imports torch images often lack.
#
#   scripts/offline_wheels.sh DIR [PYTHON_VERSION]      (default 3.12)
#
# Then, on the offline machine:
#   PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR megatron-rocm install Megatron-LM
set -euo pipefail
dir=${1:?usage: offline_wheels.sh DIR [PYTHON_VERSION]}
py=${2:-3.12}
mkdir -p "$dir"
get() {
  python3 -m pip download -q --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$dir" "$@"
}
get setuptools wheel numpy gitpython unidiff packaging six regex pyyaml pydantic nltk pybind11 psutil einops
# megatron-core's own build backend pin (build isolation fetches it when the installed
# setuptools is newer than the tree allows)
get "setuptools<80"
ls "$dir"
