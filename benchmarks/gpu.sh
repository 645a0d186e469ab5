#!/usr/bin/env bash
# Training throughput on one GPU beside LlamaFactory 0.9.5: W1 (LoRA SFT, SmolLM2-135M) and F1B (full fine-tuning
# of a 1.1B Llama built from a config, random weights), bf16, fa2 / sdpa, liger-kernel where installed; prints
# tokens/s, MFU and peak memory per system and phase timings, one JSON line each (benchmarks/gpu_bench.py says how
# each figure is counted). A few minutes of device time on an H100 / H200.
#
#   benchmarks/gpu.sh [--dry-run] [--no-peer] [--no-liger] [gpu_bench.py options]   measure (--dry-run: tiny, CPU)
#   benchmarks/gpu.sh --pack [PYTHON_VERSION]            gather what a GPU machine without network needs (see below)
#
# Pythons, first found wins:
#   tuneforge:    $TUNEFORGE_PYTHON, else $GPU_BENCH_WORK/venv, else the project's .venv, else python3 -- any that
#                 imports torch (with CUDA, unless --dry-run), transformers, peft, accelerate and datasets;
#                 else, with network, a new $GPU_BENCH_WORK/venv (pip install -e '.[liger]': CUDA torch from PyPI).
#   LlamaFactory: $PEER_PYTHON (with $PEER_PYTHONPATH if set; PEER_PYTHON=none skips it), else
#                 $GPU_BENCH_WORK/peer-venv, else (--dry-run) the CPU peer's venv of ../shared/bench/peer-llamafactory.sh
#                 ($PEER_VENV); else, with network, a new $GPU_BENCH_WORK/peer-venv (llamafactory==0.9.5, liger-kernel);
#                 else it is skipped.
# A GPU machine without network whose python3 has CUDA torch (a CUDA image): run `--pack 3.12` (that python's
# version) where the project is set up. It writes $GPU_BENCH_WORK/assets: the built-in model's tokenizer and
# LlamaFactory's alpaca_en_demo (5 MB) and, in wheels/cp312, the wheels of the versions this project's python and the
# CPU peer's venv run (~40 MB: transformers, peft, datasets, accelerate, llamafactory, trl, liger-kernel and the
# pure-Python packages they need beside torch). Bring assets/ along: there this script installs the wheels into
# $GPU_BENCH_WORK/site-{ours,peer,liger} and puts them first on each system's path (--no-liger: not liger's).
# $GPU_BENCH_WORK defaults to .cache/gpu-bench.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=${GPU_BENCH_WORK:-$root/.cache/gpu-bench}
dry=0 peer=1 pack=0 liger=1 pack_version= args=()
for a in "$@"; do
  case $a in
    --dry-run) dry=1; args+=("$a") ;;
    --no-peer) peer=0 ;;
    --no-liger) liger=0 ;;
    --pack) pack=1 ;;
    [0-9].[0-9]*) if [[ $pack == 1 ]]; then pack_version=$a; else args+=("$a"); fi ;;
    -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
    *) args+=("$a") ;;
  esac
done
# the wheels --pack gathers for each system: its stack beside torch, numpy, pandas and pyarrow
OURS_WHEELS="transformers peft datasets accelerate huggingface_hub tokenizers safetensors dill multiprocess fsspec
  regex httpx2 httpcore2 truststore idna"
PEER_WHEELS="llamafactory transformers peft datasets accelerate trl huggingface_hub tokenizers dill multiprocess
  fsspec regex omegaconf torchdata"
say() { echo "[gpu.sh] $*" >&2; }
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)

# usable PY NEED_CUDA: PY imports what tuneforge needs (and sees a GPU when NEED_CUDA is 1)
usable() {
  [[ -x $1 ]] || command -v "$1" >/dev/null || return 1
  (cd "$root" && "$1" -c "import torch, transformers, peft, accelerate, datasets, tuneforge
assert $2 == 0 or torch.cuda.is_available()" 2>/dev/null)
}
pick_ours() {
  local need_cuda=$((1 - dry))
  if [[ -n ${TUNEFORGE_PYTHON:-} ]]; then
    usable "$TUNEFORGE_PYTHON" "$need_cuda" && { echo "$TUNEFORGE_PYTHON"; return; }
    say "TUNEFORGE_PYTHON=$TUNEFORGE_PYTHON does not import torch$([[ $need_cuda == 1 ]] && echo ' with CUDA'), transformers, peft, accelerate, datasets"
    exit 2
  fi
  for py in "$work/venv/bin/python" "$root/.venv/bin/python" python3; do
    usable "$py" "$need_cuda" && { echo "$py"; return; }
  done
  say "no python with tuneforge's dependencies$([[ $need_cuda == 1 ]] && echo ' and CUDA torch'); building $work/venv (needs network)"
  python3 -m venv "$work/venv" >&2
  "$work/venv/bin/pip" install -q -e "$root[liger]" >&2 || {
    say "could not install tuneforge's dependencies (no network?): set TUNEFORGE_PYTHON to a python with CUDA torch, transformers, peft, accelerate and datasets"
    exit 2; }
  echo "$work/venv/bin/python"
}
# pick_peer: prints "PY [PYTHONPATH]" or nothing (skipped)
pick_peer() {
  [[ $peer == 1 && ${PEER_PYTHON:-} != none ]] || return 0
  local check="import llamafactory, torch
assert $((1 - dry)) == 0 or torch.cuda.is_available()"
  if [[ -n ${PEER_PYTHON:-} ]]; then
    PYTHONPATH=${PEER_PYTHONPATH:-${PYTHONPATH:-}} "$PEER_PYTHON" -c "$check" 2>/dev/null || {
      say "PEER_PYTHON=$PEER_PYTHON${PEER_PYTHONPATH:+ (PYTHONPATH=$PEER_PYTHONPATH)} does not import llamafactory and CUDA torch"; exit 2; }
    echo "$PEER_PYTHON ${PEER_PYTHONPATH:-}"; return
  fi
  [[ -x $work/peer-venv/bin/python ]] && "$work/peer-venv/bin/python" -c "$check" 2>/dev/null && { echo "$work/peer-venv/bin/python"; return; }
  if [[ $dry == 1 ]]; then  # the CPU peer's venv, with its torchaudio stand-in
    local venv=${PEER_VENV:-$HOME/.cache/tuneforge-peer/lf-venv}
    [[ -x $venv/bin/python ]] && { echo "$venv/bin/python $venv/stubs"; return; }
    say "no LlamaFactory venv for the dry run ($venv): the peer is skipped"; return 0
  fi
  say "building $work/peer-venv with llamafactory==0.9.5 (needs network)"
  python3 -m venv "$work/peer-venv" >&2
  if "$work/peer-venv/bin/pip" install -q llamafactory==0.9.5 liger-kernel >&2; then
    echo "$work/peer-venv/bin/python"
  else
    say "could not install llamafactory (no network?): set PEER_PYTHON to a python with llamafactory==0.9.5 and CUDA torch; the peer is skipped"
  fi
}

# pins PY NAMES: NAME==VERSION of those of NAMES that PY has installed
pins() {
  "$1" -c 'import sys
from importlib import metadata
def pin(name):
    try:
        return f"{name}=={metadata.version(name)}"
    except metadata.PackageNotFoundError:
        return ""
print(" ".join(filter(None, map(pin, sys.argv[1:]))))' $2
}
# pack_wheels DIR REQUIREMENT...: their wheels for python $pack_version on x86-64 Linux
pack_wheels() {
  local dir=$1 tag=${pack_version/./}
  shift
  mkdir -p "$dir"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pack_version" --implementation cp \
    --abi "cp$tag" --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$dir" "$@" >&2
  say "$dir: $*"
}
# install_wheels SIDE: the packed wheels of SIDE for this python installed (once) in a folder of their own; prints it
install_wheels() {
  local py=${TUNEFORGE_PYTHON:-python3} tag wheels site=$work/site-$1
  tag=$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  wheels=$work/assets/wheels/$tag/$1
  [[ -d $wheels ]] || return 0
  if [[ ! -f $site/.installed ]]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$wheels"/*.whl >&2 ||
      { say "could not install the wheels of $wheels"; exit 2; }
    touch "$site/.installed"
  fi
  echo "$site"
}

if [[ $pack == 1 ]]; then
  py=$(dry=1 pick_ours)
  if [[ -n $pack_version ]]; then
    wheels=$work/assets/wheels/cp${pack_version/./}
    pack_wheels "$wheels/ours" $(pins "$py" "$OURS_WHEELS")
    liger_pin=$(pins "$py" liger-kernel)  # where it is not installed (it needs CUDA), the extra's newest
    pack_wheels "$wheels/liger" "${liger_pin:-liger-kernel>=0.8.5,<0.9}"
    peer_venv=${PEER_VENV:-$HOME/.cache/tuneforge-peer/lf-venv}
    if [[ -x $peer_venv/bin/python ]]; then
      pack_wheels "$wheels/peer" $(pins "$peer_venv/bin/python" "$PEER_WHEELS")
    else
      say "no LlamaFactory venv at $peer_venv (run ../shared/bench/peer-llamafactory.sh once): no peer wheels"
    fi
  fi
  "$py" - "$work/assets" <<'EOF'
import shutil, sys
from pathlib import Path
sys.path.insert(0, "benchmarks")
from train_throughput import DEFAULT_DATA
from tuneforge.model.hub import builtin_model_dir
out = Path(sys.argv[1])
tok = out / "tokenizer"
tok.mkdir(parents=True, exist_ok=True)
for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    if (builtin_model_dir() / name).is_file():
        shutil.copy(builtin_model_dir() / name, tok / name)
data = out / "data"
data.mkdir(exist_ok=True)
shutil.copy(DEFAULT_DATA / "alpaca_en_demo.json", data)
info = __import__("json").loads((DEFAULT_DATA / "dataset_info.json").read_text())
(data / "dataset_info.json").write_text(__import__("json").dumps({"alpaca_en_demo": info["alpaca_en_demo"]}, indent=2))
print(out)
EOF
  exit 0
fi

# the packed wheels for this python, if any, first on each system's path
ours_site=$(install_wheels ours)
liger_site=
[[ $liger == 1 ]] && liger_site=$(install_wheels liger)
ours_site=$ours_site${liger_site:+:$liger_site}
[[ -n $ours_site ]] && export PYTHONPATH=${ours_site#:}${PYTHONPATH:+:$PYTHONPATH}
peer_site=$(install_wheels peer)
if [[ -n $peer_site && -z ${PEER_PYTHON:-} ]]; then
  PEER_PYTHON=${TUNEFORGE_PYTHON:-python3} PEER_PYTHONPATH=$peer_site${liger_site:+:$liger_site}
fi
ours=$(pick_ours)
peer_line=$(pick_peer)
read -r peer_py peer_path <<<"$peer_line" || true
say "tuneforge: $ours${ours_site:+ (with ${ours_site#:})}; LlamaFactory: ${peer_py:-skipped}${peer_path:+ (with $peer_path)};" \
  "setup $(( $(date +%s) - start )) s"
extra=()
[[ -n ${peer_py:-} ]] && extra+=(--peer-python "$peer_py")
[[ -n ${peer_path:-} ]] && extra+=(--peer-pythonpath "$peer_path")
[[ -d $work/assets && " ${args[*]} " != *" --assets "* ]] && extra+=(--assets "$work/assets")
cd "$root"
export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH}  # tuneforge itself, when it is not pip-installed
exec "$ours" benchmarks/gpu_bench.py --work "$work" "${extra[@]}" "${args[@]}"
