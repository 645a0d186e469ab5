"""The MMLU layout: subjects from CSV / JSON / JSONL, the dev split's examples, and errors that name the
file and row (or list what exists) before any model loads."""

import json
from collections import Counter
from pathlib import Path

import pytest
from eval_helpers import TOY_ROWS, write_csv

from tuneforge.errors import ConfigError, DataError
from tuneforge.eval.benchmark import load_benchmark, parse_task, read_questions

REPO = Path(__file__).resolve().parents[2]


def test_parse_task():
    assert parse_task("mmlu_test") == ("mmlu", "test")
    assert parse_task("tuneforge_mc_test") == ("tuneforge_mc", "test")
    with pytest.raises(ConfigError, match="NAME_SPLIT"):
        parse_task("mmlu")


def test_reads_csv_and_jsonl_subjects_with_mapping(toy_task):
    bench = load_benchmark("toy_test", toy_task, n_shot=2)
    assert bench.split == "test" and bench.size == 5
    colors, numbers = bench.subjects
    assert (colors.key, colors.name, colors.category) == ("colors", "colours of things", "Perception")
    assert (numbers.key, numbers.name, numbers.category) == ("numbers", "small numbers", "STEM")
    q = colors.questions[1]
    assert (q.question, q.choices, q.answer) == ("What color is grass?", ("Pink", "Green", "White", "Gray"), "B")
    assert [s.answer for s in numbers.questions] == ["D", "A"]
    assert [s.question for s in colors.shots] == [r[0] for r in TOY_ROWS["colors"]["dev"]]
    assert len(numbers.shots) == 1


def test_header_csv_json_and_aliases(tmp_path):
    root = tmp_path / "ceval"
    write_csv(root / "val" / "law_val.csv", [("id", "question", "A", "B", "C", "D", "Answer", "explanation"),
                                            ("0", "Q?", "a", "b", "c", "d", "c", "because")])
    (root / "val" / "art_val.json").write_text(json.dumps([{"question": "Q2?", "A": 1, "B": 2, "C": 3, "D": 4,
                                                            "answer": "D"}]))
    bench = load_benchmark("ceval_validation", tmp_path, n_shot=0)  # LlamaFactory's split name
    assert [s.key for s in bench.subjects] == ["art", "law"] and bench.split == "val"
    art, law = bench.subjects
    assert art.questions[0].choices == ("1", "2", "3", "4") and art.name == "art" and art.category is None
    assert (law.questions[0].question, law.questions[0].answer) == ("Q?", "C")


def test_bad_rows_name_the_file_and_row(tmp_path):
    path = write_csv(tmp_path / "a_test.csv", [("Q1?", "a", "b", "c", "d", "A"), ("Q2?", "a", "b", "c", "d")])
    with pytest.raises(DataError, match=rf"{path}, row 2 \(line 2\): 5 columns, expected 6"):
        read_questions(path)
    path = write_csv(tmp_path / "b_test.csv", [("Q1?", "a", "b", "c", "d", "E")])
    with pytest.raises(DataError, match=rf"{path}, row 1 \(line 1\): answer 'E' is not one of A, B, C, D"):
        read_questions(path)
    path = write_csv(tmp_path / "c_test.csv", [("question", "A", "B", "C", "D"), ("Q?", "a", "b", "c", "d")])
    with pytest.raises(DataError, match=rf"{path}: the header row has no 'answer' column"):
        read_questions(path)
    path = tmp_path / "d_test.jsonl"
    path.write_text('{"question": "Q", "A": "a", "B": "b", "C": "c", "D": "d", "answer": "A"}\n\n'
                    '{"question": "Q", "A": "a", "B": "b", "C": "c", "D": "d"}\n')
    with pytest.raises(DataError, match=rf"{path}, row 2 \(line 3\): no 'answer' key"):
        read_questions(path)


def test_missing_task_split_and_dev_files_list_what_exists(toy_task):
    with pytest.raises(DataError, match=r"task 'nosuch_test': no folder 'nosuch' .* tasks found: toy_dev, toy_test"):
        load_benchmark("nosuch_test", toy_task, 0)
    with pytest.raises(DataError, match=r"no 'val' split folder; splits found: dev, test"):
        load_benchmark("toy_val", toy_task, 0)
    with pytest.raises(DataError, match="does not exist; set task_dir"):
        load_benchmark("toy_test", toy_task / "missing", 0)
    (toy_task / "toy" / "dev" / "numbers_dev.jsonl").unlink()
    assert load_benchmark("toy_test", toy_task, 0).size == 5  # 0-shot needs no dev files
    with pytest.raises(DataError, match=r"dev/numbers_dev.csv \(or .json / .jsonl\) does not exist; add it, "
                                        r"or set n_shot: 0"):
        load_benchmark("toy_test", toy_task, 1)


def test_shipped_benchmark_is_well_formed():
    bench = load_benchmark("tuneforge_mc_test", REPO / "evaluation", n_shot=5)
    assert [s.key for s in bench.subjects] == ["arithmetic", "basic_science", "english_vocabulary",
                                                "world_geography"]
    for s in bench.subjects:
        assert len(s.questions) == 12 and len(s.shots) == 5 and s.category
        assert Counter(q.answer for q in s.questions) == {"A": 3, "B": 3, "C": 3, "D": 3}  # chance is 25%
        texts = [q.question for q in s.questions + s.shots]
        assert len(set(texts)) == len(texts)  # no example repeats a test question
        assert all(len(set(q.choices)) == 4 for q in s.questions + s.shots)
