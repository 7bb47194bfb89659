#!/usr/bin/env bash
# The GPU checks of issue #36 as one call of the device machine (docs/development.md, "On a lent GPU").
#
#   bash scripts/device_check.sh                  # every step, in order of priority
#   STEPS="tests loss" bash scripts/device_check.sh
#   DEVICE=cpu STEPS="train memory" bash scripts/device_check.sh   # try the script here, without a GPU
#
# Steps: tests (tests/test_train_device.py and tests/test_triton.py on CUDA), loss (bench_loss.py, fp32 and
# bf16, OpenRLHF's rows where its wheel is carried), train (`offpolicy train device=cuda engine=hf` on the
# embedded model), trainer (bench_trainer.py: offpolicy's hf engine against TRL on the embedded model and on
# Qwen2.5-0.5B's shapes), memory (bench_memory.py, old and new path in one run). Each step has its own time limit, so
# one that hangs leaves the others their time; every log goes to $OUT (the device tool brings back 8 files).
#
# The device machine has torch, triton, transformers and pytest but no pydantic: carry the wheels in .whl/
# (`pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl pydantic pydantic-core
# annotated-types typing-inspection openrlhf==0.11.2 trl==1.16.0 datasets dill multiprocess`, as the device
# tool's README says).
set -u
OUT=${OUT:-/tmp/device-check}
mkdir -p "$OUT"
DEVICE=${DEVICE:-cuda}
STEPS=${STEPS:-"tests loss train trainer memory"}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
WHEELS=${WHEELS:-.whl}  # WHEELS=none: use what is installed (a dry run here)
if compgen -G "$WHEELS/*.whl" > /dev/null; then
    # --target unpacks a wheel's *.data/purelib (OpenRLHF's package lives there) where imports find it
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
        || { echo "device_check: the carried wheels did not install"; exit 1; }
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
# warm starts of the embedded model built here and carried (carry: [".opcache"]): the device machine starts bare
if [ -d .opcache ] && [ -z "${OFFPOLICY_CACHE:-}" ]; then
    export OFFPOLICY_CACHE="$PWD/.opcache"
fi
SUMMARY="$OUT/summary.txt"

{
    date -u +"%Y-%m-%dT%H:%M:%SZ"
    git rev-parse --short HEAD 2>/dev/null || true
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    "$PY" -c "import sys, torch, transformers; import triton; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__, '| cuda', torch.cuda.is_available())"
    "$PY" -c "import offpolicy, pydantic; print('offpolicy imports; pydantic', pydantic.__version__)"
} 2>&1 | tee "$SUMMARY"

# step NAME LIMIT_SECONDS COMMAND...: runs it under `timeout`, its output in $OUT/NAME.log, one summary line
step() {
    local name=$1 limit=$2
    shift 2
    case " $STEPS " in *" ${name%%-*} "*) ;; *) return ;; esac
    echo "=== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout -s INT -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    printf '%-18s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - start))" | tee -a "$SUMMARY"
    tail -n "${TAIL:-25}" "$OUT/$name.log"
}

RUN=/tmp/device-check-runs  # run directories stay on the machine: the tool brings back 8 files at most
mkdir -p "$RUN"

# the CUDA tests; -o addopts= : no xdist flags (the machine's pytest-xdist may predate them), one process
step tests 240 "$PY" -m pytest -q -n 0 -p no:cacheprovider -o addopts= -ra --durations=25 \
    tests/test_train_device.py tests/test_triton.py

if [ "$DEVICE" = cuda ]; then
    step loss 180 "$PY" benchmarks/bench_loss.py --device cuda --dtypes fp32,bf16 --profile
else
    step loss 150 "$PY" benchmarks/bench_loss.py --device cpu --sizes 4x256 --repeats 2 --profile
fi

# the README's command on the embedded model
step train-embedded 90 "$PY" -m offpolicy train device="$DEVICE" engine=hf steps=4 eval_every=100 eval_problems=16 \
    out_dir="$RUN/embedded"
# offpolicy (hf engine) against TRL's GRPOTrainer: the embedded model and Qwen2.5-0.5B's shapes built in code
# (V = 151,936), 8 prompts x 8, 128 response tokens
step trainer 200 "$PY" benchmarks/bench_trainer.py --device "$DEVICE" --models ${TRAINER_MODELS:-embedded qwen2-0.5b} \
    --lengths "${TRAINER_LENGTH:-128}" --runs 1 --steps 4 --only "hf engine" TRL

if [ "$DEVICE" = cuda ]; then
    step memory 150 "$PY" benchmarks/bench_memory.py --device cuda --rows 16 --lengths 256 1024 4096
else
    step memory 150 "$PY" benchmarks/bench_memory.py --quick
fi

echo "=== summary"
cat "$SUMMARY"
