#!/usr/bin/env bash
# The test suite, from a fresh clone: set up .venv with the dev extras, then run pytest offline.
# With no arguments (the whole suite, as CI runs it) the media tests marked `vision` run a second time in
# .venv-vision, beside torchvision: transformers' default image processors and its video processors, which the
# lean CPU-only torch cannot load. TUNEFORGE_TEST_VISION=0 skips that pass.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --dev
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export HF_HOME=${HF_HOME:-$PWD/.cache/hf}
export TUNEFORGE_HOME=${TUNEFORGE_HOME:-$PWD/.cache/tuneforge}
export MPLCONFIGDIR=${MPLCONFIGDIR:-$PWD/.cache/matplotlib}
# DeepSpeed compiles its CPU communication op on first use: into the clone, not the home folder
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
# the web UI's browser tests drive Debian's Chromium and ChromeDriver, and the command line preloads tcmalloc
# (tuneforge/allocator.py); installed here where apt-get can run (the browser tests skip, saying why, elsewhere, and
# the command line runs on the system's allocator)
need=()
command -v chromedriver >/dev/null || need+=(chromium chromium-driver)
ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal || need+=(libtcmalloc-minimal4)
if [ $# -eq 0 ] && [ ${#need[@]} -gt 0 ] && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && apt-get install -y -qq "${need[@]}" >/dev/null) \
    || echo "${need[*]} could not be installed: the browser tests will skip" >&2
fi
export GRADIO_ANALYTICS_ENABLED=False
status=0
.venv/bin/python -m pytest -q "$@" || status=$?
if [ $# -eq 0 ] && [ "${TUNEFORGE_TEST_VISION:-1}" != 0 ]; then
  VENV=.venv-vision bash scripts/setup.sh --dev --vision
  .venv-vision/bin/python -m pytest -q -m vision || status=$?
fi
exit "$status"
