#!/usr/bin/env bash
# Several GPU stages in one run, each under its own time budget, their results packed into one archive.
# Run from the repository root on a GPU host:
#
#   bash scripts/gpu_suite.sh STAGE[:SECONDS] ...
#
# Each STAGE gets SECONDS (its default below when left out); every step inside runs under `timeout`,
# capped so that the stage ends within its budget and leaves its partial logs. Stages run in the order
# given and share one work folder, so `bench-prefill` after `tune-prefill` reads the DB it tuned.
# Everything a run produces is packed into one archive, $TRITUNE_SUITE_OUT/suite.tgz, with
# $TRITUNE_SUITE_OUT/summary.log beside it (TRITUNE_SUITE_OUT defaults to build/suite): one file to copy
# back from a remote GPU host.
#
# STAGE          default s  runs                                                          leaves (inside the archive)
# tests              300    the kernel test files in shards: attention in 10, then Q4_K  tests/test-*.log, .xml
#                           in 8 (GPU tier included; 64 s and 72 s on an H200)
# tune-prefill       300    tune tma_prefill at the seven benchmark shapes' keys           tune-prefill.sqlite, <gpu>.json
# prefill-defaults   330    tune tma_prefill over every default key (D 64/128), then the   tune-prefill.sqlite, <gpu>.json
#                           square-16K keys, then the defaults again at 4 trials more (the
#                           neighbours' winners), resuming $TRITUNE_SUITE_RESUME/tune-prefill.sqlite
#                           (keys done there are kept; PREFILL_FRESH=1: from an empty DB)
# bench-prefill      200    scripts/bench_prefill.py on tune-prefill's DB                  <date>-tma_prefill-<gpu>.md/.json
# decode             210    tune splitk_decode (D 128, B 1/8/32/64, Lkv 4K/32K/128K),     decode-tune.sqlite, <gpu>.json,
#                           then scripts/bench_decode.py                                   <date>-splitk_decode-<gpu>.md/.json
# varlen             150    tune varlen_sdpa (D 128), then scripts/bench_varlen.py         varlen-tune.sqlite, ...
# q4k                240    tune q4k_fp8_gemm (M 1/16/4096, Llama shapes), then bench     q4k-tune.sqlite, ...
# overhead            60    scripts/measure_overhead.py --profile                          <date>-overhead-<gpu>.md
# model              480    scripts/bench_model.py --profile: the Llama-3-8B shape end to   <date>-model-llama3-8b-<gpu>.md/.json
#                           end against plain PyTorch bf16 ($MODEL_ARGS adds arguments)
# jit                480    scripts/bench_jit.py: online tuning on one workload against    <date>-jit-<gpu>.md
#                           offline tune, provisional serving, tune --missed ($JIT_ARGS)
# tuner              200    scripts/bench_tuner.py: injected fault, rank stability,        <date>-tuner-<gpu>.md/.json
#                           one vs two workers on one shared study
# multigpu           480    bench_tuner.py multigpu (a host with 2+ GPUs):                 <date>-multigpu-<gpu>.md/.json
#                           tune --device 0 vs --device all, tma_prefill + splitk_decode
#                           (D 128, Lkv 16K, 28 trials per key), NVML utilization of every
#                           GPU, winners re-timed together; MULTIGPU_ARGS adds arguments
# defaults           540    tune each of $DEFAULTS_KERNELS (default: splitk_decode varlen_sdpa       <kernel>-defaults.sqlite,
#                           q4k_fp8_gemm) over its default keys ($DEFAULTS_TUNE_ARGS, default    <kernel>-<gpu>.json
#                           --trials 16 --time-budget 8), resuming $TRITUNE_SUITE_RESUME/<kernel>-defaults.sqlite
# retune             560    tune --bundled: the shipped bundle's keys, each seeded from its winner      retune.sqlite, retune-<gpu>.json,
#                           ($RETUNE_KERNELS, default all four; $RETUNE_ARGS, default --trials 5   <date>-bundle-compare-<gpu>.md
#                           --time-budget 3), resuming $TRITUNE_SUITE_RESUME/retune.sqlite, then
#                           scripts/compare_bundles.py against the shipped bundle
# bench-decode       150    scripts/bench_decode.py / bench_varlen.py / bench_q4k.py on the defaults   <date>-<kernel>-<gpu>.md/.json
# bench-varlen       120    stage's DB ($work/<kernel>-defaults.sqlite from a defaults stage earlier in
# bench-q4k          150    the run, else $TRITUNE_SUITE_RESUME/<kernel>-defaults.sqlite); *_BENCH_ARGS as below
# stability          200    bench_tuner.py stability only, 40 trials (tune's default),     <date>-stability-<gpu>.md/.json
#                           for $STABILITY_KERNELS (default: tma_prefill varlen_sdpa)
# pytest              90    pytest on $PYTEST_GPU_ARGS (a selection: files, -k ...)        tests/pytest.log, .xml
# gpu-tests          360    the GPU tier (-m gpu): attention files, every other file, and  tests/gpu-*.log, .xml
#                           3 Q4_K shards, all at once
# sweep              300    scripts/sweep_configs.py over the $SWEEPS entries              <date>-sweep-<name>-<gpu>.md/.json
#                           ("kernel|name|key json|where filters|limit", joined by ";";
#                           default: two Q4_K keys, staged at M=4096 and portable at M=16)
# smoke             1800    decode + q4k + varlen steps on the CPU (Triton interpreter,   smoke-*
#                           tiny shapes): a dry run of this script without a GPU
#
# Folders: TRITUNE_SUITE_OUT (default build/suite) receives the archive and the summary;
# TRITUNE_SUITE_WORK (default /tmp/tritune-suite) is the stages' shared work folder; TRITUNE_SUITE_RESUME
# (default build/suite-resume, git-ignored) holds DBs from an earlier run for the tune and bench stages to
# resume (copy a returned <kernel>-defaults.sqlite or tune-prefill.sqlite there). bench-prefill reads the
# DB from PREFILL_DB if set, else the work folder, else $TRITUNE_SUITE_RESUME/tune-prefill.sqlite.
# The exit status is 1 if any step failed, timed out or was skipped for lack of time.
# DECODE_BENCH_ARGS / Q4K_BENCH_ARGS / VARLEN_BENCH_ARGS add benchmark arguments; DECODE_TUNE_ARGS /
# Q4K_TUNE_ARGS / VARLEN_TUNE_ARGS replace the tunes' trial and time options, and DECODE_TUNE_CAP /
# Q4K_TUNE_CAP / VARLEN_TUNE_CAP their caps in seconds.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

declare -A DEFAULT_BUDGET=(
  [tests]=300 [tune-prefill]=300 [bench-prefill]=200 [decode]=210 [varlen]=150 [q4k]=240 [overhead]=60
  [tuner]=200 [multigpu]=480 [smoke]=1800 [prefill-defaults]=330 [stability]=200 [pytest]=90 [defaults]=540
  [bench-decode]=150 [bench-varlen]=120 [bench-q4k]=150 [gpu-tests]=360 [sweep]=300 [model]=480 [jit]=480
  [retune]=560
)
if (($# == 0)); then
  echo "usage: bash scripts/gpu_suite.sh STAGE[:SECONDS] ... (stages: ${!DEFAULT_BUDGET[*]})" >&2
  exit 2
fi
for arg in "$@"; do
  if [ -z "${DEFAULT_BUDGET[${arg%%:*}]+x}" ]; then
    echo "unknown stage ${arg%%:*} (stages: ${!DEFAULT_BUDGET[*]})" >&2
    exit 2
  fi
done

final_out=${TRITUNE_SUITE_OUT:-build/suite}
work=${TRITUNE_SUITE_WORK:-/tmp/tritune-suite}
resume=${TRITUNE_SUITE_RESUME:-build/suite-resume}
results="$work/results"
mkdir -p "$final_out" "$results"
export PYTHONUNBUFFERED=1
summary="$final_out/summary.log"
status=0
today=$(date -u +%F)

# The CLI through python (the `tune` console script may not be on PATH after an editable install).
TUNE_PY='import sys; from tritune.tuner.cli import main; sys.argv[0] = "tune"; main()'
# One self-contained SQLite file (the WAL folded in, journal mode DELETE): what goes into the archive.
SNAPSHOT_PY='
import sqlite3, sys
src, dst = sqlite3.connect(sys.argv[1]), sqlite3.connect(sys.argv[2])
src.backup(dst)
dst.execute("PRAGMA journal_mode=DELETE")
dst.close()
src.close()
print(f"snapshot of {sys.argv[1]} written to {sys.argv[2]}")
'
ENV_PY='
import platform, torch, triton
cuda = torch.cuda.is_available()
cudnn = torch.backends.cudnn.version() if cuda else None
print(f"torch {torch.__version__} | triton {triton.__version__} | CUDA {torch.version.cuda} | cuDNN {cudnn} | "
      f"Python {platform.python_version()}")
if cuda:
    p = torch.cuda.get_device_properties(0)
    print(f"GPU 0: {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB")
'

note() {
  echo "[suite $(date -u +%H:%M:%S)] $*" | tee -a "$log" "$summary"
}

# step NAME CAP_SECONDS COMMAND...: run COMMAND under timeout (the smaller of CAP and the stage's time left).
step() {
  local name=$1 cap=$2
  shift 2
  # Keep 10 s for timeout's kill grace and the stage's closing lines.
  local left=$((deadline - $(date +%s) - 10))
  local limit=$((cap < left ? cap : left))
  if ((limit < 10)); then
    note "SKIPPED $name: ${left}s left of the stage budget"
    status=1
    return 1
  fi
  note "$name (limit ${limit}s): $*"
  timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  case $rc in
    0) note "$name: ok" ;;
    124 | 137) note "$name: TIMED OUT after ${limit}s (partial output above)" ;;
    *) note "$name: FAILED with exit status $rc" ;;
  esac
  ((rc == 0)) || status=1
  return "$rc"
}

# The GPU's slug, read once (a python start each time would cost seconds); the interpreter's for smoke.
SLUG_PY='import torch; from tritune.kernels.device import device_info
print(device_info(0).slug if torch.cuda.is_available() else "no-gpu")'
cuda_slug=""
gpu_slug() {
  if [ "$stage" = smoke ]; then
    echo cpu-interpreter
  else
    echo "${cuda_slug:-unknown-gpu}"
  fi
}

# The arguments a benchmark needs to read DB $1, or none (with a warning) when no tune left one.
db_args() {
  if [ -f "$1" ]; then
    echo "--db $1"
  else
    note "WARNING: no DB at $1: tuned rows show only the shipped bundles / portable defaults" >&2
  fi
}

# tune_and_export DB KERNEL TUNE-ARGS...: tune into DB, then leave a snapshot and the GPU's bundle in $results.
tune_and_export() {
  local db=$1 kernel=$2
  shift 2
  step "tune $kernel" "$@"
  if [ -f "$db" ]; then
    step "snapshot $kernel" 60 python -c "$SNAPSHOT_PY" "$db" "$results/$(basename "$db")"
    step "export $kernel" 60 python -c "$TUNE_PY" export --gpu "$(gpu_slug)" --db "$db" \
      --out "$results/$kernel-$(gpu_slug).json"
  else
    note "tune $kernel wrote no DB"
    status=1
  fi
}

# The test ids listed in $1 as $2 pytest shards started in the background, named $3 (logs and
# junit XML in $results/tests); their pids join the calling stage's pids array. xargs -r: an empty
# shard runs nothing (a bare pytest would run the whole tests folder).
start_shards() {
  local list=$1 count=$2 name=$3 shard
  for ((shard = 0; shard < count; shard++)); do
    awk -v s="$shard" -v n="$count" 'NR % n == s' "$list" >"$list.$shard"
    step "pytest $name shard $shard" $((budget - 10)) xargs -r -a "$list.$shard" \
      python -m pytest -q -p no:cacheprovider -rf --tb=short --junitxml="$results/tests/$name-$shard.xml" \
      >"$results/tests/$name-$shard.log" 2>&1 &
    pids+=($!)
  done
}

run_stage() {
  case "$stage" in
    tests)
      # Every test of the kernel files (the GPU tier and the device-fixture tests, which run on cuda
      # here), in shards: first the attention files in 10, then the Q4_K file in 8. Compiling is most
      # of the time, and 16 cores take that many processes: 64 s and 72 s on an H200.
      mkdir -p "$results/tests"
      local pids=() group files
      for group in attention q4k; do
        if [ "$group" = attention ]; then
          files=(tests/test_prefill.py tests/test_decode.py tests/test_decode_spec.py tests/test_varlen.py
            tests/test_varlen_cache.py tests/test_varlen_contract.py)
        else
          files=(tests/test_q4k.py)
        fi
        python -m pytest --collect-only -q -p no:cacheprovider "${files[@]}" 2>/dev/null | grep '::' \
          >"$work/$group-tests.txt"
        pids=()
        if [ -s "$work/$group-tests.txt" ]; then
          start_shards "$work/$group-tests.txt" $([ "$group" = attention ] && echo 10 || echo 8) "test-$group"
        else
          # Collection listed nothing (its errors went to /dev/null): run the files whole, so that
          # the log says why (a shard of no ids must never become a bare pytest of the whole folder).
          note "WARNING: collecting ${files[*]} listed no tests; running them unsharded"
          step "pytest $group" $((budget - 10)) python -m pytest -q -p no:cacheprovider \
            --junitxml="$results/tests/test-$group.xml" "${files[@]}" >"$results/tests/test-$group.log" 2>&1 &
          pids+=($!)
        fi
        for pid in "${pids[@]}"; do wait "$pid" || status=1; done
      done
      tail -n 3 "$results"/tests/test-*.log | tee -a "$log"
      ;;

    tune-prefill)
      # The keys of the benchmark's seven shapes (B=1, Hq 16, Hkv 2 is GQA group 8, the default keys').
      # Not deleted first: when the work folder holds the DB of a killed run, the tuner resumes its trials.
      local db="$work/tune-prefill.sqlite" common=(--device 0 --kernel tma_prefill --trials 24 --time-budget 20)
      step "tune prefill 4096x128K" 80 python -c "$TUNE_PY" "${common[@]}" --head-dim 128 --head-dim 64 \
        --lq 4096 --lkv 131072 --db "$db"
      step "tune prefill 512x16K" 60 python -c "$TUNE_PY" "${common[@]}" --head-dim 128 --head-dim 64 \
        --lq 512 --lkv 16384 --db "$db"
      step "tune prefill 1024x128K" 40 python -c "$TUNE_PY" "${common[@]}" --head-dim 128 \
        --lq 1024 --lkv 131072 --db "$db"
      tune_and_export "$db" tma_prefill 60 python -c "$TUNE_PY" "${common[@]}" --head-dim 128 --head-dim 64 \
        --lq 16384 --lkv 16384 --db "$db"
      ;;

    prefill-defaults)
      # The default keys, then the two square-16K keys of the benchmark (the defaults' neighbours
      # by then, so their winners seed the squares). PREFILL_FRESH=1 starts from an empty DB.
      local db="$work/tune-prefill.sqlite"
      if [ "${PREFILL_FRESH:-0}" = 1 ]; then
        rm -f "$db"
        note "PREFILL_FRESH=1: every key tuned from an empty DB"
      elif [ ! -f "$db" ] && [ -f "$resume/tune-prefill.sqlite" ]; then
        cp "$resume/tune-prefill.sqlite" "$db"
        note "resuming $resume/tune-prefill.sqlite"
      fi
      local common=(--device 0 --kernel tma_prefill --head-dim 64 --head-dim 128 --time-budget 12 --db "$db")
      step "tune prefill defaults" $((deadline - $(date +%s) - 150)) python -c "$TUNE_PY" "${common[@]}" --trials 24
      step "tune prefill squares" $((deadline - $(date +%s) - 100)) python -c "$TUNE_PY" "${common[@]}" --trials 24 \
        --lq 16384 --lkv 16384
      # A second pass, four trials more a key: the first key of each head dim met no neighbour's
      # winner in the first pass (nothing was tuned before it), the others only earlier keys'.
      tune_and_export "$db" tma_prefill $((deadline - $(date +%s) - 40)) python -c "$TUNE_PY" "${common[@]}" \
        --trials 28
      ;;

    defaults)
      # Every default key of each kernel, one kernel after another; a kernel cut off by the budget
      # keeps its trials, and a later run resumes them from $resume.
      local kernel db extra
      read -r -a extra <<<"${DEFAULTS_TUNE_ARGS:---trials 16 --time-budget 8}"
      for kernel in ${DEFAULTS_KERNELS:-splitk_decode varlen_sdpa q4k_fp8_gemm}; do
        db="$work/$kernel-defaults.sqlite"
        if [ ! -f "$db" ] && [ -f "$resume/$kernel-defaults.sqlite" ]; then
          cp "$resume/$kernel-defaults.sqlite" "$db"
          note "resuming $resume/$kernel-defaults.sqlite"
        fi
        # The tune stops 40 s short of the stage's end, so that its DB is still snapshotted and exported.
        tune_and_export "$db" "$kernel" $((deadline - $(date +%s) - 40)) python -c "$TUNE_PY" --device 0 \
          --kernel "$kernel" "${extra[@]}" --db "$db"
      done
      ;;

    retune)
      # The shipped bundle's keys re-tuned (tune --bundled: each seeded from its shipped winner), one
      # kernel after another, resuming $resume/retune.sqlite; then the re-tuned winners exported and
      # compared with the shipped bundle key by key (scripts/compare_bundles.py).
      local db="$work/retune.sqlite" kernel extra shipped
      if [ ! -f "$db" ] && [ -f "$resume/retune.sqlite" ]; then
        cp "$resume/retune.sqlite" "$db"
        note "resuming $resume/retune.sqlite"
      fi
      read -r -a extra <<<"${RETUNE_ARGS:---trials 5 --time-budget 3}"
      for kernel in ${RETUNE_KERNELS:-splitk_decode varlen_sdpa tma_prefill q4k_fp8_gemm}; do
        # Each tune stops 90 s short of the stage's end: the DB is still snapshotted, exported and
        # compared (each of those steps keeps 10 s of its own).
        step "retune $kernel" $((deadline - $(date +%s) - 90)) python -c "$TUNE_PY" --device 0 --kernel "$kernel" \
          --bundled "${extra[@]}" --db "$db"
      done
      shipped="configs_db/bundles/$(gpu_slug).json"
      if [ -f "$db" ]; then
        step "snapshot retune" 20 python -c "$SNAPSHOT_PY" "$db" "$results/retune.sqlite"
        step "export retune" 20 python -c "$TUNE_PY" export --gpu "$(gpu_slug)" --db "$db" \
          --out "$results/retune-$(gpu_slug).json"
        step "compare retune" 15 python scripts/compare_bundles.py "$shipped" "$results/retune-$(gpu_slug).json" \
          --out "$results/$today-bundle-compare-$(gpu_slug).md"
      else
        note "retune wrote no DB"
        status=1
      fi
      ;;

    bench-decode | bench-varlen | bench-q4k)
      local kernel script extra
      case "$stage" in
        bench-decode) kernel=splitk_decode script=bench_decode.py; read -r -a extra <<<"${DECODE_BENCH_ARGS:-}" ;;
        bench-varlen) kernel=varlen_sdpa script=bench_varlen.py; read -r -a extra <<<"${VARLEN_BENCH_ARGS:-}" ;;
        *) kernel=q4k_fp8_gemm script=bench_q4k.py; read -r -a extra <<<"${Q4K_BENCH_ARGS:---m 1 --m 16 --m 64 --m 4096}" ;;
      esac
      local db="$work/$kernel-defaults.sqlite" dbargs name="$today-$kernel-$(gpu_slug)"
      if [ ! -f "$db" ] && [ -f "$resume/$kernel-defaults.sqlite" ]; then
        cp "$resume/$kernel-defaults.sqlite" "$db"
        note "tuned configs from $resume/$kernel-defaults.sqlite"
      fi
      read -r -a dbargs <<<"$(db_args "$db")"
      step bench 600 python "scripts/$script" ${dbargs[@]+"${dbargs[@]}"} --out "$results/$name.md" \
        --json "$results/$name.json" ${extra[@]+"${extra[@]}"}
      ;;

    bench-prefill)
      local src="" candidate
      for candidate in "${PREFILL_DB:-}" "$work/tune-prefill.sqlite" "$resume/tune-prefill.sqlite"; do
        if [ -n "$candidate" ] && [ -f "$candidate" ]; then
          src=$candidate
          break
        fi
      done
      local db="$work/bench-prefill.sqlite"
      rm -f "$db"
      if [ -n "$src" ]; then
        note "tuned configs and trials from $src"
        step snapshot 60 python -c "$SNAPSHOT_PY" "$src" "$db"
      else
        note "WARNING: no tune-prefill DB (PREFILL_DB, $work/tune-prefill.sqlite, $resume/tune-prefill.sqlite)"
      fi
      local dbargs name="$today-tma_prefill-$(gpu_slug)"
      read -r -a dbargs <<<"$(db_args "$db")"
      step bench 600 python scripts/bench_prefill.py ${dbargs[@]+"${dbargs[@]}"} --out "$results/$name.md" \
        --json "$results/$name.json"
      ;;

    decode)
      local db="$work/decode-tune.sqlite" dbargs extra name="$today-splitk_decode-$(gpu_slug)"
      local tune_extra
      read -r -a tune_extra <<<"${DECODE_TUNE_ARGS:---trials 12 --time-budget 7}"
      tune_and_export "$db" splitk_decode "${DECODE_TUNE_CAP:-100}" python -c "$TUNE_PY" --device 0 \
        --kernel splitk_decode --head-dim 128 --batch 1 --batch 8 --batch 32 --batch 64 --lkv 4096 --lkv 32768 \
        --lkv 131072 "${tune_extra[@]}" --db "$db"
      read -r -a dbargs <<<"$(db_args "$db")"
      read -r -a extra <<<"${DECODE_BENCH_ARGS:-}"
      step bench 600 python scripts/bench_decode.py ${dbargs[@]+"${dbargs[@]}"} --out "$results/$name.md" \
        --json "$results/$name.json" ${extra[@]+"${extra[@]}"}
      ;;

    varlen)
      local db="$work/varlen-tune.sqlite" dbargs extra name="$today-varlen_sdpa-$(gpu_slug)"
      local tune_extra
      read -r -a tune_extra <<<"${VARLEN_TUNE_ARGS:---trials 16 --time-budget 14}"
      tune_and_export "$db" varlen_sdpa "${VARLEN_TUNE_CAP:-85}" python -c "$TUNE_PY" --device 0 \
        --kernel varlen_sdpa --head-dim 128 "${tune_extra[@]}" --db "$db"
      read -r -a dbargs <<<"$(db_args "$db")"
      read -r -a extra <<<"${VARLEN_BENCH_ARGS:-}"
      step bench 600 python scripts/bench_varlen.py ${dbargs[@]+"${dbargs[@]}"} --out "$results/$name.md" \
        --json "$results/$name.json" ${extra[@]+"${extra[@]}"}
      ;;

    q4k)
      local db="$work/q4k-tune.sqlite" dbargs extra name="$today-q4k_fp8_gemm-$(gpu_slug)"
      local tune_extra
      read -r -a tune_extra <<<"${Q4K_TUNE_ARGS:---trials 16 --time-budget 10}"
      tune_and_export "$db" q4k_fp8_gemm "${Q4K_TUNE_CAP:-140}" python -c "$TUNE_PY" --device 0 \
        --kernel q4k_fp8_gemm --m 1 --m 16 --m 4096 "${tune_extra[@]}" --db "$db"
      read -r -a dbargs <<<"$(db_args "$db")"
      read -r -a extra <<<"${Q4K_BENCH_ARGS:---m 1 --m 16 --m 64 --m 4096}"
      step bench 600 python scripts/bench_q4k.py ${dbargs[@]+"${dbargs[@]}"} --out "$results/$name.md" \
        --json "$results/$name.json" ${extra[@]+"${extra[@]}"}
      ;;

    overhead)
      step overhead 300 python scripts/measure_overhead.py --profile --out "$results/$today-overhead-$(gpu_slug).md"
      ;;

    model)
      # MODEL_ARGS narrows it (e.g. --lengths 512,2048,8192,32768).
      # shellcheck disable=SC2086
      step model $((budget - 10)) python scripts/bench_model.py --profile ${MODEL_ARGS:-} \
        --out "$results/$today-model-llama3-8b-$(gpu_slug).md" --json "$results/$today-model-llama3-8b-$(gpu_slug).json"
      ;;

    jit)
      # JIT_ARGS narrows it (e.g. --phases online provisional missed).
      # shellcheck disable=SC2086
      step jit $((budget - 10)) python scripts/bench_jit.py --device 0 --work "$work/jit" ${JIT_ARGS:-} \
        --out "$results/$today-jit-$(gpu_slug).md"
      ;;

    tuner)
      # Fault isolation and two workers first (short); rank stability gets what is left.
      local stability=$((budget - 15 - 40 - 60 - 15))
      step tuner 600 python scripts/bench_tuner.py --budget $((budget - 15)) --fault-cap 40 --workers-cap 60 \
        --stability-cap "$stability" --kernels splitk_decode --kernels tma_prefill --kernels q4k_fp8_gemm \
        --out "$results/$today-tuner-$(gpu_slug).md" --json "$results/$today-tuner-$(gpu_slug).json" fault workers stability
      ;;

    multigpu)
      # Both tunes and the re-timing inside the part's cap; 25 s for the report and this stage's closing lines.
      local extra name="$today-multigpu-$(gpu_slug)"
      read -r -a extra <<<"${MULTIGPU_ARGS:-}"
      step multigpu 600 python scripts/bench_tuner.py --budget $((budget - 15)) --multigpu-cap $((budget - 25)) \
        --out "$results/$name.md" --json "$results/$name.json" ${extra[@]+"${extra[@]}"} multigpu
      ;;

    stability)
      local kernels=() k
      for k in ${STABILITY_KERNELS:-tma_prefill varlen_sdpa}; do kernels+=(--kernels "$k"); done
      step stability 600 python scripts/bench_tuner.py --budget $((budget - 15)) --stability-cap $((budget - 25)) \
        --trials 40 "${kernels[@]}" --out "$results/$today-stability-$(gpu_slug).md" \
        --json "$results/$today-stability-$(gpu_slug).json" stability
      ;;

    gpu-tests)
      # The GPU tier only (-m gpu), all at once (compiling each test's configs is most of the time):
      # the attention files in three processes, every other file's GPU tests in three shards and
      # the Q4_K file's in three. -rf --tb=short leave each failure's reason in its log, also when
      # another process runs out of time.
      mkdir -p "$results/tests"
      local pids=() group files
      local gpu_pytest=(python -m pytest -q -p no:cacheprovider -m gpu -rf --tb=short)
      for group in "prefill:tests/test_prefill.py" "decode:tests/test_decode.py tests/test_decode_spec.py" \
        "varlen:tests/test_varlen.py"; do
        read -r -a files <<<"${group#*:}"
        step "pytest -m gpu ${group%%:*}" $((budget - 10)) "${gpu_pytest[@]}" \
          --junitxml="$results/tests/gpu-${group%%:*}.xml" "${files[@]}" >"$results/tests/gpu-${group%%:*}.log" 2>&1 &
        pids+=($!)
      done
      # Every other GPU test (ws prefill, online tuning, the model, eager alternatives under capture, ...).
      local rest=(tests --ignore=tests/test_prefill.py --ignore=tests/test_decode.py --ignore=tests/test_decode_spec.py
        --ignore=tests/test_varlen.py --ignore=tests/test_q4k.py)
      python -m pytest --collect-only -q -p no:cacheprovider -m gpu "${rest[@]}" 2>/dev/null | grep '::' \
        >"$work/rest-gpu-tests.txt"
      if [ -s "$work/rest-gpu-tests.txt" ]; then
        start_shards "$work/rest-gpu-tests.txt" 3 gpu-rest
      else
        # Collection listed nothing (its errors went to /dev/null): run them whole, so the log says why.
        step "pytest -m gpu rest" $((budget - 10)) "${gpu_pytest[@]}" --junitxml="$results/tests/gpu-rest.xml" \
          "${rest[@]}" >"$results/tests/gpu-rest.log" 2>&1 &
        pids+=($!)
      fi
      python -m pytest --collect-only -q -p no:cacheprovider -m gpu tests/test_q4k.py 2>/dev/null | grep '::' \
        >"$work/q4k-gpu-tests.txt"
      if [ ! -s "$work/q4k-gpu-tests.txt" ]; then
        # Collection listed nothing (its errors went to /dev/null): say so rather than pass quietly.
        note "WARNING: collecting the GPU tests of tests/test_q4k.py listed none; run it alone to see why"
        status=1
      fi
      start_shards "$work/q4k-gpu-tests.txt" 3 gpu-q4k
      for pid in "${pids[@]}"; do wait "$pid" || status=1; done
      tail -n 3 "$results"/tests/gpu-*.log | tee -a "$log"
      ;;

    pytest)
      local selection
      mkdir -p "$results/tests"
      read -r -a selection <<<"${PYTEST_GPU_ARGS:?pytest stage: set PYTEST_GPU_ARGS to a selection}"
      step pytest $((budget - 10)) python -m pytest -q -p no:cacheprovider --junitxml="$results/tests/pytest.xml" \
        "${selection[@]}" >"$results/tests/pytest.log" 2>&1
      tail -n 15 "$results/tests/pytest.log" | tee -a "$log"
      ;;

    sweep)
      # Many configs of one key each, through the tuner's own bench (sweep_configs.py), to see what the
      # tuner's sampling missed. SWEEPS: "kernel|name|key json|where filters|limit" entries joined by ";".
      local sweeps entry kernel name key where limit filters f
      sweeps=${SWEEPS:-'q4k_fp8_gemm|q4k-staged-m4096|{"dtype":"bfloat16","m_bucket":4096,"n":14336,"k":4096,"fp8":true}|path=staged|40;q4k_fp8_gemm|q4k-portable-m16|{"dtype":"bfloat16","m_bucket":16,"n":14336,"k":4096}|path=portable|60'}
      IFS=';' read -r -a entries <<<"$sweeps"
      for entry in "${entries[@]}"; do
        IFS='|' read -r kernel name key where limit <<<"$entry"
        filters=()
        for f in $where; do filters+=(--where "$f"); done
        step "sweep-$name" 290 python scripts/sweep_configs.py --kernel "$kernel" --key "$key" \
          ${filters[@]+"${filters[@]}"} --limit "$limit" --out "$results/$today-sweep-$name-$(gpu_slug).md" \
          --json "$results/$today-sweep-$name-$(gpu_slug).json"
      done
      ;;

    smoke)
      local db="$work/smoke.sqlite" dbargs
      rm -f "$db" "$db-wal" "$db-shm"
      step tune-decode 300 python -c "$TUNE_PY" --device cpu --kernel splitk_decode --head-dim 128 --batch 1 \
        --lkv 160 --trials 4 --db "$db"
      step tune-varlen 300 python -c "$TUNE_PY" --device cpu --kernel varlen_sdpa --trials 4 --db "$db"
      tune_and_export "$db" q4k_fp8_gemm 300 python -c "$TUNE_PY" --device cpu --kernel q4k_fp8_gemm \
        --trials 4 --db "$db"
      read -r -a dbargs <<<"$(db_args "$db")"
      step bench-decode 600 python scripts/bench_decode.py --smoke ${dbargs[@]+"${dbargs[@]}"} \
        --out "$results/smoke-decode.md" --json "$results/smoke-decode.json"
      step bench-varlen 600 python scripts/bench_varlen.py --smoke ${dbargs[@]+"${dbargs[@]}"} \
        --out "$results/smoke-varlen.md" --json "$results/smoke-varlen.json"
      step bench-q4k 600 python scripts/bench_q4k.py --smoke ${dbargs[@]+"${dbargs[@]}"} \
        --out "$results/smoke-q4k.md" --json "$results/smoke-q4k.json"
      ;;
  esac
}

# Pack whatever exists, also when a stage failed: the archive is the run's one file to take away.
pack() {
  tar -czf "$final_out/suite.tgz" -C "$results" . 2>>"$summary"
  echo "[suite] packed $(find "$results" -type f | wc -l) file(s) into $final_out/suite.tgz" | tee -a "$summary"
}
trap pack EXIT

log="$results/machine.log"
note "stages: $*; output folder $final_out, work folder $work"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,temperature.gpu,power.draw \
    --format=csv 2>&1 | tee -a "$log" "$summary"
fi
timeout 120 python -c "$ENV_PY" 2>&1 | tee -a "$log" "$summary"
cuda_slug=$(timeout 120 python -c "$SLUG_PY" 2>>"$summary" | tail -n 1)
note "GPU slug: ${cuda_slug:-unknown}"

for arg in "$@"; do
  stage=${arg%%:*}
  budget=${DEFAULT_BUDGET[$stage]}
  [[ "$arg" == *:* ]] && budget=${arg#*:}
  started=$(date +%s)
  deadline=$((started + budget))
  log="$results/$stage.log"
  note "stage $stage: budget ${budget}s"
  run_stage
  note "stage $stage finished in $(($(date +%s) - started)) s (status so far $status)"
done
exit "$status"
