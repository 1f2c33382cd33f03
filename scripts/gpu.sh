#!/usr/bin/env bash
# The one GPU driver: the series and the native TE-spec backend validated as a new user would
# run them (apply -> install -> smoke, training, benchmarks), on a lent GPU box with no network.
# Carry .upstream/ and .whl/ (scripts/make_carry.sh) with the working tree.
#
#   scripts/gpu.sh OUT STAGE [STAGE ...]
#
# Stages (run in the order given):
#   setup    wheels onto PYTHONPATH, upstream refs from the bundle, `megatron-rocm apply` of
#            every ref in REFS (default: core_v0.12.0 core_v0.16.0 core_v0.19.0 main)
#   train    pretrain_gpt.py with upstream's default --transformer-impl (the TE spec on the
#            native backend): small GPT on every ref, small Llama on every ref, and the local
#            spec Llama on the newest ref for the loss comparison; ITERS (default 50)
#   tp2      TP=2 + SP, TE spec, small Llama on the newest ref (needs 2 GPUs)
#   units    upstream's own unit tests on the newest ref, patched (and unpatched with
#            UNPATCHED=1), through scripts/upstream_unit_tests.py when present
#   profile  scripts/training/profile_step.py: local spec vs TE spec, SDPA kernel choices (PROFILE_MBS)
#   bench    0.85B Llama: TE spec vs local spec vs upstream with every fusion off (BENCH_MBS,
#            BENCH_ITERS, BENCH_IMPLS, BENCH_RECIPE, BENCH_REFERENCE="norm ..." for kernel A/B)
#   trace    one profiled iteration of the 0.85B benchmark per spec (scripts/training/trace_summary.py;
#            TRACE_SIZE=8b-slice BENCH_MBS=1 TRACE_FLAGS="--fp8-format hybrid ..." for the 8B's layers in FP8;
#            TRACE_STACKS=0: no host call stacks, which slow the host less, for busy against span;
#            it applies to mfu's trace too)
#   fp8      FP8: the FP8 tests' GPU cases, scripts/bench/fp8_linear.py, the 0.85B Llama in the
#            runs FP8_RUNS names (default "bf16 hybrid delayed": bf16, tensorwise, the 8B example's
#            delayed scaling; also blockwise: hybrid block scaling; FP8_ITERS, default 300; FP8_MBS, default 16) on a Markov corpus it
#            cannot memorise (FP8_DATA=mock: mock data), each FP8 run's losses against bf16's;
#            FP8_BENCH=0 skips the tests and the benchmark; FP8_SIZE=8b-slice (with FP8_MBS=1,
#            FP8_GBS=8, FP8_DATA=mock) runs eight of Llama-3 8B's layers at its sequence length;
#            with the tests, the smoke suite's FP8 checks (kernels.fp8, training.resume.1gpu_fp8)
#   fp8resume FP8 delayed scaling saves and resumes on 2 GPUs (scripts/training/validate_distopt_resume.py:
#            torch_dist, with --ckpt-drop-redundant-extra-state on main; torch_dist and torch with
#            --fp8-param-gather), the amax histories in the checkpoint; OUT/fp8resumeN.txt
#   fp8tp2   FP8 with TP=2 + sequence parallelism on 2 GPUs: the small Llama in bf16, tensorwise and
#            delayed (FP8TP_ITERS, default 100), each FP8 run's losses against bf16's; then each
#            recipe saves and resumes (validate_distopt_resume.py, torch_dist); OUT/fp8tp2-*
#   fp8moe   FP8 MoE experts on 2 GPUs (EP=2, 4 experts, top-2, alltoall): the small Llama in bf16 and
#            tensorwise, with --moe-grouped-gemm and without (FP8MOE_ITERS, default 100), each
#            FP8 run's losses against its bf16 run's; then a grouped FP8 run saves and resumes
#            (validate_distopt_resume.py, torch_dist); OUT/fp8moe-*
#   mfu      issue 45's 0.85B on one GPU, MFU_ITERS iterations a run, the runs MFU_RUNS names
#            (default "base example graphs full-iteration optimizer-graph"; empty: none; also
#            distopt, distopt-graph): upstream's defaults, the 8B example's flags (CE fusion,
#            manual GC, no dataloader mask), those with --cuda-graph-impl local or full_iteration,
#            --optimizer-cuda-graph, the distributed optimizer; the SM clock and power sampled
#            through them (scripts/training/power_summary.py). Then (MFU_CEILINGS=0: not) the GEMM +
#            attention ceiling of a micro-batch of the 0.85B and of the 8B example, op by op and
#            back to back for MFU_SUSTAINED seconds (default 10; scripts/bench/step_ceiling.py,
#            clocks sampled), and a profiled iteration of the run MFU_TRACE names (default
#            example; none: no trace) summarised with each kernel's launch site and each gap's
#            host frame
#   smoke    `megatron-rocm smoke` on the newest ref
#   kernels  every GPU test of tests/runtime (scripts/gpu_tests.py: GPU_TESTS_PROCS processes
#            side by side, GPU_TESTS_TIMEOUT seconds; it fails unless tests ran and none
#            failed), and the one-GPU kernel benchmarks (RoPE, SwiGLU, grouped GEMM, packed
#            attention, the TE spec's attention kernels at the 0.85B's and the 8B's shapes)
#   cp2      context parallelism on 2 GPUs: CP=2 Llama at seq 8k and 16k (TE spec), CP=1 at 8k
#            for the loss comparison, the GPU cases of test_context_parallel, bench/cp_attention
#   moe2     EP=2 MoE, alltoall dispatcher, with and without --moe-grouped-gemm (2 GPUs)
#   mla      multi-latent attention through the TE spec on the newest ref: a small GPT with
#            rope fusion (--position-embedding-type rope, 12 heads: a partial BLOCK_H block,
#            the mla-rope-mask patch) and without it; upstream's fused MLA RoPE tests, its
#            experimental ones included
#   units2   upstream's own unit tests (transformer/, tensor_parallel/, fusions/), unpatched vs
#            patched newest ref, 2 ranks (scripts/upstream_unit_tests.py), UNIT_BUDGET seconds
#   packedcp packed sequences under CP and the CP block kernels (2 GPUs): the GPU cases of
#            test_packed_context_parallel and test_context_parallel (verbose, tracebacks after
#            120 s), bench/cp_attention with auto's blocks (cuDNN on NVIDIA) and flash's, SDPA's
#            backends forced and each case's costliest ops, smoke's parallel.cp2 /
#            parallel.cp2_packed, upstream's test_sequence_packing.py at 2 ranks
#   par4     four GPUs: the parallel layouts issue 11 names that two GPUs cannot show, small
#            Llama at seq 16k on every ref in REFS: TP2 x CP2 (+SP) against TP=2 alone, CP=4
#            (the ring over four ranks) against CP=1, loss by loss (scripts/training/compare_losses.py);
#            on the newest ref MoE with EP=2 x DP=2, --moe-grouped-gemm and the distributed
#            optimizer (PAR4_ITERS; PAR4_RUNS picks from cp1 tp2 tp2cp2 cp4 moe, default all)
#   scale4   four GPUs, issue 14, on every ref in REFS: scripts/training/validate_par4.py (TP2 x PP2 with
#            virtual stages, TP2 x CP2 at 16k, EP4 MoE with grouped GEMM over DP4, DP4 with the
#            distributed optimizer; the first and the last save and resume in a fresh process;
#            each against the same model on one GPU: OUT/scale4-REF.md), then smoke's four-GPU
#            parallel modes and resume checks (SCALE4_ITERS; SCALE4_RUNS; SCALE4_SIZE, the Llama
#            preset: small or 0.85b; SCALE4_TIMEOUT, seconds per run, default 240;
#            SCALE4_SMOKE=0 skips the smoke part)
#   moebench upstream's expert modules on the newest ref, SequentialMLP vs TEGroupedMLP on the
#            native backend (scripts/bench/moe_experts.py, MOE_EXPERTS default 8 64), and the
#            bare GEMMs of the same experts (scripts/bench/grouped_gemm.py)
#   mimo2    upstream's MIMO tests (tests/unit_tests/models/mimo), unpatched vs patched newest
#            ref, 2 ranks
#   upx1     upstream's dist_checkpointing/ and models/ tests (upstream_unit_tests.py --suite
#            dist_checkpointing --suite models), unpatched vs patched newest ref, 1 rank,
#            UPX_BUDGET seconds for both trees (default 470: at main d98e8a6 one rank took about
#            200 s on 1 x H200, two ranks 280 s on 2 x H200; a run the budget stops is finished
#            by hand, upstream_unit_tests.py run ... --out OUT/upxN --resume)
#   upx2     the same at 2 ranks
#   upx4     the same at 4 ranks (4 GPUs)
#   paths    upstream's test files UNIT_PATHS, unpatched vs patched newest ref, UNIT_NPROC ranks
#            (default 2), UNIT_BUDGET seconds
#   cpscale  CP throughput (2 GPUs): CP=1 at half of CP_LENGTH and at CP_LENGTH, CP=2 at CP_LENGTH
#            with the ring's blocks on auto's kernel (cuDNN on NVIDIA) and on flash's and with
#            --cp-comm-type a2a
#            (CP_LENGTH default 16384, CP_SIZE small or 0.85b, CP_ITERS, CP_FLAGS; CP_RUNS picks
#            from cp1-half cp1 cp2 cp2-flash cp2-a2a, default all; a one-GPU run NAME@N runs on
#            GPU N alone, e.g. cp1-half@1: the pair is as fast as its slower GPU; NAME@0+1 runs
#            it on GPUs 0 and 1 at once, one process each, as the pair's GPUs run beside each
#            other under CP=2)
#   series   the series as a new user meets it, per ref of SERIES_REFS (default core_v0.12.0
#            core_v0.14.0 core_v0.16.0 core_v0.19.0 main) from SOURCE (a Megatron-LM clone or
#            mirror; default: setup's copy of the bundle), in SERIES_WORK (default
#            /tmp/mrocm-validate): `megatron-rocm apply`, the unpatched tree with default flags
#            (where it stops), the patched tree trained (small GPT, 50 iterations), a small Llama
#            on the newest ref, install + smoke, and the 0.85B throughput, patched defaults vs
#            upstream with every fusion off. Switches: PAIRED=1 (per ref a patched and an
#            upstream-unfused small GPT one after the other; PAIRED_MBS, PAIRED_ITERS),
#            SMOKE_ALL=1 (smoke every ref), SKIP_SMOKE=1, WHEELS=DIR (offline install first;
#            scripts/offline_wheels.sh), SKIP_BASIC=1, SKIP_THROUGHPUT=1, THROUGHPUT_REF, TP_MBS,
#            TP_ITERS, TP_ONLY=unfused|patched
#   tiers    the smoke suite's training, resume and parallel tiers on every ref of TIERS_REFS
#            (default core_v0.12.0 core_v0.16.0 core_v0.19.0 main) from SOURCE, in TIERS_WORK
#            (default /tmp/mrocm-smoke-tiers): apply -> install -> smoke per ref (smoke-REF.json/
#            .xml/.txt), MEGATRON_ROCM_SMOKE_FAULT=resume on training.resume.1gpu.local, which
#            must FAIL (fault-REF.txt, exit 1 expected), scripts/training/validate_distopt_resume.py
#            for DISTOPT_REFS (default the last ref; "none"), and smoke-table.md for
#            docs/smoke.md (scripts/smoke_table.py). Switches: WHEELS="DIR ..." (pip find-links;
#            from scripts/make_carry.sh: WHEELS="$PWD/.whl $PWD/.whl/build"), SKIP_INSTALL=1,
#            JOBS=N smoke runs at once (default 2). About 3 minutes of smoke per ref on H100/H200
#   example8b upstream's Llama-3 8B example (examples/llama/train_llama3_8b_h100_fp8.sh) on the
#            newest ref, data-parallel over every visible GPU (the DP size is the GPU count),
#            and for a short run: 8 micro-batches a GPU a step (global batch 8 x GPUs;
#            upstream's global batch 128 is 16 a GPU on 8 GPUs), EX8B_ITERS iterations (default
#            16), no eval, save, load or profile. One run per word of EX8B_RUNS (default "bf16
#            fp8"; "bf16 fp8 fp8-tensorwise" for the performance table's rows): bf16
#            (DTYPE="bf16"), fp8 (the example's own FP8 flags: delayed scaling,
#            --fp8-param-gather), fp8-no-param-gather (fp8 without --fp8-param-gather: the
#            distributed optimizer gathers bf16 weights), fp8-tensorwise (fp8 with
#            --fp8-recipe tensorwise). Each edit must find its line in upstream's script, else
#            that run is not made (upstream rewrote the example). EX8B_TIMEOUT seconds a run
#            (default 300; a run of 16 iterations takes about 3 minutes on 2 x H200).
#            OUT/example8b-RUN.{sh,diff,log,json}: the script run, its diff from upstream's, the
#            log, scripts/training/example_summary.py's line. The 8B's weights, gradients and
#            Adam state need two H200s at least (2 x H200: 124 GiB reserved a GPU in bf16)
#   pack     everything under OUT into OUT/all.tgz (last: the device tool brings back only a
#            few files of a call, and one archive holds them all)
# Results: OUT/*.json, OUT/*.log and OUT/summary.txt.
#
# Stages by the GPUs they need:
#   1 GPU:  setup train units profile bench trace mfu fp8 kernels smoke mla moebench upx1 series pack
#   2 GPUs: setup tp2 cp2 moe2 units2 mimo2 packedcp cpscale upx2 paths tiers example8b fp8resume fp8tp2 fp8moe
#   4 GPUs: setup par4 scale4 upx4
set -u
OUT=$1; shift
HERE=$(cd "$(dirname "$0")/.." && pwd)
W=${WORK:-/tmp/mrocm-te}
PY=${PYTHON:-python3}
REFS=(${REFS:-core_v0.12.0 core_v0.16.0 core_v0.19.0 main})
NEWEST=${REFS[$((${#REFS[@]} - 1))]}
ITERS=${ITERS:-50}
mkdir -p "$OUT" "$W"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$HERE
log() { echo "[$(date +%T)] $*" | tee -a "$OUT/summary.txt"; }
train() {  # train NAME TREE ARGS... -> OUT/NAME.json (last line: train_small's summary)
  local name=$1 tree=$2; shift 2
  rm -f "$OUT/$name.log"  # a run that fails before logging must not leave an older log to compare
  (cd "$HERE" && $PY -m scripts.training.train_small "$tree" --log "$OUT/$name.log" "$@" \
     > "$OUT/$name.out" 2>&1; tail -1 "$OUT/$name.out" > "$OUT/$name.json")
}

compare_run() {  # compare_run NAME REFERENCE_LOG OTHER_LOG LABEL -> OUT/NAME.txt, a summary line
  # the two runs' losses, the end on the mean of the last 20 iterations (compare_losses.py)
  (cd "$HERE" && $PY -m scripts.training.compare_losses "$2" "$3" --last 20 > "$OUT/$1.txt" 2>&1)
  log "$4: $(tail -c 600 "$OUT/$1.txt")"
}

stage_setup() {
  log "device: $($PY -c 'import torch;print(torch.cuda.get_device_name(0), torch.cuda.device_count(), torch.__version__, torch.version.cuda or torch.version.hip)')"
  $PY -m pip install -q --no-index --no-deps --target /tmp/site "$HERE"/.whl/*.whl "$HERE"/.whl/build/pybind11-*.whl 2>&1 | tail -2
  rm -rf "$W/src" && git clone -q "$HERE/.upstream/mlm.bundle" "$W/src"
  (cd "$W/src" && for t in $(git tag -l 'snap/*'); do git tag -f "${t#snap/}" "$t" >/dev/null; done \
     && git branch -f main snap/main >/dev/null 2>&1)
  for R in "${REFS[@]}"; do
    rm -rf "$W/p-$R"
    $PY -m megatron_rocm apply --source "$W/src" --ref "$R" --dest "$W/p-$R" --json \
      > "$OUT/apply-$R.json" 2> "$OUT/apply-$R.err" && log "apply $R: ok" || log "apply $R: FAILED $(tail -1 "$OUT/apply-$R.err")"
  done
}

stage_train() {
  local pids=()
  for R in "${REFS[@]}"; do
    train "te-gpt-$R" "$W/p-$R" --preset gpt --iters "$ITERS" & pids+=($!)
    train "te-llama-$R" "$W/p-$R" --preset llama --iters "$ITERS" & pids+=($!)
  done
  train "local-llama-$NEWEST" "$W/p-$NEWEST" --preset llama --iters "$ITERS" \
    --transformer-impl local & pids+=($!)
  wait "${pids[@]}"
  for f in "$OUT"/te-*.json "$OUT"/local-*.json; do log "$(basename "$f" .json): $(cat "$f")"; done
}

stage_tp2() {
  train "te-llama-tp2sp-$NEWEST" "$W/p-$NEWEST" --preset llama --iters "${TP_ITERS:-30}" \
    --nproc 2 --tp 2 --sp
  log "te-llama-tp2sp-$NEWEST: $(cat "$OUT/te-llama-tp2sp-$NEWEST.json")"
}

stage_units() {
  # Upstream's own unit tests on one GPU, the patched newest ref (and the unpatched one with
  # UNPATCHED=1, the two trees taking turns), UNIT_PATHS (default: the issue's selection), one
  # rank, UNIT_JOBS test processes sharing the GPU (each with a temp dir of its own).
  local paths=${UNIT_PATHS:-tests/unit_tests/transformer tests/unit_tests/tensor_parallel tests/unit_tests/fusions}
  local trees=(--tree "p-$NEWEST=$W/p-$NEWEST")
  if [ "${UNPATCHED:-0}" = 1 ]; then
    rm -rf "$W/u-$NEWEST" && git clone -q -b "$NEWEST" "$W/src" "$W/u-$NEWEST" 2>/dev/null
    trees=(--tree "u-$NEWEST=$W/u-$NEWEST" "${trees[@]}")
  fi
  (cd "$HERE" && $PY scripts/upstream_unit_tests.py run "${trees[@]}" --out "$OUT/ut1" \
     --nproc 1 --jobs "${UNIT_JOBS:-4}" --timeout 120 --budget "${UNIT_BUDGET:-300}" --paths $paths \
     > "$OUT/units1.log" 2>&1)
  if [ "${UNPATCHED:-0}" = 1 ]; then
    (cd "$HERE" && $PY scripts/upstream_unit_tests.py compare "$OUT/ut1/u-$NEWEST/results.json" \
       "$OUT/ut1/p-$NEWEST/results.json" --md "$OUT/units1-compare.md" > /dev/null 2>&1)
  fi
  log "units (1 GPU): $(tail -2 "$OUT/units1.log" | tr '\n' ' ')"
}

stage_profile() {
  (cd "$HERE" && $PY -m scripts.training.profile_step "$W/p-$NEWEST" --layers "${PROFILE_LAYERS:-4}" \
     --mbs "${PROFILE_MBS:-8}" --configs "${PROFILE_CONFIGS:-default,te,te-cudnn,te-flash}" \
     ${PROFILE_ARGS:-} \
     > "$OUT/profile.txt" 2>&1)
  log "profile: $(grep '^| ' "$OUT/profile.txt" | tr '\n' ' ')"
}

stage_bench() {
  # One after the other, each with the GPU to itself. "recipe" adds the flags upstream's own
  # Llama recipe turns on (examples/llama/train_llama3_8b_h100_fp8.sh) that need no TE;
  # "unfused" is the *unpatched* tree with every fusion off (micro-batch 8: at 16 its
  # materialised fp32 attention scores do not fit in 80 GB).
  local mbs=${BENCH_MBS:-16} it=${BENCH_ITERS:-30} size="--preset llama --preset-size 0.85b"
  local recipe="--cross-entropy-loss-fusion --manual-gc"
  for impl in ${BENCH_IMPLS:-transformer_engine local}; do
    train "bench-$impl-$NEWEST" "$W/p-$NEWEST" $size --iters "$it" \
      --micro-batch-size "$mbs" --transformer-impl "$impl"
    log "bench $impl mbs $mbs: $(cat "$OUT/bench-$impl-$NEWEST.json")"
    if [ "${BENCH_RECIPE:-1}" = 1 ]; then
      train "bench-$impl-recipe-$NEWEST" "$W/p-$NEWEST" $size --iters "$it" \
        --micro-batch-size "$mbs" --transformer-impl "$impl" -- $recipe
      log "bench $impl+recipe mbs $mbs: $(cat "$OUT/bench-$impl-recipe-$NEWEST.json")"
    fi
  done
  # A/B of single kernels: the TE spec again with each kernel in BENCH_REFERENCE (e.g. "norm")
  # on its torch path (MEGATRON_ROCM_KERNELS=reference:<kernel>), the rest unchanged.
  for k in ${BENCH_REFERENCE:-}; do
    MEGATRON_ROCM_KERNELS="reference:$k" train "bench-te-reference-$k-$NEWEST" "$W/p-$NEWEST" \
      $size --iters "$it" --micro-batch-size "$mbs" --transformer-impl transformer_engine
    log "bench transformer_engine, $k on torch's path: $(cat "$OUT/bench-te-reference-$k-$NEWEST.json")"
  done
  if [ "${BENCH_UNFUSED:-1}" = 1 ]; then
    [ -d "$W/u-$NEWEST" ] || git clone -q -b "$NEWEST" "$W/src" "$W/u-$NEWEST" 2>/dev/null
    train "bench-unfused-$NEWEST" "$W/u-$NEWEST" $size --iters "$it" \
      --micro-batch-size "${UNFUSED_MBS:-8}" --unfused
    log "bench unfused (unpatched tree) mbs ${UNFUSED_MBS:-8}: $(cat "$OUT/bench-unfused-$NEWEST.json")"
  fi
}

stage_fp8() {
  # FP8 on one GPU: the GPU cases of the FP8 tests, scripts/bench/fp8_linear.py,
  # then the 0.85B Llama one run after the other, FP8_RUNS of: bf16, hybrid (tensorwise),
  # delayed (hybrid, the 8B example's delayed scaling: 1024 amaxes, max)
  # (FP8_MBS, FP8_ITERS) on a corpus it cannot memorise (scripts/training/markov_corpus.py, every
  # sample fresh; FP8_DATA=mock for mock data) and their losses compared, the end on the mean
  # of the last 20 iterations (scripts/training/compare_losses.py)
  if [ "${FP8_BENCH:-1}" = 1 ]; then
    (cd "$HERE" && timeout 180 $PY -m pytest -q -p no:cacheprovider -m "gpu or triton" tests/runtime/kernels/test_fp8.py \
       tests/runtime/kernels/test_fp8_cast_transpose.py tests/runtime/kernels/test_fp8_delayed.py \
       tests/runtime/kernels/test_fp8_segments.py tests/runtime/backend/test_fp8_experts.py \
       tests/runtime/backend/test_fp8_recipe.py tests/runtime/backend/test_fp8_param.py \
       tests/runtime/kernels/test_fp8_blockwise.py > "$OUT/fp8-gpu-tests.txt" 2>&1)
    log "fp8 gpu tests: $(tail -1 "$OUT/fp8-gpu-tests.txt")"
    (cd "$HERE" && timeout 150 $PY -m scripts.bench.fp8_linear --shapes 8b,0.85b \
       --json "$OUT/bench-fp8.json" > "$OUT/bench-fp8.txt" 2>&1)
    log "fp8 bench: exit $?"
    (cd "$HERE" && timeout 300 $PY -m megatron_rocm smoke "$W/p-$NEWEST" --only kernels.fp8 \
       training.resume.1gpu_fp8 --json "$OUT/smoke-fp8.json" > "$OUT/smoke-fp8.log" 2>&1)
    log "fp8 smoke checks: exit $? $(tail -1 "$OUT/smoke-fp8.log")"
  fi
  local iters=${FP8_ITERS:-300} mbs=${FP8_MBS:-16} size=${FP8_SIZE:-0.85b}
  local m="--preset llama --preset-size $size --iters $iters --micro-batch-size $mbs --global-batch-size ${FP8_GBS:-$mbs}"
  if [ "${FP8_DATA:-markov}" = markov ]; then
    # the run reads iters x mbs x 2048 tokens of the 94.9% training split: 25% to spare
    if ! (cd "$HERE" && $PY -m scripts.training.markov_corpus "$W/p-$NEWEST" "$W/markov/corpus" \
       --tokens $(( iters * mbs * 2048 * 5 / 4 + 100000 )) > "$OUT/fp8-corpus.json" 2> "$OUT/fp8-corpus.err"); then
      log "fp8 corpus FAILED: $(tail -1 "$OUT/fp8-corpus.err")"; return
    fi
    log "fp8 corpus: $(cat "$OUT/fp8-corpus.json")"
    m="$m --data-path $W/markov/corpus"
  fi
  local run flags runs=${FP8_RUNS-bf16 hybrid delayed}
  for run in $runs; do
    case $run in
      bf16) flags= ;;
      hybrid) flags="-- --fp8-format hybrid --fp8-recipe tensorwise" ;;
      delayed) flags="-- --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 1024 --fp8-amax-compute-algo max" ;;
      blockwise) flags="-- --fp8-format hybrid --fp8-recipe blockwise" ;;
      *) log "fp8: unknown run $run (bf16, hybrid, delayed, blockwise)"; continue ;;
    esac
    train "fp8-$run-$NEWEST" "$W/p-$NEWEST" $m $flags
    log "$size $run: $(cat "$OUT/fp8-$run-$NEWEST.json")"
  done
  for run in $runs; do
    [ "$run" != bf16 ] && [ -f "$OUT/fp8-bf16-$NEWEST.log" ] && [ -f "$OUT/fp8-$run-$NEWEST.log" ] || continue
    compare_run "fp8-compare-$run" "$OUT/fp8-bf16-$NEWEST.log" "$OUT/fp8-$run-$NEWEST.log" \
      "fp8 $run vs bf16 losses"
  done
}

example8b_edit() {  # example8b_edit FILE LINE_ERE SED_EXPR: apply where LINE_ERE finds a line
  grep -Eq -- "$2" "$1" || { log "$(basename "$1" .sh): upstream's example has no line matching '$2'; not run"; return 1; }
  sed -i -e "$3" "$1"
}

stage_fp8resume() {
  # FP8 delayed scaling (the 8B example's history) saves and resumes on 2 GPUs, its amax
  # histories in the checkpoint: torch_dist with upstream's --ckpt-drop-redundant-extra-state
  # (main), torch_dist and the legacy torch format with --fp8-param-gather
  local d="--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max" n=0 spec
  local drop="torch_dist|$d"  # upstream's --ckpt-drop-redundant-extra-state: main only
  [ "$NEWEST" = main ] && drop="$drop --ckpt-drop-redundant-extra-state"
  for spec in "$drop" "torch_dist,torch|$d --fp8-param-gather"; do
    n=$((n + 1))
    (cd "$HERE" && $PY -m scripts.training.validate_distopt_resume "$W/p-$NEWEST" --out "$W/fp8resume$n" \
       --formats "${spec%%|*}" --extra "${spec#*|}" > "$OUT/fp8resume$n.txt" 2>&1)
    log "fp8 resume $n (${spec#*|}): exit $? $(tail -c 400 "$OUT/fp8resume$n.txt" | tr '\n' ' ')"
  done
}

stage_fp8tp2() {
  local iters=${FP8TP_ITERS:-100} run flags recipe
  local d="--fp8-amax-history-len 1024 --fp8-amax-compute-algo max"
  for run in bf16 hybrid delayed; do
    case $run in
      bf16) flags= ;;
      hybrid) flags="-- --fp8-format hybrid --fp8-recipe tensorwise" ;;
      delayed) flags="-- --fp8-format hybrid --fp8-recipe delayed $d" ;;
    esac
    train "fp8tp2-$run-$NEWEST" "$W/p-$NEWEST" --preset llama --iters "$iters" --nproc 2 --tp 2 --sp $flags
    log "tp2 sp $run: $(cat "$OUT/fp8tp2-$run-$NEWEST.json")"
  done
  for run in hybrid delayed; do
    compare_run "fp8tp2-compare-$run" "$OUT/fp8tp2-bf16-$NEWEST.log" \
      "$OUT/fp8tp2-$run-$NEWEST.log" "tp2 sp $run vs bf16 losses"
  done
  # the resume model's FFN (688) splits into 344 columns, not a multiple of FP8's 16: 704
  for recipe in tensorwise delayed; do
    flags="--fp8-format hybrid --fp8-recipe $recipe --tensor-model-parallel-size 2 --sequence-parallel --ffn-hidden-size 704"
    [ "$recipe" = delayed ] && flags="$flags $d"
    (cd "$HERE" && $PY -m scripts.training.validate_distopt_resume "$W/p-$NEWEST" --out "$W/fp8tp2resume-$recipe" \
       --formats torch_dist --extra "$flags" > "$OUT/fp8tp2-resume-$recipe.txt" 2>&1)
    log "tp2 sp $recipe resume: exit $? $(tail -c 400 "$OUT/fp8tp2-resume-$recipe.txt" | tr '\n' ' ')"
  done
}

stage_fp8moe() {
  local iters=${FP8MOE_ITERS:-100} run flags
  local moe="--num-experts 4 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --moe-router-topk 2"
  local fp8="--fp8-format hybrid --fp8-recipe tensorwise"
  for run in bf16-grouped fp8-grouped bf16-sequential fp8-sequential; do
    case $run in
      bf16-grouped) flags="$moe --moe-grouped-gemm" ;;
      fp8-grouped) flags="$moe --moe-grouped-gemm $fp8" ;;
      bf16-sequential) flags="$moe" ;;
      fp8-sequential) flags="$moe $fp8" ;;
    esac
    train "fp8moe-$run-$NEWEST" "$W/p-$NEWEST" --preset llama --iters "$iters" --nproc 2 -- $flags
    log "moe ep2 $run: $(cat "$OUT/fp8moe-$run-$NEWEST.json")"
  done
  for run in grouped sequential; do
    compare_run "fp8moe-compare-$run" "$OUT/fp8moe-bf16-$run-$NEWEST.log" \
      "$OUT/fp8moe-fp8-$run-$NEWEST.log" "moe ep2 $run vs bf16 losses"
  done
  (cd "$HERE" && $PY -m scripts.training.validate_distopt_resume "$W/p-$NEWEST" --out "$W/fp8moeresume" \
     --formats torch_dist --extra "$fp8 $moe --moe-grouped-gemm" > "$OUT/fp8moe-resume.txt" 2>&1)
  log "moe ep2 fp8 resume: exit $? $(tail -c 400 "$OUT/fp8moe-resume.txt" | tr '\n' ' ')"
}

stage_example8b() {
  local src="$W/p-$NEWEST/examples/llama/train_llama3_8b_h100_fp8.sh" gpus run
  [ -f "$src" ] || { log "example8b: no $src (run setup first)"; return; }
  gpus=$($PY -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null)
  [[ $gpus =~ ^[0-9]+$ ]] && ((gpus >= 2)) || { log "example8b: needs 2 GPUs or more (found '$gpus')"; return; }
  local iters=${EX8B_ITERS:-16} batch=$((8 * gpus))
  # the example launches `torchrun` from PATH: the one beside $PY
  local bin
  bin=$(dirname "$(command -v "$PY")")
  local common=(
    '^GPUS_PER_NODE=[0-9]+$' "s/^GPUS_PER_NODE=[0-9][0-9]*\$/GPUS_PER_NODE=$gpus/"
    '^GLOBAL_BATCH_SIZE=[0-9]+$' "s/^GLOBAL_BATCH_SIZE=[0-9][0-9]*\$/GLOBAL_BATCH_SIZE=$batch/"
    '^ *--train-samples [0-9]+ *$' "s/--train-samples [0-9][0-9]*/--train-samples $((iters * batch))/"
    '^ *--lr-decay-samples [0-9]+ *$' "s/--lr-decay-samples [0-9][0-9]*/--lr-decay-samples $((iters * batch))/"
    '^ *--lr-warmup-samples [0-9]+ *$' "s/--lr-warmup-samples [0-9][0-9]*/--lr-warmup-samples $((2 * batch))/"
    '^ *--eval-iters [0-9]+ *$' "s/--eval-iters [0-9][0-9]*/--eval-iters 0/"
    '^ *--profile' '/^ *--profile/d'
    '^ *--save "\$CHECKPOINT_PATH"' '/^ *--save "\$CHECKPOINT_PATH"/d'
    '^ *--load "\$CHECKPOINT_PATH"' '/^ *--load "\$CHECKPOINT_PATH"/d'
  )
  # fp8-no-param-gather: the FP8 run with the distributed optimizer gathering bf16 weights
  local no_param_gather=('^ *"--fp8-param-gather"$' '/^ *"--fp8-param-gather"$/d')
  for run in ${EX8B_RUNS:-bf16 fp8}; do
    local edits=("${common[@]}")
    case $run in
      bf16) edits+=('^DTYPE="fp8"$' 's/^DTYPE="fp8"$/DTYPE="bf16"/') ;;
      fp8) ;;
      fp8-no-param-gather) edits+=("${no_param_gather[@]}") ;;
      fp8-tensorwise|fp8-blockwise)  # blockwise: without --fp8-param-gather (per-tensor only)
        grep -q -- '--fp8-recipe' "$src" && { log "example8b-$run: upstream's example sets --fp8-recipe itself; not run"; continue; }
        [ "$run" = fp8-blockwise ] && edits+=("${no_param_gather[@]}")
        edits+=('^ *"--fp8-format hybrid"$' "s/^\\( *\\)\"--fp8-format hybrid\"\$/&\\n\\1\"--fp8-recipe ${run#fp8-}\"/") ;;
      *) log "example8b: unknown run $run (bf16, fp8, fp8-no-param-gather, fp8-tensorwise, fp8-blockwise)"; continue ;;
    esac
    local name="example8b-$run" script="$OUT/example8b-$run.sh" ok=1 i
    cp "$src" "$script"
    for ((i = 0; i < ${#edits[@]}; i += 2)); do
      example8b_edit "$script" "${edits[i]}" "${edits[i + 1]}" || { ok=0; break; }
    done
    [ "$ok" = 1 ] || { rm -f "$script"; continue; }
    diff "$src" "$script" > "$OUT/$name.diff"
    (cd "$W/p-$NEWEST" && PATH="$bin:$PATH" timeout -k 60 "${EX8B_TIMEOUT:-300}" bash "$script" \
       "$W/ck-$name" "$W/tb-$name" > "$OUT/$name.log" 2>&1)
    local rc=$?
    (cd "$HERE" && $PY -m scripts.training.example_summary "$OUT/$name.log" > "$OUT/$name.json")
    log "$name ($gpus GPUs, global batch $batch): exit $rc $(cat "$OUT/$name.json")"
  done
}

stage_pack() {
  tar czf "$OUT/../all.tgz.part" -C "$OUT" --exclude all.tgz . && mv "$OUT/../all.tgz.part" "$OUT/all.tgz"
  log "packed: $OUT/all.tgz ($(du -h "$OUT/all.tgz" | cut -f1))"
}

profiled() {  # profiled NAME GAPS TRAIN_SMALL_ARGS... -- MEGATRON_ARGS... -> OUT/NAME.md
  # One profiled iteration (the 7th) on the newest patched tree (upstream's own --profile
  # --use-pytorch-profiler), summarised by scripts/training/trace_summary.py: GPU busy vs idle,
  # kernel families, the GAPS longest idle gaps with their launching and host frames.
  local name=$1 gaps=$2; shift 2
  rm -rf "$W/$name" && mkdir -p "$W/$name/tb"
  train "$name-$NEWEST" "$W/p-$NEWEST" --iters 9 "$@" --profile --use-pytorch-profiler \
    --profile-step-start 6 --profile-step-end 7 --tensorboard-dir "$W/$name/tb" \
    $([ "${TRACE_STACKS:-1}" = 1 ] && echo --pytorch-profiler-collect-callstack)
  (cd "$HERE" && $PY -m scripts.training.trace_summary "$W/$name/torch_profile/rank-0.json.gz" \
     --top 40 --gaps "$gaps" > "$OUT/$name.md" 2>&1)
  log "$name: $(head -1 "$OUT/$name.md")"
}

stage_trace() {
  # One profiled iteration of the 0.85B benchmark (TRACE_SIZE: another preset size) per spec
  # (profiled above).
  local size="--preset llama --preset-size ${TRACE_SIZE:-0.85b} --micro-batch-size ${BENCH_MBS:-16}"
  for impl in ${TRACE_IMPLS:-transformer_engine local}; do
    profiled "trace-$impl" 20 $size --transformer-impl "$impl" -- \
      ${TRACE_FLAGS:---cross-entropy-loss-fusion --manual-gc}
  done
}

clocks_start() {  # clocks_start NAME -> the sampler's pid (empty without nvidia-smi)
  # the SM clock, power and what held the clock of the GPU the runs use (the first of
  # CUDA_VISIBLE_DEVICES, else 0), every 250 ms, into OUT/NAME-smi.csv (its errors: .err)
  command -v nvidia-smi > /dev/null || return 0
  local gpu=${CUDA_VISIBLE_DEVICES:-0}
  nvidia-smi -i "${gpu%%,*}" --format=csv -lms 250 \
    --query-gpu=timestamp,clocks.sm,clocks.max.sm,power.draw,power.limit,clocks_event_reasons.active \
    > "$OUT/$1-smi.csv" 2> "$OUT/$1-smi.err" &
  echo $!
}

clocks_stop() {  # clocks_stop NAME PID: stop the sampler, log power_summary.py's line
  [ -n "$2" ] || return 0
  kill "$2" 2> /dev/null || log "$1 clocks: the sampler had stopped ($(head -c 200 "$OUT/$1-smi.err"))"
  log "$1 clocks: $(cd "$HERE" && $PY -m scripts.training.power_summary "$OUT/$1-smi.csv" \
    --json "$OUT/$1-power.json" 2>&1)"
}

stage_mfu() {
  # Issue 45's 0.85B on one GPU: what upstream's flags that take host work out of the step
  # change, the clock the GPU holds meanwhile, the GEMM + attention ceilings, and where one
  # profiled iteration's time goes (the header says which variable picks what).
  local size="--preset llama --preset-size 0.85b --micro-batch-size 16 --global-batch-size 16"
  # example: the performance flags of upstream's 8B example (examples/llama/) that apply to
  # one GPU with mock data
  local example="--cross-entropy-loss-fusion --manual-gc --no-create-attention-mask-in-dataloader"
  local -A flags=(
    [base]=""
    [example]="$example"
    [graphs]="$example --cuda-graph-impl local"
    [full-iteration]="$example --cuda-graph-impl full_iteration --no-check-for-nan-in-loss-and-grad"
    [optimizer-graph]="$example --optimizer-cuda-graph"
    [distopt]="$example --use-distributed-optimizer"
    [distopt-graph]="$example --use-distributed-optimizer --optimizer-cuda-graph"
  )
  local smi="" runs=${MFU_RUNS-base example graphs full-iteration optimizer-graph}
  [ -z "$runs" ] || smi=$(clocks_start mfu)
  for run in $runs; do
    [ -n "${flags[$run]+set}" ] || { log "mfu: unknown run $run"; continue; }
    train "mfu-$run-$NEWEST" "$W/p-$NEWEST" $size --iters "${MFU_ITERS:-40}" -- ${flags[$run]}
    log "mfu $run: $(cat "$OUT/mfu-$run-$NEWEST.json")"
  done
  clocks_stop mfu "$smi"
  # the GEMM + attention ceiling of a micro-batch, the 0.85B's against the example run's time
  # (MFU_CEILINGS=0: not this time)
  if [ "${MFU_CEILINGS:-1}" = 1 ]; then
    local measured_ms
    measured_ms=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))['mean_iter_ms'] or '')" \
      "$OUT/mfu-example-$NEWEST.json" 2>/dev/null)
    for model in 0.85b 8b; do
      smi=$(clocks_start "ceiling-$model")
      (cd "$HERE" && $PY -m scripts.bench.step_ceiling --model $model \
         --sustained "${MFU_SUSTAINED:-10}" \
         $([ $model = 0.85b ] && [ -n "$measured_ms" ] && echo --measured-ms "$measured_ms") \
         --json "$OUT/ceiling-$model.json" > "$OUT/ceiling-$model.txt" 2>&1)
      clocks_stop "ceiling-$model" "$smi"
      log "ceiling $model: $( (grep "^$model:" "$OUT/ceiling-$model.txt" \
        || tail -1 "$OUT/ceiling-$model.txt") | tr '\n' ' ')"
    done
  fi
  local run=${MFU_TRACE:-example}  # none: no trace
  [ "$run" = none ] || profiled "mfu-trace-$run" 40 $size -- ${flags[$run]}
}

stage_smoke() {
  $PY -m megatron_rocm smoke "$W/p-$NEWEST" --json "$OUT/smoke-$NEWEST.json" \
    --junit "$OUT/smoke-$NEWEST.xml" > "$OUT/smoke-$NEWEST.log" 2>&1
  log "smoke $NEWEST: exit $? $(tail -1 "$OUT/smoke-$NEWEST.log")"
}

stage_kernels() {
  rm -f "$OUT/gpu-tests.json"
  (cd "$HERE" && $PY -m scripts.gpu_tests --out "$W/gpu-tests" --procs "${GPU_TESTS_PROCS:-3}" \
     --timeout "${GPU_TESTS_TIMEOUT:-480}" > "$OUT/gpu-tests.txt" 2>&1)
  log "gpu tests: exit $? $(grep -E '^[0-9]+ passed' "$OUT/gpu-tests.txt") $(tail -1 "$OUT/gpu-tests.txt")"
  cp "$W/gpu-tests/summary.json" "$OUT/gpu-tests.json" 2>/dev/null
  (cd "$HERE" && timeout 120 $PY -m scripts.bench.rope --json "$OUT/bench-rope.json" > "$OUT/bench-rope.txt" 2>&1)
  (cd "$HERE" && timeout 120 $PY -m scripts.bench.swiglu --tree "$W/p-$NEWEST" \
     --json "$OUT/bench-swiglu.json" > "$OUT/bench-swiglu.txt" 2>&1)
  (cd "$HERE" && timeout 180 $PY -m scripts.bench.grouped_gemm > "$OUT/bench-grouped.txt" 2>&1)
  (cd "$HERE" && timeout 120 $PY -m scripts.bench.attention --json "$OUT/bench-attention.jsonl" \
     > "$OUT/bench-attention.txt" 2>&1)
  (cd "$HERE" && timeout 120 $PY -m scripts.bench.grouped_gemm --profile > "$OUT/bench-grouped-profile.txt" 2>&1)
  (cd "$HERE" && timeout 150 $PY -m scripts.bench.packed_attention > "$OUT/bench-packed.txt" 2>&1)
  log "kernel benchmarks: see bench-*.txt"
}

stage_cp2() {
  local long="--preset llama --iters ${CP_ITERS:-30} --micro-batch-size 1 --global-batch-size 8"
  train "te-llama-cp2-8k-$NEWEST" "$W/p-$NEWEST" $long --nproc 2 --cp 2 --seq-length 8192
  train "te-llama-cp2-16k-$NEWEST" "$W/p-$NEWEST" $long --nproc 2 --cp 2 --seq-length 16384
  train "te-llama-cp1-8k-$NEWEST" "$W/p-$NEWEST" $long --nproc 1 --seq-length 8192
  for n in cp2-8k cp2-16k cp1-8k; do log "te-llama-$n: $(cat "$OUT/te-llama-$n-$NEWEST.json")"; done
  (cd "$HERE" && timeout 200 $PY -m pytest -q -p no:cacheprovider -m gpu \
     tests/runtime/backend/cp/test_context_parallel.py > "$OUT/cp-gpu-tests.txt" 2>&1)
  log "cp gpu tests: $(tail -1 "$OUT/cp-gpu-tests.txt")"
  (cd "$HERE" && timeout 200 $PY -m torch.distributed.run --standalone --nproc-per-node 2 \
     -m scripts.bench.cp_attention --json "$OUT/bench-cp.jsonl" > "$OUT/bench-cp.txt" 2>&1)
  log "cp bench: $(wc -l < "$OUT/bench-cp.jsonl" 2>/dev/null) rows"
}

stage_moe2() {
  local moe="--num-experts 4 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --moe-router-topk 2"
  train "te-moe-ep2-grouped-$NEWEST" "$W/p-$NEWEST" --preset llama --nproc 2 --iters "$ITERS" \
    -- $moe --moe-grouped-gemm
  train "te-moe-ep2-sequential-$NEWEST" "$W/p-$NEWEST" --preset llama --nproc 2 --iters "$ITERS" \
    -- $moe
  for n in grouped sequential; do log "te-moe-ep2-$n: $(cat "$OUT/te-moe-ep2-$n-$NEWEST.json")"; done
}

stage_mla() {
  local mla="--multi-latent-attention --q-lora-rank 384 --kv-lora-rank 256 --qk-head-dim 64"
  mla="$mla --qk-pos-emb-head-dim 32 --v-head-dim 64 --normalization RMSNorm --swiglu --disable-bias-linear"
  train "te-mla-fused-rope-$NEWEST" "$W/p-$NEWEST" --preset gpt --iters "$ITERS" -- $mla \
    --position-embedding-type rope
  train "te-mla-$NEWEST" "$W/p-$NEWEST" --preset gpt --iters "$ITERS" -- $mla
  for n in te-mla-fused-rope te-mla; do log "$n: $(cat "$OUT/$n-$NEWEST.json")"; done
  (cd "$W/p-$NEWEST" && PYTHONPATH="$W/p-$NEWEST:$PYTHONPATH" timeout 300 $PY -m torch.distributed.run \
     --nproc-per-node 1 -m pytest -q -p no:cacheprovider -m "" \
     tests/unit_tests/fusions/test_mla_yarn_rope_apply.py > "$OUT/mla-rope-tests.txt" 2>&1)
  log "fused MLA RoPE tests (experimental included): $(tail -1 "$OUT/mla-rope-tests.txt")"
}

units_two_ranks() {  # units_two_ranks NAME [--paths ...]: unpatched vs patched newest ref
  # (UNIT_NPROC ranks per test process, default 2)
  local name=$1; shift
  rm -rf "$W/u-$NEWEST" && git clone -q -b "$NEWEST" "$W/src" "$W/u-$NEWEST" 2>/dev/null
  (cd "$HERE" && $PY scripts/upstream_unit_tests.py run --tree "u-$NEWEST=$W/u-$NEWEST" \
     --tree "p-$NEWEST=$W/p-$NEWEST" --out "$OUT/$name" --nproc "${UNIT_NPROC:-2}" --jobs "${UNIT_JOBS:-8}" \
     --timeout 120 --budget "${UNIT_BUDGET:-420}" "$@" > "$OUT/$name.log" 2>&1)
  (cd "$HERE" && $PY scripts/upstream_unit_tests.py compare "$OUT/$name/u-$NEWEST/results.json" \
     "$OUT/$name/p-$NEWEST/results.json" --md "$OUT/$name-compare.md" > /dev/null 2>&1)
  log "$name: $(tail -2 "$OUT/$name.log" | tr '\n' ' ')"
}

stage_units2() {
  units_two_ranks units
}

stage_mimo2() {
  UNIT_JOBS=${UNIT_JOBS:-4} units_two_ranks mimo --paths tests/unit_tests/models/mimo
}

stage_upx1() {
  UNIT_NPROC=1 UNIT_BUDGET=${UPX_BUDGET:-470} units_two_ranks upx1 --suite dist_checkpointing --suite models
}

stage_paths() {
  # upstream's test files UNIT_PATHS (space-separated, relative to the tree), unpatched vs
  # patched newest ref, UNIT_NPROC ranks (default 2): e.g. the tests of a new patch
  [ -n "${UNIT_PATHS:-}" ] || { log "paths: set UNIT_PATHS"; return; }
  units_two_ranks paths --paths $UNIT_PATHS
}

stage_upx2() {
  UNIT_BUDGET=${UPX_BUDGET:-470} units_two_ranks upx2 --suite dist_checkpointing --suite models
}

stage_upx4() {
  UNIT_NPROC=4 UNIT_BUDGET=${UPX_BUDGET:-470} units_two_ranks upx4 --suite dist_checkpointing --suite models
}

stage_packedcp() {
  (cd "$HERE" && PYTHONUNBUFFERED=1 timeout -s INT 300 $PY -m pytest -v -p no:cacheprovider -m gpu \
     -o faulthandler_timeout=120 tests/runtime/backend/packed/test_packed_context_parallel.py \
     tests/runtime/backend/cp/test_context_parallel.py > "$OUT/packedcp-gpu-tests.txt" 2>&1)
  log "packed/cp gpu tests: $(tail -1 "$OUT/packedcp-gpu-tests.txt")"
  (cd "$HERE" && timeout 240 $PY -m torch.distributed.run --standalone --nproc-per-node 2 \
     -m scripts.bench.cp_attention --kernels auto,cudnn:expanded,flash --ops 12 \
     --json "$OUT/bench-cp-kernels.jsonl" > "$OUT/bench-cp-kernels.txt" 2>&1)
  log "cp bench (auto's, cuDNN's with expanded kv heads, flash blocks): $(wc -l < "$OUT/bench-cp-kernels.jsonl" 2>/dev/null) rows"
  timeout 300 $PY -m megatron_rocm smoke "$W/p-$NEWEST" --only parallel.cp2 parallel.cp2_packed \
    --json "$OUT/smoke-packedcp-$NEWEST.json" > "$OUT/smoke-packedcp-$NEWEST.log" 2>&1
  log "smoke cp2 / cp2_packed $NEWEST: exit $? $(tail -1 "$OUT/smoke-packedcp-$NEWEST.log")"
  (cd "$W/p-$NEWEST" && PYTHONPATH="$W/p-$NEWEST:$PYTHONPATH" timeout 300 $PY -m torch.distributed.run \
     --nproc-per-node 2 -m pytest -q -p no:cacheprovider tests/unit_tests/test_sequence_packing.py \
     > "$OUT/sequence-packing-tests.txt" 2>&1)
  log "upstream test_sequence_packing.py, 2 ranks: $(tail -1 "$OUT/sequence-packing-tests.txt")"
}

stage_par4() {
  local long="--preset llama --iters ${PAR4_ITERS:-20} --micro-batch-size 1 --global-batch-size 8"
  long="$long --seq-length 16384 --"
  local flags="--no-create-attention-mask-in-dataloader"
  local moe="--num-experts 4 --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall"
  moe="$moe --moe-router-topk 2 --moe-grouped-gemm --use-distributed-optimizer"
  local R n
  for R in "${REFS[@]}"; do
    for n in ${PAR4_RUNS:-cp1 tp2 tp2cp2 cp4 moe}; do
      case $n in
        cp1) train "par4-$n-$R" "$W/p-$R" --nproc 1 $long $flags ;;
        tp2) train "par4-$n-$R" "$W/p-$R" --nproc 2 --tp 2 --sp $long $flags ;;
        tp2cp2) train "par4-$n-$R" "$W/p-$R" --nproc 4 --tp 2 --cp 2 --sp $long $flags ;;
        cp4) train "par4-$n-$R" "$W/p-$R" --nproc 4 --cp 4 $long $flags ;;
        moe) [ "$R" = "$NEWEST" ] || continue
             train "par4-$n-$R" "$W/p-$R" --preset llama --nproc 4 --iters "${PAR4_ITERS:-20}" -- $moe ;;
        *) log "par4: unknown run $n (PAR4_RUNS: cp1 tp2 tp2cp2 cp4 moe)"; continue ;;
      esac
      log "par4-$n-$R: $(cat "$OUT/par4-$n-$R.json")"
    done
    # each CP layout against the same layout without CP: TP=2 draws other initial weights
    for n in tp2cp2:tp2 cp4:cp1; do
      [ -f "$OUT/par4-${n%:*}-$R.log" ] && [ -f "$OUT/par4-${n#*:}-$R.log" ] || continue
      log "par4-${n%:*}-$R losses vs ${n#*:}: $(cd "$HERE" && $PY -m scripts.training.compare_losses \
        "$OUT/par4-${n#*:}-$R.log" "$OUT/par4-${n%:*}-$R.log" 2>&1)"
    done
  done
}

SMOKE4=(parallel.tp2_pp2_vpp parallel.tp2_cp2 parallel.ep4_moe parallel.dp4_distopt_overlap
        training.resume.dp4_distopt training.resume.tp2_pp2_vpp)
stage_scale4() {
  local R
  for R in "${REFS[@]}"; do
    (cd "$HERE" && $PY -m scripts.training.validate_par4 "$W/p-$R" --out "$W/scale4-$R" \
       --iters "${SCALE4_ITERS:-30}" ${SCALE4_RUNS:+--runs "$SCALE4_RUNS"} \
       --preset-size "${SCALE4_SIZE:-small}" \
       --run-timeout "${SCALE4_TIMEOUT:-240}" \
       --table "$OUT/scale4-$R.md" > "$OUT/scale4-$R.jsonl" 2> "$OUT/scale4-$R.err")
    log "scale4 $R: exit $? $(tail -1 "$OUT/scale4-$R.jsonl")"
    mkdir -p "$OUT/scale4-$R" && cp "$W/scale4-$R"/*.log "$OUT/scale4-$R/" 2>/dev/null
    [ "${SCALE4_SMOKE:-1}" = 1 ] || continue
    $PY -m megatron_rocm smoke "$W/p-$R" --only "${SMOKE4[@]}" --json "$OUT/smoke4-$R.json" \
      > "$OUT/smoke4-$R.log" 2>&1
    log "smoke4 $R: exit $? $(tail -1 "$OUT/smoke4-$R.log")"
  done
}

stage_moebench() {
  local experts=${MOE_EXPERTS:-8 64}
  (cd "$HERE" && $PY -m scripts.bench.moe_experts "$W/p-$NEWEST" --experts $experts \
     --json "$OUT/moe-experts.jsonl" > "$OUT/moe-experts.out" 2>&1)
  (cd "$HERE" && $PY -m scripts.bench.grouped_gemm --experts $experts \
     > "$OUT/grouped-gemm.jsonl" 2> "$OUT/grouped-gemm.err")
  log "moebench: $(grep -c . "$OUT/moe-experts.jsonl" 2>/dev/null || echo 0) module records, $(grep -c '"ms"' "$OUT/grouped-gemm.jsonl") GEMM records"
}

stage_cpscale() {
  # Issue 11's CP throughput, every run in one call on the same GPUs: CP=2 at CP_LENGTH (default
  # 16384) against CP=1 at half of it (the issue's pair) and at CP_LENGTH (the same work on one
  # GPU), the ring's blocks on auto's kernel (cuDNN on NVIDIA) and on flash's
  # (MEGATRON_ROCM_CP_KERNEL=flash), and --cp-comm-type a2a. CP_SIZE picks the Llama preset
  # (small, or 0.85b: the small model's iteration is host-bound, docs/performance.md); CP_FLAGS
  # go to pretrain_gpt.py: docs/performance.md's CP rows use
  # --no-create-attention-mask-in-dataloader (long-context runs switch the s x s mask off) and
  # upstream's recipe flags --cross-entropy-loss-fusion --manual-gc, without which Python's GC
  # and the unfused loss add ~0.6 s per 0.85B iteration, plus the rest of upstream's H100
  # recipe for CP (examples/llama/train_llama3_8b_h100_fp8.sh): --use-distributed-optimizer
  # --overlap-grad-reduce --overlap-param-gather --grad-reduce-in-bf16.
  local L=${CP_LENGTH:-16384} size=${CP_SIZE:-small}
  local tag="$size-$((L / 1024))k" half=$((L / 2))
  local long="--preset llama --preset-size $size --iters ${CP_ITERS:-20} --micro-batch-size 1"
  long="$long --global-batch-size 8"
  local runs=(${CP_RUNS:-cp1-half cp1 cp2 cp2-flash cp2-a2a}) run n gpu name args extra kernel
  for run in "${runs[@]}"; do
    n=${run%@*} gpu="" name=$run
    [[ $run == *@* ]] && gpu=${run#*@} name="$n-gpu$gpu"
    args="--nproc 2 --cp 2 --seq-length $L" extra="" kernel=${MEGATRON_ROCM_CP_KERNEL:-auto}
    case $n in
      cp1-half) args="--nproc 1 --seq-length $half" ;;
      cp1) args="--nproc 1 --seq-length $L" ;;
      cp2) ;;
      cp2-flash) kernel=flash ;;
      cp2-a2a) extra="--cp-comm-type a2a" ;;
      *) log "cpscale: unknown run $n (CP_RUNS: cp1-half cp1 cp2 cp2-flash cp2-a2a)"; continue ;;
    esac
    if [[ -n $gpu && ( $args != "--nproc 1 "* || ! $gpu =~ ^[0-9]+(\+[0-9]+)*$ ) ]]; then
      log "cpscale: $run: only a one-GPU run takes @GPU or @GPU+GPU..., GPU numbers"; continue
    fi
    local gpus=(${gpu//+/ }) names=() pids=() one
    if [ ${#gpus[@]} -le 1 ]; then names=("$name"); else
      for one in "${gpus[@]}"; do names+=("$n-gpu$one-beside-${gpu//+/-}"); done
    fi
    for i in "${!names[@]}"; do  # several GPUs: one process each, all at once
      (if [ -n "$gpu" ]; then export CUDA_VISIBLE_DEVICES=${gpus[$i]}; fi
       MEGATRON_ROCM_CP_KERNEL=$kernel train "cpscale-$tag-${names[$i]}-$NEWEST" "$W/p-$NEWEST" \
         $long $args -- $extra ${CP_FLAGS:-}) & pids+=($!)
    done
    wait "${pids[@]}"
    for one in "${names[@]}"; do log "cpscale-$tag-$one: $(cat "$OUT/cpscale-$tag-$one-$NEWEST.json")"; done
  done
}

stage_series() {  # apply -> unpatched/patched training -> install + smoke -> throughput
  local SRC=${SOURCE:-$W/src} W=${SERIES_WORK:-/tmp/mrocm-validate}
  local REFS=(${SERIES_REFS:-core_v0.12.0 core_v0.14.0 core_v0.16.0 core_v0.19.0 main})
  local R pids=() flag=() kind side tree err f T MBS=() SMOKE_REFS=()
  mkdir -p "$W"
  for R in "${REFS[@]}"; do
    $PY -m megatron_rocm apply --source "$SRC" --ref "$R" --dest "$W/p-$R" --json > "$OUT/apply-$R.json" \
      && log "apply $R: ok" || log "apply $R: FAILED"
    git clone -q "$SRC" "$W/u-$R" && git -C "$W/u-$R" checkout -q "$R"
  done

  # Unpatched (default flags) and patched small GPT runs, all at once on the one GPU.
  local NEWEST=${REFS[$((${#REFS[@]} - 1))]}
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
}

tiers_smoke_one() {  # tiers: the suite and its fault proof on one ref
  local R=$1 W=$2
  (cd "$HERE" && $PY -m megatron_rocm smoke "$W/p-$R" --json "$OUT/smoke-$R.json" \
     --junit "$OUT/smoke-$R.xml" > "$OUT/smoke-$R.txt" 2>&1)
  log "smoke $R: exit $? ($(tail -1 "$OUT/smoke-$R.txt"))"
  (cd "$HERE" && MEGATRON_ROCM_SMOKE_FAULT=resume $PY -m megatron_rocm smoke "$W/p-$R" \
     --only training.resume.1gpu.local > "$OUT/fault-$R.txt" 2>&1)
  log "fault=resume $R: exit $? (1 expected) ($(grep -m1 'training.resume' "$OUT/fault-$R.txt"))"
}

stage_tiers() {  # apply -> install -> smoke tiers, the fault proof, distopt resume, the table
  local SRC=${SOURCE:-$W/src} W=${TIERS_WORK:-/tmp/mrocm-smoke-tiers}
  local REFS=(${TIERS_REFS:-core_v0.12.0 core_v0.16.0 core_v0.19.0 main})
  local R DREFS
  mkdir -p "$W"
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

  local running=0 args=()
  for R in "${REFS[@]}"; do
    [ -d "$W/p-$R" ] || continue
    tiers_smoke_one "$R" "$W" &
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

  for R in "${REFS[@]}"; do [ -f "$OUT/smoke-$R.json" ] && args+=("$R=$OUT/smoke-$R.json"); done
  [ ${#args[@]} -gt 0 ] && $PY "$HERE/scripts/smoke_table.py" "${args[@]}" > "$OUT/smoke-table.md" \
    && log "table: $OUT/smoke-table.md"
}

for stage in "$@"; do
  log "== stage $stage"
  "stage_$stage"
done
log "done"
