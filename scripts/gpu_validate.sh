#!/usr/bin/env bash
# GPU validation of the series, as a new user would do it, on one machine with a GPU.
#
#   scripts/gpu_validate.sh SOURCE OUTDIR [REF ...]
#
# SOURCE is a Megatron-LM clone or mirror (with tags). For each REF: `megatron-rocm apply`,
# the UNPATCHED tree run with default flags (records where it stops), the PATCHED tree trained
# (small GPT, 50 iterations, default fusion flags). Then a small Llama on the newest ref, the
# smoke suite, and the throughput comparison of a 0.85B Llama: patched defaults vs upstream with
# every fusion off. Results: OUTDIR/*.json and OUTDIR/summary.txt.
#
# Environment switches: PAIRED=1 adds, per REF, a patched and an upstream-unfused small-GPT run
# one after the other (the GPU to itself, so the iteration times compare; PAIRED_MBS=N and
# PAIRED_ITERS=N change micro-batch and length); SMOKE_ALL=1 runs the smoke suite on every REF,
# SKIP_SMOKE=1 on none; WHEELS=DIR runs `megatron-rocm install` offline from DIR first
# (scripts/offline_wheels.sh makes it); SKIP_BASIC=1 skips the unpatched/patched/Llama runs
# (when only the timings or the smoke are owed); SKIP_THROUGHPUT=1 skips the 0.85B comparison,
# TP_MBS=N sets its micro-batch for both trees and TP_ONLY=unfused|patched runs one side.
set -u
SRC=$1; OUT=$2; shift 2
REFS=("$@"); [ ${#REFS[@]} -gt 0 ] || REFS=(core_v0.12.0 core_v0.14.0 core_v0.16.0 core_v0.19.0 main)
W=${WORK:-/tmp/mrocm-validate}; mkdir -p "$W" "$OUT"
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/summary.txt"; }

log "device: $($PY -c 'import torch;print(torch.cuda.get_device_name(0), torch.__version__, torch.version.cuda or torch.version.hip)')"
for R in "${REFS[@]}"; do
  $PY -m megatron_rocm apply --source "$SRC" --ref "$R" --dest "$W/p-$R" --json > "$OUT/apply-$R.json" \
    && log "apply $R: ok" || log "apply $R: FAILED"
  git clone -q "$SRC" "$W/u-$R" && git -C "$W/u-$R" checkout -q "$R"
done

# Unpatched (default flags) and patched small GPT runs, all at once on the one GPU.
NEWEST=${REFS[$((${#REFS[@]} - 1))]}
if [ "${SKIP_BASIC:-0}" != 1 ]; then
pids=()
for R in "${REFS[@]}"; do
  (cd "$HERE" && $PY -m scripts.training.train_small "$W/u-$R" --preset gpt --iters 3 \
     --log "$OUT/unpatched-$R.log" > "$OUT/unpatched-$R.json" 2>&1) & pids+=($!)
  (cd "$HERE" && $PY -m scripts.training.train_small "$W/p-$R" --preset gpt --iters 50 \
     --log "$OUT/patched-gpt-$R.log" > "$OUT/patched-gpt-$R.json" 2>&1) & pids+=($!)
done
for R in core_v0.19.0 "$NEWEST"; do
  [ -d "$W/p-$R" ] || continue
  (cd "$HERE" && $PY -m scripts.training.train_small "$W/p-$R" --preset llama --iters 50 \
     --log "$OUT/patched-llama-$R.log" > "$OUT/patched-llama-$R.json" 2>&1) & pids+=($!)
done
wait "${pids[@]}"
for R in "${REFS[@]}"; do
  # train_small's verdict names the exception that stopped the run
  err=$(tail -1 "$OUT/unpatched-$R.json" | $PY -c \
    'import json,sys; p=json.load(sys.stdin)["problems"]; print(next((x for x in p if "Error: " in x), ""))' 2>/dev/null)
  log "unpatched $R default flags: ${err:-no error found (see log)}"
  log "patched gpt $R: $(tail -1 "$OUT/patched-gpt-$R.json")"
done
for f in "$OUT"/patched-llama-*.json; do log "$(basename "$f"): $(tail -1 "$f")"; done
fi

# Paired timings: patched defaults vs upstream with every fusion off, one run at a time.
if [ "${PAIRED:-0}" = 1 ]; then
  for R in "${REFS[@]}"; do
    for kind in p u; do
      flag=(); [ $kind = u ] && flag=(--unfused)
      [ -n "${PAIRED_MBS:-}" ] && flag+=(--micro-batch-size "$PAIRED_MBS")
      (cd "$HERE" && $PY -m scripts.training.train_small "$W/$kind-$R" --preset gpt \
         --iters "${PAIRED_ITERS:-25}" "${flag[@]}" \
         --log "$OUT/paired-$kind-$R.log" > "$OUT/paired-$kind-$R.json" 2>&1)
      log "paired $kind $R: $(tail -1 "$OUT/paired-$kind-$R.json")"
    done
  done
fi

# install (offline, from carried wheels) and the smoke suite.
SMOKE_REFS=("$NEWEST"); [ "${SMOKE_ALL:-0}" = 1 ] && SMOKE_REFS=("${REFS[@]}")
[ "${SKIP_SMOKE:-0}" = 1 ] && SMOKE_REFS=()
for R in "${SMOKE_REFS[@]}"; do
  if [ -n "${WHEELS:-}" ]; then
    PIP_NO_INDEX=1 PIP_FIND_LINKS="$WHEELS" $PY -m megatron_rocm install "$W/p-$R" \
      > "$OUT/install-$R.txt" 2>&1; log "install $R: exit $? ($(tail -1 "$OUT/install-$R.txt"))"
  fi
  $PY -m megatron_rocm smoke "$W/p-$R" --json "$OUT/smoke-$R.json" --junit "$OUT/smoke-$R.xml" \
    > "$OUT/smoke-$R.txt" 2>&1; log "smoke $R: exit $? ($(tail -1 "$OUT/smoke-$R.txt"))"
done

# Throughput: 0.85B Llama-style, same GPU, same run; patched defaults vs upstream unfused.
T=${THROUGHPUT_REF:-core_v0.19.0}
MBS=(); [ -n "${TP_MBS:-}" ] && MBS=(--micro-batch-size "$TP_MBS")
if [ -d "$W/p-$T" ] && [ "${SKIP_THROUGHPUT:-0}" != 1 ]; then
  for side in patched unfused; do
    [ -n "${TP_ONLY:-}" ] && [ "$TP_ONLY" != $side ] && continue
    tree=$W/p-$T; flag=(); [ $side = unfused ] && tree=$W/u-$T && flag=(--unfused)
    (cd "$HERE" && $PY -m scripts.training.train_small "$tree" --preset llama --preset-size 0.85b \
       "${flag[@]}" "${MBS[@]}" --iters "${TP_ITERS:-20}" --log "$OUT/tput-$side.log" \
       > "$OUT/tput-$side.json" 2>&1)
    log "0.85b $side $T ${TP_MBS:+mbs $TP_MBS}: $(tail -1 "$OUT/tput-$side.json")"
  done
fi
