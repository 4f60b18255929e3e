#!/usr/bin/env bash
# GPU evidence in slices that each fit one device call (10-minute limit), run from the repository root:
#
#   bash .gpu/setup.sh && . .gpu/env.sh && bash scripts/gpu_evidence.sh STAGE
#
# STAGE          runs                                                          leaves under $OUT
# tests          the kernel test files (the GPU tier included)                 tests.log, tests.xml
# tune-prefill   tune tma_prefill: D 64/128 x Lq 512/4096 x Lkv 16K/128K,      tune-prefill.log, tune-prefill.sqlite,
#                then export the winners as a bundle                           <gpu>.json
# bench-prefill  scripts/bench_prefill.py on tune-prefill's DB (see below)     bench-prefill.log, <date>-tma_prefill-<gpu>.md/.json
# decode         tune splitk_decode at B 1/64 x Lkv 4K/128K (D 128),           decode.log, decode-tune.sqlite,
#                then scripts/bench_decode.py on that DB                       <date>-splitk_decode-<gpu>.md/.json
# q4k            tune q4k_fp8_gemm at M 1/64/4096 (the three shapes),          q4k.log, q4k-tune.sqlite,
#                then scripts/bench_q4k.py on that DB                          <date>-q4k_fp8_gemm-<gpu>.md/.json
# overhead       scripts/measure_overhead.py                                   overhead.log, <date>-overhead-<gpu>.md
# smoke          the decode and q4k steps, export included, on the CPU          smoke.log, smoke-*.md/.json/.sqlite,
#                (Triton interpreter, tiny shapes): a dry run without a GPU     smoke-bundle.json
#
# $OUT is emptied before every call, so bench-prefill reads the DB of an earlier tune-prefill call from
# PREFILL_DB if set, else build/evidence/tune-prefill.sqlite (git-ignored: copy the fetched
# tune-prefill.sqlite there and carry build/evidence with the call), else the work folder of a machine
# still warm from that call. Without any, its tuned rows show only what the shipped bundles serve.
#
# Every step runs under `timeout`, capped so that the stage ends within EVIDENCE_BUDGET_S seconds of its
# start (default 540; 1800 for smoke) and leaves its partial logs; bench reports are rewritten after each
# shape. The exit status is 1 if any step failed, timed out or was skipped for lack of time.
# DECODE_BENCH_ARGS / Q4K_BENCH_ARGS add arguments to the benchmarks (e.g. "--batch 64 --lkv 131072").
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2

stage=${1:-}
case "$stage" in
  tests | tune-prefill | bench-prefill | decode | q4k | overhead | smoke) ;;
  *)
    echo "usage: bash scripts/gpu_evidence.sh tests|tune-prefill|bench-prefill|decode|q4k|overhead|smoke" >&2
    exit 2
    ;;
esac

out=${OUT:-/tmp/tritune-evidence-out}
work=${EVIDENCE_WORK:-/tmp/tritune-evidence}
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1
started=$(date +%s)
default_budget=540
[ "$stage" = smoke ] && default_budget=1800
deadline=$((started + ${EVIDENCE_BUDGET_S:-$default_budget}))
log="$out/$stage.log"
status=0

# The CLI through python (the `tune` console script may not be on PATH after an editable install).
TUNE_PY='import sys; from tritune.tuner.cli import main; sys.argv[0] = "tune"; main()'
# One self-contained SQLite file (the WAL folded in, journal mode DELETE): what goes to $OUT and back.
SNAPSHOT_PY='
import sqlite3, sys
src, dst = sqlite3.connect(sys.argv[1]), sqlite3.connect(sys.argv[2])
src.backup(dst)
dst.execute("PRAGMA journal_mode=DELETE")
dst.close()
src.close()
print(f"snapshot of {sys.argv[1]} written to {sys.argv[2]}")
'
SLUG_PY='from tritune.kernels.device import device_info; print(device_info(0).slug)'
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
  echo "[evidence $(date -u +%H:%M:%S)] $*" | tee -a "$log"
}

# step NAME CAP_SECONDS COMMAND...: run COMMAND under timeout (the smaller of CAP and the time left).
step() {
  local name=$1 cap=$2
  shift 2
  # Keep 15 s for timeout's kill grace and the stage's closing lines.
  local left=$((deadline - $(date +%s) - 15))
  local limit=$((cap < left ? cap : left))
  if ((limit < 15)); then
    note "SKIPPED $name: ${left}s left of the stage budget"
    status=1
    return 1
  fi
  note "$name (limit ${limit}s): $*"
  timeout -k 10 "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  case $rc in
    0) note "$name: ok" ;;
    124 | 137) note "$name: TIMED OUT after ${limit}s (partial output above)" ;;
    *) note "$name: FAILED with exit status $rc" ;;
  esac
  ((rc == 0)) || status=1
  return "$rc"
}

gpu_slug() {
  if [ "$stage" = smoke ]; then
    echo cpu-interpreter
  else
    local slug
    slug=$(timeout 120 python -c "$SLUG_PY" 2>>"$log" | tail -n 1)
    echo "${slug:-unknown-gpu}"
  fi
}

describe_machine() {
  note "stage $stage, budget $((deadline - started)) s, OUT=$out, work folder $work"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,temperature.gpu,power.draw \
      --format=csv 2>&1 | tee -a "$log"
  fi
  timeout 120 python -c "$ENV_PY" 2>&1 | tee -a "$log"
}

# The DB a benchmark should read: $1 when it exists (a run that could not tune leaves none).
db_args() {
  if [ -f "$1" ]; then
    echo "--db $1"
  else
    note "WARNING: no DB at $1: tuned rows show only the shipped bundles / portable defaults" >&2
  fi
}

describe_machine
today=$(date -u +%F)

case "$stage" in
  tests)
    files=()
    for f in tests/test_prefill.py tests/test_decode.py tests/test_q4k.py tests/test_varlen.py; do
      [ -f "$f" ] && files+=("$f")
    done
    step pytest 520 python -m pytest -q -x -p no:cacheprovider --junitxml="$out/tests.xml" "${files[@]}"
    ;;

  tune-prefill)
    # Not deleted first: on a machine still warm from a killed run, the tuner resumes its trials.
    db="$work/tune-prefill.sqlite"
    step tune 450 python -c "$TUNE_PY" --device 0 --kernel tma_prefill --head-dim 64 --head-dim 128 \
      --lq 512 --lq 4096 --lkv 16384 --lkv 131072 --trials 40 --time-budget 30 --db "$db"
    if [ -f "$db" ]; then
      step snapshot 60 python -c "$SNAPSHOT_PY" "$db" "$out/tune-prefill.sqlite"
      step show 60 python -c "$TUNE_PY" show --db "$db"
      slug=$(gpu_slug)
      step export 60 python -c "$TUNE_PY" export --gpu "$slug" --db "$db" --out "$out/$slug.json"
    else
      note "tune wrote no DB"
      status=1
    fi
    ;;

  bench-prefill)
    src=""
    for candidate in "${PREFILL_DB:-}" build/evidence/tune-prefill.sqlite "$work/tune-prefill.sqlite"; do
      if [ -n "$candidate" ] && [ -f "$candidate" ]; then
        src=$candidate
        break
      fi
    done
    db="$work/bench-prefill.sqlite"
    rm -f "$db"
    if [ -n "$src" ]; then
      note "tuned configs and trials from $src"
      step snapshot 60 python -c "$SNAPSHOT_PY" "$src" "$db"
    else
      note "WARNING: no tune-prefill DB (PREFILL_DB, build/evidence/tune-prefill.sqlite, $work/tune-prefill.sqlite)"
    fi
    read -r -a dbargs <<<"$(db_args "$db")"
    name="$today-tma_prefill-$(gpu_slug)"
    step bench 520 python scripts/bench_prefill.py ${dbargs[@]+"${dbargs[@]}"} --out "$out/$name.md" \
      --json "$out/$name.json"
    ;;

  decode)
    db="$work/decode-tune.sqlite"
    step tune 160 python -c "$TUNE_PY" --device 0 --kernel splitk_decode --head-dim 128 --batch 1 --batch 64 \
      --lkv 4096 --lkv 131072 --trials 24 --time-budget 20 --db "$db"
    [ -f "$db" ] && step snapshot 60 python -c "$SNAPSHOT_PY" "$db" "$out/decode-tune.sqlite"
    read -r -a dbargs <<<"$(db_args "$db")"
    read -r -a extra <<<"${DECODE_BENCH_ARGS:-}"
    name="$today-splitk_decode-$(gpu_slug)"
    step bench 600 python scripts/bench_decode.py ${dbargs[@]+"${dbargs[@]}"} --out "$out/$name.md" \
      --json "$out/$name.json" ${extra[@]+"${extra[@]}"}
    ;;

  q4k)
    db="$work/q4k-tune.sqlite"
    step tune 240 python -c "$TUNE_PY" --device 0 --kernel q4k_fp8_gemm --m 1 --m 64 --m 4096 \
      --trials 32 --time-budget 15 --db "$db"
    [ -f "$db" ] && step snapshot 60 python -c "$SNAPSHOT_PY" "$db" "$out/q4k-tune.sqlite"
    read -r -a dbargs <<<"$(db_args "$db")"
    read -r -a extra <<<"${Q4K_BENCH_ARGS:-}"
    name="$today-q4k_fp8_gemm-$(gpu_slug)"
    step bench 600 python scripts/bench_q4k.py ${dbargs[@]+"${dbargs[@]}"} --out "$out/$name.md" \
      --json "$out/$name.json" ${extra[@]+"${extra[@]}"}
    ;;

  overhead)
    name="$today-overhead-$(gpu_slug)"
    step overhead 300 python scripts/measure_overhead.py --out "$out/$name.md"
    ;;

  smoke)
    db="$work/smoke.sqlite"
    rm -f "$db" "$db-wal" "$db-shm"
    step tune-decode 300 python -c "$TUNE_PY" --device cpu --kernel splitk_decode --head-dim 128 --batch 1 \
      --lkv 160 --trials 4 --db "$db"
    step tune-q4k 300 python -c "$TUNE_PY" --device cpu --kernel q4k_fp8_gemm --trials 4 --db "$db"
    [ -f "$db" ] && step snapshot 60 python -c "$SNAPSHOT_PY" "$db" "$out/smoke-tune.sqlite"
    step export 60 python -c "$TUNE_PY" export --gpu "$(gpu_slug)" --db "$db" --out "$out/smoke-bundle.json"
    read -r -a dbargs <<<"$(db_args "$db")"
    step bench-decode 600 python scripts/bench_decode.py --smoke ${dbargs[@]+"${dbargs[@]}"} \
      --out "$out/smoke-decode.md" --json "$out/smoke-decode.json"
    step bench-decode-ragged 300 python scripts/bench_decode.py --smoke --ragged --skip-flex --batch 3 \
      ${dbargs[@]+"${dbargs[@]}"}
    step bench-q4k 600 python scripts/bench_q4k.py --smoke ${dbargs[@]+"${dbargs[@]}"} \
      --out "$out/smoke-q4k.md" --json "$out/smoke-q4k.json"
    ;;
esac

count=$(find "$out" -type f | wc -l)
((count <= 8)) || note "WARNING: $count files under $out; a device call brings back at most 8"
note "stage $stage finished in $(($(date +%s) - started)) s with status $status"
exit "$status"
