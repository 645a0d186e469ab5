#!/usr/bin/env bash
# The test suite, from a fresh clone: set up .venv with the dev extras, then run pytest offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export HF_HOME=${HF_HOME:-$PWD/.cache/hf}
export TUNEFORGE_HOME=${TUNEFORGE_HOME:-$PWD/.cache/tuneforge}
export MPLCONFIGDIR=${MPLCONFIGDIR:-$PWD/.cache/matplotlib}
# DeepSpeed compiles its CPU communication op on first use: into the clone, not the home folder
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
exec .venv/bin/python -m pytest -q "$@"
