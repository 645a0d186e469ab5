"""predict_with_generate on a vision-language model: each answer is what the model says about that row's image,
batched or not."""

from __future__ import annotations

import json
from pathlib import Path

from tuneforge.config import from_dict
from tuneforge.eval import evaluate

DATA = Path(__file__).resolve().parents[2] / "data"


def run(vlm_dir, out, batch_size):
    cfg = from_dict({"model_name_or_path": str(vlm_dir), "stage": "sft", "do_train": False, "do_predict": True,
                     "predict_with_generate": True, "eval_dataset": "shapes_test", "dataset_dir": str(DATA),
                     "max_samples": 4, "output_dir": str(out), "per_device_eval_batch_size": batch_size,
                     "do_sample": False, "max_new_tokens": 6, "image_max_pixels": 112 * 112,
                     "skip_special_tokens": False}, for_training=True)
    result = evaluate(cfg)
    return result, [json.loads(x) for x in (out / "generated_predictions.jsonl").read_text().splitlines()]


def test_predictions_with_images_batched_equal_one_at_a_time(loud_vlm, home, tmp_path):
    result, batched = run(loud_vlm, tmp_path / "two", 2)
    _, single = run(loud_vlm, tmp_path / "one", 1)
    rows = json.loads((DATA / "shapes_test.json").read_text())[:4]
    assert [x["label"] for x in batched] == [r["messages"][-1]["content"] for r in rows]
    assert all(x["prompt"].count("<|vision_start|>") == 1 and "<|image_pad|>" in x["prompt"] for x in batched)
    assert [x["predict"] for x in batched] == [x["predict"] for x in single] and all(x["predict"] for x in batched)
    assert result["predict_samples"] == 4


def test_eval_loss_of_a_vlm_on_its_image_rows(vlm_dir, home, tmp_path):
    def loss(model_dir):
        cfg = from_dict({"model_name_or_path": str(model_dir), "stage": "sft", "eval_dataset": "shapes_test",
                         "dataset_dir": str(DATA), "image_max_pixels": 112 * 112, "save_dir": str(tmp_path / "ev")},
                        for_training=False)
        return evaluate(cfg)

    result = loss(vlm_dir)
    assert result["kind"] == "loss" and result["eval_loss"] > 0 and result["eval_samples"] == 8
