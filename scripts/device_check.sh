#!/usr/bin/env bash
# The GPU checks of issues #44 and #57 as one call of the device machine (docs/performance.md): one call that
# fits 7 minutes (so a rerun fits a 15-minute lease); STEPS picks the steps, whose limits must add up to at most
# the 7 minutes.
#
#   bash scripts/device_check.sh              # on the device machine (run tool, timeout_s 450)
#   bash scripts/device_check.sh --dry-run    # here, without a GPU: proves the script's own steps
#   STEPS="packs trainer" BASELINE=.dev/base/src bash scripts/device_check.sh
#
# Steps (limit in seconds; the limits add up to BUDGET):
#   build  20  the carried wheels (.whl/) installed with one pip call — the device machine has torch,
#              triton, transformers and pytest but no pydantic (`pip download --no-deps --only-binary=:all:
#              --python-version 3.12 -d .whl pydantic pydantic-core annotated-types typing-inspection
#              openrlhf==0.11.2`; for TRL in `trainer`: trl==1.16.0 datasets dill multiprocess); then
#              `import offpolicy` — the script stops at once if it fails
#   packs 100  tests/test_head_cuda.py (the head's out_dtype GEMM, the trainer's packs on CUDA: issue #57) and
#              tests/test_train_device.py (its CUDA runs, and the rest under the machine's torch)
#   tests 100  the last 9 tests of tests/test_triton.py on CUDA (CUDA-graph capture, no host sync through
#              auto, low-precision gradients, ...), which the last lease's time limit left unrun
#   head   50  the head's forward + backward at V = 151,936, H = 896, 16k tokens, fp32 and bf16, before and
#              after issue #44 (benchmarks/bench_head.py)
#   m2po   60  four optimizer steps of areal:m2po (data-chosen cut every step) on the embedded model: s/step
#              and the number of Triton kernels compiled (a fresh TRITON_CACHE_DIR, counted afterwards)
#   loss   80  benchmarks/bench_loss.py, fp32 and bf16, with the host-overhead row
#   trainer 100 benchmarks/bench_trainer.py at Qwen2-0.5B's shapes, TRL (if carried) and offpolicy's defaults
#              (hf engine: no vLLM there), 12 steps x 2 runs; BASELINE=DIR (another commit's src/, carried) adds
#              the defaults from that tree, paired (before/after); TRAINER_LIMIT overrides the limit and
#              TRAINER_OPTS adds options (later ones win: TRAINER_OPTS="--lengths 128 --steps 6")
# Every log goes to $OUT (the device tool brings back what is there); $OUT/summary.txt has one line a step.
set -u
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=${OUT:-/tmp/device-check}
mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda}
[ "$DRY" = 1 ] && DEVICE=cpu
STEPS=${STEPS:-"tests head m2po loss trainer"}
BASELINE=${BASELINE:-}
BUDGET=420  # seconds: 7 minutes
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
SUMMARY="$OUT/summary.txt"
RUN=/tmp/device-check-runs  # run directories stay on the machine
mkdir -p "$RUN"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

# ------------------------------------------------------------------ the steps' limits and the budget
declare -A LIMIT=([build]=20 [tests]=100 [packs]=100 [head]=50 [m2po]=60 [loss]=80 [trainer]=${TRAINER_LIMIT:-100})
total=${LIMIT[build]}
limits="build ${LIMIT[build]}"
for name in $STEPS; do
    [ -n "${LIMIT[$name]:-}" ] || { echo "device_check: no step '$name' (steps: ${!LIMIT[*]})"; exit 2; }
    total=$((total + LIMIT[$name]))
    limits="$limits $name ${LIMIT[$name]}"
done
say "device_check: $(date -u +%Y-%m-%dT%H:%M:%SZ) $(git rev-parse --short HEAD 2>/dev/null || echo no-git)" \
    "dry_run=$DRY device=$DEVICE steps='$STEPS' limits: $limits = ${total}s of ${BUDGET}s"
if [ "$total" -gt "$BUDGET" ]; then say "device_check: the steps' limits exceed the ${BUDGET}s budget"; exit 2; fi

# ------------------------------------------------------------------ build what is carried, check the import
start=$SECONDS
WHEELS=${WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    if [ "$DRY" = 1 ]; then
        say "build: $(ls "$WHEELS"/*.whl | wc -l) carried wheel(s) present (dry run: not installed)"
    else
        # --target unpacks a wheel's *.data/purelib (OpenRLHF's package lives there) where imports find it
        timeout -k 5 "${LIMIT[build]}" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target /tmp/site "$WHEELS"/*.whl > "$OUT/build.log" 2>&1 \
            || { say "build: the carried wheels did not install (see build.log)"; exit 1; }
        export PYTHONPATH="$PYTHONPATH:/tmp/site"
    fi
else
    say "build: no carried wheels in $WHEELS/ (using what is installed)"
fi
if [ -d .opcache ] && [ -z "${OFFPOLICY_CACHE:-}" ]; then export OFFPOLICY_CACHE="$PWD/.opcache"; fi
"$PY" -c "import offpolicy, pydantic, torch, triton; print('import offpolicy: ok | torch', torch.__version__, \
'| triton', triton.__version__, '| cuda', torch.cuda.is_available())" > "$OUT/import.log" 2>&1
rc=$?
cat "$OUT/import.log" | tee -a "$SUMMARY"
if [ "$rc" != 0 ]; then say "device_check: import offpolicy failed: stopping (see import.log)"; exit 1; fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee -a "$SUMMARY"
printf '%-8s rc=%-3s %4ss (limit %ss)\n' build 0 "$((SECONDS - start))" "${LIMIT[build]}" | tee -a "$SUMMARY"

# step NAME COMMAND...: under `timeout` at its limit, output in $OUT/NAME.log, one summary line. A dry run
# checks that every file the command names exists and runs DRY_COMMAND (an import-and-parse check) instead.
step() {
    local name=$1
    shift
    case " $STEPS " in *" $name "*) ;; *) return ;; esac
    local limit=${LIMIT[$name]} start=$SECONDS rc
    if [ "$DRY" = 1 ]; then
        local arg missing=""
        for arg in "$@"; do
            case "$arg" in *.py|*.sh) [ -f "${arg%%::*}" ] || missing="$missing $arg" ;; esac
        done
        if [ -n "$missing" ]; then say "$name: missing file(s):$missing"; rc=3; else
            timeout -k 5 "$limit" bash -c "$DRY_COMMAND" > "$OUT/$name.log" 2>&1
            rc=$?
        fi
    else
        timeout -s INT -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
        rc=$?
    fi
    printf '%-8s rc=%-3s %4ss (limit %ss)\n' "$name" "$rc" "$((SECONDS - start))" "$limit" | tee -a "$SUMMARY"
    tail -n "${TAIL:-20}" "$OUT/$name.log"
}

# the last 9 tests of tests/test_triton.py, as collected here (on CUDA: the GPU-only ones at the end)
LAST9=$("$PY" -m pytest -q --collect-only -p no:cacheprovider -o addopts= tests/test_triton.py 2>/dev/null \
        | grep '::' | tail -n 9)
echo "$LAST9" > "$OUT/tests-selected.txt"
n_sel=$(grep -c '::' "$OUT/tests-selected.txt")
say "tests: $n_sel selected (the last of tests/test_triton.py)"
DRY_COMMAND="[ $n_sel = 9 ] && $PY -m pytest -q --collect-only -p no:cacheprovider -o addopts= $(echo $LAST9)"
# -o addopts= : no xdist flags (the machine's pytest-xdist may predate them), one process
step tests "$PY" -m pytest -q -n 0 -p no:cacheprovider -o addopts= -ra --durations=10 $LAST9

DRY_COMMAND="$PY -m pytest -q --collect-only -p no:cacheprovider -o addopts= tests/test_head_cuda.py tests/test_train_device.py"
step packs "$PY" -m pytest -q -n 0 -p no:cacheprovider -o addopts= -ra --durations=10 tests/test_head_cuda.py \
    tests/test_train_device.py

DRY_COMMAND="$PY benchmarks/bench_head.py --help > /dev/null"
step head "$PY" benchmarks/bench_head.py --device "$DEVICE" --vocab 151936 --hidden 896 --tokens 16384 --repeats 3

# four areal:m2po steps: s/step from the run's log, Triton's compiles from a fresh cache directory
export TRITON_CACHE_DIR="$RUN/triton-cache"
rm -rf "$TRITON_CACHE_DIR" "$RUN/m2po"
DRY_COMMAND="$PY -c \"import offpolicy as op; from offpolicy.core.step import resolve_thresholds; from offpolicy.core.kernels import triton; op.LossConfig.from_preset('areal:m2po')\" && $PY -m offpolicy train --help > /dev/null"
step m2po "$PY" -m offpolicy train device="$DEVICE" engine=hf steps=4 eval_every=100 eval_problems=16 \
    preset=areal:m2po out_dir="$RUN/m2po"
if [ "$DRY" = 0 ] && [ -d "$TRITON_CACHE_DIR" ]; then
    say "m2po: $(find "$TRITON_CACHE_DIR" -name '_tokens.json' | wc -l) _tokens and" \
        "$(find "$TRITON_CACHE_DIR" -name '_finish.json' | wc -l) _finish compiles over 4 steps (goal: 1 each)"
fi
unset TRITON_CACHE_DIR

DRY_COMMAND="$PY benchmarks/bench_loss.py --help > /dev/null"
step loss "$PY" benchmarks/bench_loss.py --device "$DEVICE" --dtypes fp32,bf16 --repeats 20

DRY_COMMAND="$PY benchmarks/bench_trainer.py --help > /dev/null"
# the defaults are what a user runs (engine auto: the hf engine where vLLM is not installed, as on that machine)
TRAINER_ARGS=(--device "$DEVICE" --models qwen2-0.5b --steps 12 --runs 2 --only TRL defaults)
if [ -n "$BASELINE" ]; then
    [ -d "$BASELINE/offpolicy" ] || { say "trainer: BASELINE=$BASELINE holds no offpolicy package"; exit 2; }
    TRAINER_ARGS+=(--baseline-src "$BASELINE")
fi
# shellcheck disable=SC2206 # word splitting of the options is meant
TRAINER_ARGS+=(${TRAINER_OPTS:-})
step trainer "$PY" benchmarks/bench_trainer.py "${TRAINER_ARGS[@]}"

echo "=== summary"
cat "$SUMMARY"
