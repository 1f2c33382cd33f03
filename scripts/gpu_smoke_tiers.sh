#!/usr/bin/env bash
# The smoke suite's training, resume and parallel tiers on every REF, as a new user runs it
# (apply -> install -> smoke), plus the proofs that they can fail, on one box with 2+ GPUs.
#
#   scripts/gpu_smoke_tiers.sh SOURCE OUTDIR [REF ...]
#       (default refs: core_v0.12.0 core_v0.16.0 core_v0.19.0 main)
#
# SOURCE: a Megatron-LM clone or mirror with the refs. Per REF, into OUTDIR:
#   smoke-REF.json/.xml/.txt   the whole suite (`megatron-rocm smoke`)
#   fault-REF.txt              MEGATRON_ROCM_SMOKE_FAULT=resume on training.resume.1gpu.local
#                              (it must FAIL: that run's exit status is logged, 1 expected)
#   distopt-REF.jsonl          scripts/training/validate_distopt_resume.py (pretrain_gpt.py save/resume
#                              per checkpoint format, DP2) for the refs in DISTOPT_REFS
# and smoke-table.md, the Markdown table for docs/smoke.md (scripts/smoke_table.py).
#
# Switches: WHEELS="DIR ..." installs offline from those folders (pip's find-links; from
# scripts/make_carry.sh: WHEELS="$PWD/.whl $PWD/.whl/build"; the box needs psutil, and einops
# for Megatron-FSDP); SKIP_INSTALL=1 skips `install` (the tree goes first on
# sys.path anyway, its dependencies must be there); JOBS=N smoke runs in flight at once (default
# 2: tags share the GPUs, which changes timings, not verdicts); DISTOPT_REFS="R ..." (default:
# the last REF; "none" for none). About 3 minutes of smoke per ref on H100/H200.
set -u
SRC=$1; OUT=$2; shift 2
REFS=("$@"); [ ${#REFS[@]} -gt 0 ] || REFS=(core_v0.12.0 core_v0.16.0 core_v0.19.0 main)
W=${WORK:-/tmp/mrocm-smoke-tiers}; mkdir -p "$W" "$OUT"
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/summary.txt"; }

log "device: $($PY -c 'import torch;print(torch.cuda.get_device_name(0), "x", torch.cuda.device_count(), torch.__version__)')"
for R in "${REFS[@]}"; do
  rm -rf "$W/p-$R"
  $PY -m megatron_rocm apply --source "$SRC" --ref "$R" --dest "$W/p-$R" > "$OUT/apply-$R.txt" 2>&1 \
    && log "apply $R: ok" || log "apply $R: FAILED ($(tail -1 "$OUT/apply-$R.txt"))"
  if [ "${SKIP_INSTALL:-0}" != 1 ]; then
    if [ -n "${WHEELS:-}" ]; then
      PIP_NO_INDEX=1 PIP_FIND_LINKS="$WHEELS" $PY -m megatron_rocm install "$W/p-$R" > "$OUT/install-$R.txt" 2>&1
    else
      $PY -m megatron_rocm install "$W/p-$R" > "$OUT/install-$R.txt" 2>&1
    fi
    log "install $R: exit $? ($(tail -1 "$OUT/install-$R.txt"))"
  fi
done

smoke_one() {
  local R=$1
  (cd "$HERE" && $PY -m megatron_rocm smoke "$W/p-$R" --json "$OUT/smoke-$R.json" \
     --junit "$OUT/smoke-$R.xml" > "$OUT/smoke-$R.txt" 2>&1)
  log "smoke $R: exit $? ($(tail -1 "$OUT/smoke-$R.txt"))"
  (cd "$HERE" && MEGATRON_ROCM_SMOKE_FAULT=resume $PY -m megatron_rocm smoke "$W/p-$R" \
     --only training.resume.1gpu.local > "$OUT/fault-$R.txt" 2>&1)
  log "fault=resume $R: exit $? (1 expected) ($(grep -m1 'training.resume' "$OUT/fault-$R.txt"))"
}
running=0
for R in "${REFS[@]}"; do
  [ -d "$W/p-$R" ] || continue
  smoke_one "$R" &
  running=$((running + 1))
  if [ "$running" -ge "${JOBS:-2}" ]; then wait -n; running=$((running - 1)); fi
done
wait

DREFS=(${DISTOPT_REFS:-${REFS[$((${#REFS[@]} - 1))]}})
for R in "${DREFS[@]}"; do
  [ "$R" = none ] && continue
  [ -d "$W/p-$R" ] || continue
  (cd "$HERE" && $PY -m scripts.training.validate_distopt_resume "$W/p-$R" --out "$W/distopt-$R" \
     > "$OUT/distopt-$R.jsonl" 2> "$OUT/distopt-$R.err")
  log "distopt resume $R: exit $?"
  sed 's/^/    /' "$OUT/distopt-$R.jsonl" | cut -c1-220 | tee -a "$OUT/summary.txt"
done

args=()
for R in "${REFS[@]}"; do [ -f "$OUT/smoke-$R.json" ] && args+=("$R=$OUT/smoke-$R.json"); done
[ ${#args[@]} -gt 0 ] && $PY "$HERE/scripts/smoke_table.py" "${args[@]}" > "$OUT/smoke-table.md" \
  && log "table: $OUT/smoke-table.md"
