"""Preprocessing (tokenizing for sft and pt) throughput, beside LlamaFactory 0.9.5 with the same number of workers.

    python benchmarks/preprocess_throughput.py [--data alpaca|sharegpt|both|pt] [--workers N] [--repeat R] [--peer]
                                               [--cutoff-len L] [--model-dir DIR] [--dataset-dir DIR]
                                               [--chat-template FILE --peer-template NAME]

alpaca: LlamaFactory's alpaca_en_demo (999 rows). sharegpt: 10,000 sharegpt rows built from those rows (1 to 4
turns each, questions drawn with a fixed seed, a system prompt on every third row), written to a temporary folder.
pt: stage pt on a 9,900-document corpus, LlamaFactory's c4_demo and wiki_demo 30 times over (11.9 M tokens),
documents tokenized with EOS after each and cut into cutoff_len rows across documents by both.

Each measurement runs in a fresh child process with its own empty datasets cache (both read the JSON file) and
times the data step alone, after the tokenizer is loaded: tuneforge's `data.build` (overwrite_cache: reading,
tokenizing, the statistics, writing the cache entry and opening it), and LlamaFactory's `get_dataset` (reading,
converting, tokenizing) through its own argument parser, run by the peer's venv (PEER_VENV, default
~/.cache/tuneforge-peer/lf-venv, built by ../shared/bench/peer-llamafactory.sh). Both use the built-in
SmolLM2-135M-Instruct tokenizer: tuneforge with the tokenizer's own chat template, LlamaFactory with its smollm2
template and that template's default system prompt written as the tokenizer's (LlamaFactory's has a final period),
so the two write the same token ids; the ratio line says whether they did, row by row. (Their labels differ by
design: LlamaFactory also trains the newline after <|im_end|>.) With --chat-template FILE tuneforge renders with
that Jinja template as the tokenizer's own (tests/fixtures/chat_templates/qwen3.jinja is Qwen3's) and LlamaFactory
with its template --peer-template NAME (qwen3) and that template's default system prompt.

Prints one JSON line per measurement (seconds: the best of --repeat; cpu_seconds: of all its processes) and a
ratio line per dataset; PREP_KEEP=DIR keeps the generated data and both token id files (.npy) there. Timing is
measured, never asserted; run it on a quiet machine (`nice` does not keep other
load from slowing both).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

from llamafactory_peer import PEER_VENV, SMOLLM_SYSTEM, peer_venv  # benchmarks/ is this script's folder

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_DATA = ROOT.parent / "shared" / "data" / "llamafactory"

# times tuneforge's data step in a child process; argv: config JSON, ids output file
OURS = r"""
import json, resource, sys, time
import tuneforge
assert tuneforge.__file__.startswith(sys.argv[3]), f"timing the wrong tuneforge: {tuneforge.__file__}"
import datasets  # imported before the clock starts, as LlamaFactory's modules import it
import numpy as np
from transformers import AutoTokenizer
from tuneforge.config import from_dict
from tuneforge.data import build
cfg = from_dict(json.loads(sys.argv[1]), for_training=False)
tokenizer = AutoTokenizer.from_pretrained(cfg.model.model_name_or_path)
cpu, start = time.process_time(), time.perf_counter()
splits = build(cfg, tokenizer)
seconds = time.perf_counter() - start
children = resource.getrusage(resource.RUSAGE_CHILDREN)
ids = splits.train["input_ids"]
np.save(sys.argv[2], np.array([len(ids)] + [len(x) for x in ids] + [t for x in ids for t in x], dtype=np.int64))
print(json.dumps({"seconds": seconds, "cpu_seconds": time.process_time() - cpu + children.ru_utime + children.ru_stime,
                  "rows": len(ids), "tokens": splits.stats["tokens"], "supervised_tokens": splits.stats["supervised_tokens"]}))
"""

# the same for LlamaFactory, run by the peer's python
PEER = r"""
import json, resource, sys, time
import numpy as np
from llamafactory.data import get_dataset, get_template_and_fix_tokenizer
from llamafactory.hparams import get_train_args
from llamafactory.model import load_tokenizer
model_args, data_args, training_args, _, _ = get_train_args(json.loads(sys.argv[1]))
module = load_tokenizer(model_args)
template = get_template_and_fix_tokenizer(module["tokenizer"], data_args)
cpu, start = time.process_time(), time.perf_counter()
stage = json.loads(sys.argv[1])["stage"]
data = get_dataset(template, model_args, data_args, training_args, stage=stage, **module)["train_dataset"]
seconds = time.perf_counter() - start
children = resource.getrusage(resource.RUSAGE_CHILDREN)
ids = data["input_ids"]
labels = data["labels"] if "labels" in data.column_names else ids  # pt: the collator predicts every next token
np.save(sys.argv[2], np.array([len(ids)] + [len(x) for x in ids] + [t for x in ids for t in x], dtype=np.int64))
print(json.dumps({"seconds": seconds, "cpu_seconds": time.process_time() - cpu + children.ru_utime + children.ru_stime,
                  "rows": len(ids), "tokens": sum(map(len, ids)),
                  "supervised_tokens": sum(sum(t != -100 for t in x[1:]) for x in labels)}))
"""


def sharegpt_rows(alpaca: list[dict], count: int = 10_000, seed: int = 0) -> list[dict]:
    """`count` conversations of 1-4 alpaca question / answer turns (a system prompt on every third)."""
    rng = random.Random(seed)
    rows = []
    for j in range(count):
        turns = []
        for r in rng.sample(alpaca, 1 + j % 4):
            question = "\n".join(part for part in (r["instruction"], r.get("input")) if part)
            turns += [{"from": "human", "value": question}, {"from": "gpt", "value": r["output"]}]
        row: dict = {"conversations": turns}
        if j % 3 == 0:
            row["system"] = "You are a helpful assistant. Answer briefly and accurately."
        rows.append(row)
    return rows


def write_sharegpt(dataset_dir: Path, target: Path) -> None:
    alpaca = json.loads((dataset_dir / "alpaca_en_demo.json").read_text(encoding="utf-8"))
    (target / "sharegpt_10k.json").write_text(json.dumps(sharegpt_rows(alpaca)), encoding="utf-8")
    info = {"sharegpt_10k": {"file_name": "sharegpt_10k.json", "formatting": "sharegpt",
                             "columns": {"messages": "conversations", "system": "system"}}}
    (target / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")


def write_pt_corpus(dataset_dir: Path, target: Path, times: int = 30) -> None:
    """c4_demo's and wiki_demo's documents, `times` over, as one pt dataset."""
    lines = (dataset_dir / "c4_demo.jsonl").read_text(encoding="utf-8").splitlines()
    docs = [json.loads(line)["text"] for line in lines if line.strip()]
    docs += [line for line in (dataset_dir / "wiki_demo.txt").read_text(encoding="utf-8").splitlines() if line.strip()]
    (target / "pt_corpus.json").write_text(json.dumps([{"text": d} for _ in range(times) for d in docs]),
                                           encoding="utf-8")
    info = {"pt_corpus": {"file_name": "pt_corpus.json", "columns": {"prompt": "text"}}}
    (target / "dataset_info.json").write_text(json.dumps(info), encoding="utf-8")


def measure(python: str, code: str, config: dict, env: dict[str, str], ids_file: Path) -> dict:
    with tempfile.TemporaryDirectory(prefix="prep-bench-") as scratch:
        child_env = {**os.environ, **env, "HF_DATASETS_CACHE": str(Path(scratch) / "datasets"),
                     "TUNEFORGE_HOME": str(Path(scratch) / "home"), "TOKENIZERS_PARALLELISM": "false",
                     "HF_HUB_OFFLINE": "1"}
        done = subprocess.run([python, "-c", code, json.dumps(config), str(ids_file), str(ROOT)], env=child_env, cwd=scratch,
                              capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"measurement failed ({python}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def best_of(repeat: int, *args) -> dict:
    runs = [measure(*args) for _ in range(repeat)]
    return min(runs, key=lambda r: r["seconds"])


def line(system: str, data: str, workers: int, result: dict) -> dict:
    seconds = result["seconds"]
    return {"system": system, "data": data, "workers": workers, "rows": result["rows"], "tokens": result["tokens"],
            "supervised_tokens": result["supervised_tokens"], "seconds": round(seconds, 3),
            "cpu_seconds": round(result["cpu_seconds"], 3), "rows_per_sec": round(result["rows"] / seconds, 1),
            "tokens_per_sec": round(result["tokens"] / seconds)}


def same_rows(a: Path, b: Path) -> tuple[int, int]:
    """(rows whose token ids are equal, rows) of two saved id files."""
    import numpy as np

    def rows(path: Path) -> list:
        flat = np.load(path)  # the row count, each row's length, then the ids
        n = int(flat[0])
        return np.split(flat[1 + n:], np.cumsum(flat[1 : 1 + n])[:-1])

    x, y = rows(a), rows(b)
    return sum(len(p) == len(q) and bool((p == q).all()) for p, q in zip(x, y, strict=False)), max(len(x), len(y))


def peer_stream_in_ours(ours: Path, peer: Path, window: int = 32) -> int:
    """pt: how many of the peer's tokens, from its first, come in the same order in ours, stretches that only ours
    holds skipped. LlamaFactory cuts each map batch's documents into rows on their own and drops the batch's last
    partial row; tuneforge carries it into the next batch, so their rows part after the first batch while their
    tokens agree."""
    import numpy as np

    def stream(path: Path) -> np.ndarray:
        flat = np.load(path)  # the row count, each row's length, then the ids
        return flat[1 + int(flat[0]):]

    a, b = stream(ours), stream(peer)
    i = j = 0
    while i < len(a) and j < len(b):
        n = min(len(a) - i, len(b) - j)
        differ = np.flatnonzero(a[i:i + n] != b[j:j + n])
        if not len(differ):
            return j + n
        i, j = i + int(differ[0]), j + int(differ[0])
        ahead = b[j:j + window]
        found = next((k for k in range(i, min(len(a), i + 4096)) if np.array_equal(a[k:k + len(ahead)], ahead)), None)
        if found is None:
            break
        i = found
    return j


def with_chat_template(model_dir: str, template: Path, target: Path) -> str:
    """A folder with the model's tokenizer and config, the tokenizer's chat template replaced by this one."""
    import shutil

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = template.read_text(encoding="utf-8")
    tokenizer.save_pretrained(target)
    shutil.copy(Path(model_dir) / "config.json", target / "config.json")
    return str(target)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", choices=["alpaca", "sharegpt", "both", "pt"], default="both",
                        help="both: alpaca and sharegpt (sft); pt: the pretraining corpus")
    parser.add_argument("--workers", type=int, default=1, help="preprocessing_num_workers, for both")
    parser.add_argument("--repeat", type=int, default=1, help="runs per measurement; the fastest counts")
    parser.add_argument("--cutoff-len", type=int, default=1024)
    parser.add_argument("--peer", action="store_true", help="also time LlamaFactory 0.9.5 and print the ratios")
    parser.add_argument("--model-dir", help="the tokenizer's folder (default: the built-in SmolLM2-135M-Instruct)")
    parser.add_argument("--dataset-dir", default=str(DEFAULT_DATA))
    parser.add_argument("--chat-template", help="a Jinja chat template tuneforge renders with as the tokenizer's own")
    parser.add_argument("--peer-template", help="LlamaFactory's template beside --chat-template (e.g. qwen3)")
    args = parser.parse_args()
    if (args.chat_template is None) != (args.peer_template is None):
        parser.error("--chat-template and --peer-template go together")
    if args.chat_template and not Path(args.chat_template).is_file():
        parser.error(f"--chat-template {args.chat_template}: no such file (a Jinja chat template)")
    if args.peer:
        peer_venv()  # exits here, before any timing, when the peer is missing
    if args.model_dir is None:
        from tuneforge.model.hub import builtin_model_dir

        args.model_dir = str(builtin_model_dir())
    with tempfile.TemporaryDirectory(prefix="prep-data-") as tmp:
        tmp_dir = Path(os.environ.get("PREP_KEEP") or tmp)
        if args.chat_template:
            args.model_dir = with_chat_template(args.model_dir, Path(args.chat_template), tmp_dir / "tokenizer")
        sets = []
        if args.data in ("alpaca", "both"):
            sets.append(("alpaca_en_demo", "alpaca_en_demo", Path(args.dataset_dir), "sft"))
        if args.data in ("sharegpt", "both"):
            (tmp_dir / "sharegpt").mkdir(exist_ok=True)
            write_sharegpt(Path(args.dataset_dir), tmp_dir / "sharegpt")
            sets.append(("sharegpt_10k", "sharegpt_10k", tmp_dir / "sharegpt", "sft"))
        if args.data == "pt":
            (tmp_dir / "pt").mkdir(exist_ok=True)
            write_pt_corpus(Path(args.dataset_dir), tmp_dir / "pt")
            sets.append(("pt_corpus", "pt_corpus", tmp_dir / "pt", "pt"))
        for label, dataset, folder, stage in sets:
            common = {"model_name_or_path": args.model_dir, "stage": stage, "dataset_dir": str(folder),
                      "dataset": dataset, "cutoff_len": args.cutoff_len, "overwrite_cache": True,
                      "preprocessing_num_workers": args.workers}
            ours_ids = tmp_dir / f"{label}-tuneforge.npy"
            here = {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
            ours = line("tuneforge", label, args.workers,
                        best_of(args.repeat, sys.executable, OURS, common, here, ours_ids))
            print(json.dumps(ours), flush=True)
            if not args.peer:
                continue
            template = {"template": args.peer_template} if args.peer_template else \
                {"template": "smollm2", "default_system": SMOLLM_SYSTEM}
            peer_config = {**common, **template, "do_train": True, "finetuning_type": "lora",
                           "output_dir": str(tmp_dir / "lf-out"), "use_cpu": True, "report_to": "none"}
            peer_env = {"PYTHONPATH": str(PEER_VENV / "stubs"), "DISABLE_VERSION_CHECK": "1"}
            peer_ids = tmp_dir / f"{label}-peer.npy"
            peer = line("llamafactory-0.9.5", label, args.workers,
                        best_of(args.repeat, str(PEER_VENV / "bin" / "python"), PEER, peer_config, peer_env, peer_ids))
            print(json.dumps(peer), flush=True)
            equal, rows = same_rows(ours_ids, peer_ids)
            ratio = {"data": label, "workers": args.workers, "speedup": round(peer["seconds"] / ours["seconds"], 2),
                     "cpu_ratio": round(peer["cpu_seconds"] / ours["cpu_seconds"], 2),
                     "same_token_ids_rows": f"{equal}/{rows}"}
            if stage == "pt":
                found = peer_stream_in_ours(ours_ids, peer_ids)
                ratio["peer_tokens_in_order_in_ours"] = f"{found}/{peer['tokens']}"
                ratio["ours_tokens_the_peer_dropped"] = ours["tokens"] - found
            print(json.dumps(ratio), flush=True)


if __name__ == "__main__":
    main()
