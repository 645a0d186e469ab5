#!/usr/bin/env bash
# The test suite, from a fresh clone: set up .venv with the dev extras, then run pytest offline.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export HF_HOME=${HF_HOME:-$PWD/.cache/hf}
export TUNEFORGE_HOME=${TUNEFORGE_HOME:-$PWD/.cache/tuneforge}
export MPLCONFIGDIR=${MPLCONFIGDIR:-$PWD/.cache/matplotlib}
exec .venv/bin/python -m pytest -q "$@"
