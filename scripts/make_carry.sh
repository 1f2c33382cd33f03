#!/usr/bin/env bash
# Build what a lent GPU box (no network; torch, Triton, pytest, pytest-timeout, numpy, einops,
# requests, click already there; no Apex, no TransformerEngine) needs for `megatron-rocm
# apply/install/smoke`, `pretrain_gpt.py` on every tag and upstream's own unit tests
# (scripts/upstream_unit_tests.py), and nothing it already has, so the whole carry stays small.
#
#   scripts/make_carry.sh MIRROR [REF ...]   (default refs: core_v0.12.0 core_v0.16.0
#                                              core_v0.19.0 main)
#
# MIRROR is a Megatron-LM clone or mirror with those refs. Writes, in the repository root:
#   .upstream/mlm.bundle  one snapshot commit per ref (tags snap/<ref>; no history, so small);
#                         the mirror is not written to (the commits live in a scratch repo)
#   .whl/*.whl            wheels to put on PYTHONPATH: megatron-rocm's own deps (gitpython,
#                         gitdb, smmap, unidiff) and pydantic (megatron imports it from 0.16)
#   .whl/build/*.whl      wheels only pip needs: `install`'s isolated build of a 0.16 tree
#                         (setuptools<80, pybind11, packaging) and nltk, which `install` adds,
#                         with defusedxml (the one dependency of nltk the box lacks)
# Both folders are made ignored by git (.git/info/exclude) so they travel only when carried.
set -euo pipefail
mirror=${1:?usage: make_carry.sh MIRROR [REF ...]}
shift
refs=("$@")
[ ${#refs[@]} -gt 0 ] || refs=(core_v0.12.0 core_v0.16.0 core_v0.19.0 main)
py=${PYVER:-3.12}
root=$(git rev-parse --show-toplevel)
cd "$root"

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for d in .upstream .whl; do
  if ! git check-ignore -q "$d/probe"; then
    echo "/$d/" >> "$exclude"
    echo "added /$d/ to $exclude (a .gitignore line would make this permanent)"
  fi
done

# 1. bundle: snapshot commits made in a scratch repo that borrows the mirror's objects
objects=$(cd "$mirror" && cd "$(git rev-parse --git-path objects)" && pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
git init -q --bare "$scratch/snap.git"
echo "$objects" > "$scratch/snap.git/objects/info/alternates"
export GIT_AUTHOR_NAME=megatron-rocm GIT_AUTHOR_EMAIL=snapshot@megatron-rocm.invalid
export GIT_COMMITTER_NAME=megatron-rocm GIT_COMMITTER_EMAIL=snapshot@megatron-rocm.invalid
export GIT_AUTHOR_DATE=2000-01-01T00:00:00Z GIT_COMMITTER_DATE=2000-01-01T00:00:00Z
for r in "${refs[@]}"; do
  tree=$(git -C "$mirror" rev-parse --verify -q "$r^{tree}") || {
    echo "make_carry: $mirror has no ref $r" >&2
    exit 2
  }
  commit=$(git -C "$scratch/snap.git" commit-tree "$tree" -m "$r snapshot ($(git -C "$mirror" rev-parse "$r^{commit}"))")
  git -C "$scratch/snap.git" update-ref "refs/tags/snap/$r" "$commit"
done
mkdir -p .upstream
git -C "$scratch/snap.git" bundle create -q "$root/.upstream/mlm.bundle" --tags='snap/*'

# 2. wheels: resolved together (pydantic and pydantic_core must match), then only the ones
#    the box lacks are kept; one version of each, so `pip install .whl/*.whl` cannot clash
dl=$scratch/dl
get() {
  python3 -m pip download -q --only-binary=:all: --python-version "$py" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$1" "${@:2}"
}
get "$dl/site" gitpython unidiff pydantic
get "$dl/build" "setuptools<80" pybind11 "packaging>=24.2" nltk
rm -rf .whl
mkdir -p .whl/build
keep() {  # keep(dir dest name...): copy the wheels of these distributions
  local src=$1 dest=$2 name
  shift 2
  for name in "$@"; do
    cp "$src"/"$name"-[0-9]*.whl "$dest"/
  done
}
keep "$dl/site" .whl gitpython gitdb smmap unidiff pydantic pydantic_core annotated_types \
  typing_inspection typing_extensions
keep "$dl/build" .whl/build setuptools pybind11 packaging nltk defusedxml  # the box has nltk's other deps

echo "carry (name both in run's carry list):"
du -sh .upstream .whl | sed 's/^/  /'
git bundle list-heads .upstream/mlm.bundle | sed 's/^/  /'
ls .whl .whl/build | sed 's/^/  /'
total=$(du -sbc .upstream .whl | tail -1 | cut -f1)
# what travels besides: tracked and untracked-not-ignored files
tree_bytes=$(git ls-files -z -co --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
echo "carried $((total / 1024)) KiB + working tree $((tree_bytes / 1024)) KiB" \
  "= $(((total + tree_bytes) / 1048576)) MiB of the 64 MiB a call may send"
[ $((total + tree_bytes)) -lt $((56 * 1048576)) ] || echo "WARNING: close to the 64 MiB limit" >&2
