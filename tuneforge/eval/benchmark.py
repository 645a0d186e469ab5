"""Multiple-choice benchmarks in the MMLU layout, read and checked before any model loads.

`task: NAME_SPLIT` (split = the part after the last `_`) reads task_dir/NAME/:

    NAME/mapping.json                 optional: {subject: {"name": display name, "category": category}}
    NAME/SPLIT/SUBJECT_SPLIT.csv      one file per subject (also .json: a list of rows, or .jsonl)
    NAME/dev/SUBJECT_dev.csv          the solved examples for n_shot > 0

(an unzipped MMLU archive, with the split folders under NAME/data/, works too). A CSV is headerless
`question,A,B,C,D,answer` as in MMLU, or has a header row that names those columns (C-Eval, CMMLU; other
columns are ignored). JSON rows are objects with the keys question, A, B, C, D and answer. LlamaFactory's
split names `validation` and `train` find the `val` and `dev` folders.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tuneforge.errors import ConfigError, DataError

CHOICES = ("A", "B", "C", "D")
COLUMNS = ("question", *CHOICES, "answer")
SUFFIXES = (".csv", ".json", ".jsonl")
SPLIT_ALIASES = {"validation": "val", "train": "dev"}  # LlamaFactory's names for MMLU's folders
FEW_SHOT_SPLIT = "dev"


@dataclass(frozen=True)
class Question:
    question: str
    choices: tuple[str, ...]  # the texts of A, B, C, D
    answer: str  # one of CHOICES
    where: str  # "file, row N", for messages


@dataclass
class Subject:
    key: str  # the file name's SUBJECT part
    name: str  # display name (mapping.json, else the key with spaces)
    category: str | None
    questions: list[Question]
    shots: list[Question] = field(default_factory=list)  # the dev split's examples


@dataclass
class Benchmark:
    task: str
    name: str
    split: str
    folder: Path  # the split's folder
    subjects: list[Subject]

    @property
    def size(self) -> int:
        return sum(len(s.questions) for s in self.subjects)


def parse_task(task: str) -> tuple[str, str]:
    """`mmlu_test` -> ("mmlu", "test"); the split is the part after the last underscore."""
    name, sep, split = task.rpartition("_")
    if not sep or not name or not split:
        raise ConfigError(f"task '{task}' must look like NAME_SPLIT (e.g. mmlu_test, tuneforge_mc_test): "
                          f"the benchmark folder in task_dir and its split")
    return name, split


def _split_folders(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and _subject_files(p, p.name))


def _data_root(folder: Path) -> Path:
    """The folder holding the split folders: NAME/, or NAME/data/ (an unzipped MMLU archive)."""
    inner = folder / "data"
    return inner if inner.is_dir() and _split_folders(inner) else folder


def available_tasks(task_dir: Path) -> list[str]:
    """NAME_SPLIT for every benchmark folder and split found in task_dir."""
    if not task_dir.is_dir():
        return []
    tasks = []
    for folder in sorted(p for p in task_dir.iterdir() if p.is_dir()):
        tasks += [f"{folder.name}_{split}" for split in _split_folders(_data_root(folder))]
    return tasks


def _subject_files(folder: Path, split: str) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        stem, suffix = path.stem, path.suffix.lower()
        if path.is_file() and suffix in SUFFIXES and stem.endswith(f"_{split}") and len(stem) > len(split) + 1:
            subject = stem[: -len(split) - 1]
            if subject in found:
                raise DataError(f"subject '{subject}' has two files in {folder}: {found[subject].name} and "
                                f"{path.name}; keep one")
            found[subject] = path
    return found


def _resolve_split(root: Path, split: str, task: str, task_dir: Path) -> Path:
    for name in (split, SPLIT_ALIASES.get(split)):
        if name and (root / name).is_dir():
            return root / name
    splits = _split_folders(root)
    raise DataError(
        f"task '{task}': {root} has no '{split}' split folder; splits found: {', '.join(splits) or 'none'}"
        + (f" (tasks: {', '.join(available_tasks(task_dir))})" if splits else "")
    )


def load_benchmark(task: str, task_dir: str | Path, n_shot: int) -> Benchmark:
    """Every subject's questions (and n_shot examples from its dev split), checked row by row."""
    task_dir = Path(task_dir)
    name, split = parse_task(task)
    folder = task_dir / name
    if not folder.is_dir():
        where = f"task_dir '{task_dir}' ({task_dir.resolve()})"
        if not task_dir.is_dir():
            raise DataError(f"{where} does not exist; set task_dir to the folder that holds the benchmark "
                            f"folders (tuneforge's own benchmark is evaluation/ in the repository)")
        tasks = available_tasks(task_dir)
        raise DataError(f"task '{task}': no folder '{name}' in {where}; tasks found: {', '.join(tasks) or 'none'}")
    root = _data_root(folder)
    if not _split_folders(root) and any(folder.glob("*.zip")):
        raise DataError(f"task '{task}': {folder} holds an archive but no split folders; unzip it there "
                        f"(so that {folder}/{split}/SUBJECT_{split}.csv exist)")
    split_folder = _resolve_split(root, split, task, task_dir)
    files = _subject_files(split_folder, split_folder.name)
    if not files:
        raise DataError(f"task '{task}': {split_folder} has no SUBJECT_{split_folder.name}.csv / .json / .jsonl files")
    mapping = _read_mapping(folder / "mapping.json")
    shot_files: dict[str, Path] = {}
    if n_shot > 0:
        shot_folder = root / FEW_SHOT_SPLIT
        shot_files = _subject_files(shot_folder, FEW_SHOT_SPLIT) if shot_folder.is_dir() else {}
        missing = [s for s in files if s not in shot_files]
        if missing:
            raise DataError(
                f"task '{task}': n_shot {n_shot} takes solved examples from {shot_folder}/SUBJECT_dev.csv, but "
                f"{shot_folder}/{missing[0]}_dev.csv (or .json / .jsonl) does not exist; add it, or set n_shot: 0"
            )
    subjects = []
    for key, path in files.items():
        info = mapping.get(key, {})
        shots = read_questions(shot_files[key]) if key in shot_files else []
        subjects.append(Subject(key, info.get("name") or key.replace("_", " "), info.get("category"),
                                read_questions(path), shots))
    return Benchmark(task=task, name=name, split=split_folder.name, folder=split_folder, subjects=subjects)


def _read_mapping(path: Path) -> dict[str, dict[str, Any]]:
    if not path.is_file():
        return {}
    try:
        mapping = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(mapping, dict) or not all(isinstance(v, dict) for v in mapping.values()):
        raise DataError(f'{path} must map each subject to {{"name": ..., "category": ...}}')
    return mapping


def read_questions(path: Path) -> list[Question]:
    """The questions of one subject file; a bad row raises DataError naming the file and row."""
    if path.suffix.lower() == ".csv":
        return _read_csv(path)
    text = path.read_text(encoding="utf-8")
    rows: list[tuple[str, Any]] = []
    if path.suffix.lower() == ".jsonl":
        for line_no, line in enumerate(text.splitlines(), 1):
            if line.strip():
                rows.append((f"{path}, row {len(rows) + 1} (line {line_no})", _json(line, path, line_no)))
    else:
        data = _json(text, path, None)
        if not isinstance(data, list):
            raise DataError(f"{path} must hold a JSON list of rows with keys {', '.join(COLUMNS)}")
        rows = [(f"{path}, row {i + 1}", row) for i, row in enumerate(data)]
    out = []
    for where, row in rows:
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected an object with keys {', '.join(COLUMNS)}, got {type(row).__name__}")
        missing = [k for k in COLUMNS if k not in row]
        if missing:
            raise DataError(f"{where}: no '{missing[0]}' key (each row needs {', '.join(COLUMNS)})")
        out.append(_question([row[k] for k in COLUMNS], where))
    return out


def _json(text: str, path: Path, line: int | None) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        at = f", line {line}" if line else ""
        raise DataError(f"{path}{at} is not valid JSON: {e}") from None


def _read_csv(path: Path) -> list[Question]:
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.reader(f)
        records = [(reader.line_num, row) for row in reader if row]
    if not records:
        return []
    header = [cell.strip() for cell in records[0][1]]
    named = {cell.lower() if cell.lower() in ("question", "answer") else cell: i for i, cell in enumerate(header)}
    if "question" in named:  # a header row (C-Eval, CMMLU): columns by name
        missing = [k for k in COLUMNS if k not in named]
        if missing:
            raise DataError(f"{path}: the header row has no '{missing[0]}' column (it has {', '.join(header)}); "
                            f"the columns must be {', '.join(COLUMNS)}")
        index, records = [named[k] for k in COLUMNS], records[1:]
    else:
        index = list(range(len(COLUMNS)))
    out = []
    for number, (line, row) in enumerate(records, 1):
        where = f"{path}, row {number} (line {line})"
        if "question" not in named and len(row) != len(COLUMNS):
            raise DataError(f"{where}: {len(row)} columns, expected {len(COLUMNS)}: {','.join(COLUMNS)} "
                            f"(headerless, as in MMLU), or add a header row naming them")
        if len(row) <= max(index):
            raise DataError(f"{where}: {len(row)} columns, but the header names {len(header)}")
        out.append(_question([row[i] for i in index], where))
    return out


def _question(values: list[Any], where: str) -> Question:
    question, *choices, answer = ("" if v is None else str(v) for v in values)
    letter = answer.strip().upper()
    if letter not in CHOICES:
        raise DataError(f"{where}: answer {answer!r} is not one of {', '.join(CHOICES)}")
    if not question.strip():
        raise DataError(f"{where}: the question is empty")
    return Question(question, tuple(choices), letter, where)
