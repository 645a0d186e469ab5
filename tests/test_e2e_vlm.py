"""A vision-language model through the CLI, as a user runs examples/sft_vlm_lora.yaml (on a tiny random Qwen2-VL):
the output loads with transformers + peft alone, a resumed run and two DDP processes train what one run does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from PIL import Image
from safetensors.torch import load_file
from test_distributed import train
from transformers import AutoModelForImageTextToText, AutoModelForMultimodalLM, AutoProcessor

from tuneforge.model.processor import load_processor

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = "examples/sft_vlm_lora.yaml"
SMALL = ["image_max_pixels=12544", "per_device_train_batch_size=4", "gradient_accumulation_steps=1", "max_steps=4",
         "cutoff_len=512"]


def demo_rows(lf_data_dir, name):
    """How many rows a LlamaFactory demo file holds (the shared copy's count, not a number written here)."""
    return len(json.loads((lf_data_dir / f"{name}.json").read_text()))


def weights(out):
    return load_file(out / "adapter_model.safetensors")


def assert_same_weights(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], atol=1e-5, rtol=0)


def test_the_example_trains_resumes_and_its_output_loads_without_tuneforge(tmp_path, vlm_dir):
    one = tmp_path / "one"
    train(EXAMPLE, one, vlm_dir, *SMALL, "save_strategy=steps", "save_steps=2", "eval_strategy=steps",
          "eval_steps=4")
    results = json.loads((one / "all_results.json").read_text())
    assert results["eval_loss"] > 0 and (one / "checkpoint-2").is_dir()
    config = json.loads((one / "adapter_config.json").read_text())
    assert all(t.startswith("model.language_model.") for t in config["target_modules"])
    assert (one / "processor_config.json").is_file() and (one / "chat_template.jinja").is_file()

    resumed = tmp_path / "resumed"
    train(EXAMPLE, resumed, vlm_dir, *SMALL, "save_strategy=steps", "save_steps=2",
          f"resume_from_checkpoint={one / 'checkpoint-2'}")
    assert_same_weights(one, resumed)

    # transformers + peft alone: the base, the adapter and the saved processor
    try:
        processor = AutoProcessor.from_pretrained(one)
    except ImportError:  # no torchvision here: the processor's video slot cannot load (tuneforge's loader can)
        processor = load_processor(one, AutoModelForImageTextToText.from_pretrained(vlm_dir).config)
    model = PeftModel.from_pretrained(AutoModelForImageTextToText.from_pretrained(vlm_dir), one).eval()
    messages = [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (56, 56), "red")},
                                             {"type": "text", "text": "What is it?"}]}]
    inputs = processor.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt",
                                           add_generation_prompt=True)
    with torch.no_grad():
        logits = model(**inputs).logits
        base = model.get_base_model()
        with model.disable_adapter():
            untrained = base(**inputs).logits
    assert torch.isfinite(logits).all() and not torch.allclose(logits, untrained)


def test_two_ddp_processes_train_what_one_process_trains(tmp_path, vlm_dir):
    one, two = tmp_path / "one", tmp_path / "two"
    train(EXAMPLE, one, vlm_dir, *SMALL)
    train(EXAMPLE, two, vlm_dir, *SMALL[:1], "per_device_train_batch_size=2", *SMALL[2:], processes=2)
    assert_same_weights(one, two)


def shape_pairs(root):
    """Ranking and feedback rows about our shapes pictures: the right answer against a wrong color."""
    rows = json.loads((ROOT / "data" / "shapes_train.json").read_text())[:8]
    root.mkdir(parents=True, exist_ok=True)
    pairs, feedback = [], []
    for i, r in enumerate(rows):
        image = str(ROOT / "data" / r["images"][0])
        answer = r["messages"][1]["content"]
        wrong = answer.replace("red", "X").replace("blue", "red").replace("X", "blue").replace("green", "blue")
        pairs.append({"messages": [r["messages"][0]], "images": [image],
                      "chosen": {"role": "assistant", "content": answer},
                      "rejected": {"role": "assistant", "content": wrong if wrong != answer else "A square."}})
        feedback.append({"messages": r["messages"][:2] if i % 2 == 0 else [r["messages"][0], pairs[-1]["rejected"]],
                         "images": [image], "label": i % 2 == 0})
    tags = {"role_tag": "role", "content_tag": "content", "user_tag": "user", "assistant_tag": "assistant"}
    (root / "pairs.json").write_text(json.dumps(pairs))
    (root / "feedback.json").write_text(json.dumps(feedback))
    (root / "dataset_info.json").write_text(json.dumps({
        "pairs": {"file_name": "pairs.json", "formatting": "sharegpt", "ranking": True, "tags": tags,
                  "columns": {"messages": "messages", "images": "images", "chosen": "chosen", "rejected": "rejected"}},
        "feedback": {"file_name": "feedback.json", "formatting": "sharegpt", "tags": tags,
                     "columns": {"messages": "messages", "images": "images", "kto_tag": "label"}}}))
    return root


@pytest.mark.parametrize("stage, dataset, metric, extra", [
    ("dpo", "pairs", "rewards/accuracies", []),
    ("dpo", "pairs", "rewards/accuracies", ["precompute_ref_log_probs=true"]),
    ("rm", "pairs", "rewards/margins", []),
    ("kto", "feedback", "rewards/chosen", []),
])
def test_preference_stages_train_on_images(tmp_path, vlm_dir, stage, dataset, metric, extra):
    data = shape_pairs(tmp_path / "data")
    out = tmp_path / stage
    train(EXAMPLE, out, vlm_dir, *SMALL, f"stage={stage}", f"dataset={dataset}", "eval_dataset=null",
          f"dataset_dir={data}", "per_device_train_batch_size=4", "max_steps=2", *extra)
    logged = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert any(metric in row for row in logged), logged[-1]


def test_fsdp2_trains_what_one_process_trains(tmp_path, vlm_dir):
    one, two = tmp_path / "one", tmp_path / "two"
    train(EXAMPLE, one, vlm_dir, *SMALL)
    r = train(EXAMPLE, two, vlm_dir, *SMALL[:1], "per_device_train_batch_size=2", *SMALL[2:], "fsdp=full_shard",
              processes=2)
    assert "fsdp:" in r.stderr
    assert_same_weights(one, two)


def test_an_audio_language_model_trains_on_llamafactorys_audio_demo(tmp_path, lf_data_dir):
    from mm_families import build_family

    model_dir = build_family("qwen2_audio", tmp_path / "qwen2-audio")
    out = tmp_path / "audio"
    r = train(EXAMPLE, out, model_dir, *SMALL, "dataset=mllm_audio_demo", "eval_dataset=null",
              f"dataset_dir={lf_data_dir}", "max_steps=2")
    rows = demo_rows(lf_data_dir, "mllm_audio_demo")
    assert f"train_samples={rows}," in r.stderr and "bad_rows=0" in r.stderr, r.stderr[-3000:]
    config = json.loads((out / "adapter_config.json").read_text())
    assert all(t.startswith("model.language_model.") for t in config["target_modules"])


def test_ask_before_and_after_training_a_vlm(tmp_path, vlm_dir):
    r = train(EXAMPLE, tmp_path / "ask", vlm_dir, *SMALL, "max_steps=1", "--ask", "What do you see?")
    assert r.stderr.count("asked 'What do you see?'") == 2


def test_llava_trains_on_padding_free_batches_and_two_processes_agree(tmp_path):
    from mm_families import build_family

    model_dir = build_family("llava", tmp_path / "llava")
    one, two = tmp_path / "one", tmp_path / "two"
    r = train(EXAMPLE, one, model_dir, *SMALL)
    assert "batches are padded" not in r.stderr and "needs padded batches" not in r.stderr
    train(EXAMPLE, two, model_dir, *SMALL[:1], "per_device_train_batch_size=2", *SMALL[2:], processes=2)
    assert_same_weights(one, two)


@pytest.mark.vision
def test_a_vlm_trains_on_llamafactorys_video_demo_and_two_processes_agree(tmp_path, vlm_dir, lf_data_dir):
    from mm_families import NO_VIDEO_REASON, video_processors_load

    if not video_processors_load():
        pytest.skip(NO_VIDEO_REASON)
    # the demo's rows twice: an even count splits evenly over 2 processes (an odd one is padded by repeating rows,
    # as torch's DistributedSampler does, so it would not train what one process does); with AdamW's default epsilon
    # a weight whose gradient is near 1e-8 turns summation-order rounding into a 5e-5 step difference
    video = [*SMALL, "dataset=mllm_video_demo,mllm_video_demo", "eval_dataset=null", f"dataset_dir={lf_data_dir}",
             "video_max_pixels=12544", "video_fps=1.0", "cutoff_len=2048", "adam_epsilon=1e-6"]
    one, two = tmp_path / "one", tmp_path / "two"
    r = train(EXAMPLE, one, vlm_dir, *video)
    rows = 2 * demo_rows(lf_data_dir, "mllm_video_demo")
    assert f"train_samples={rows}," in r.stderr and "bad_rows=0" in r.stderr, r.stderr[-3000:]
    train(EXAMPLE, two, vlm_dir, *video[:1], "per_device_train_batch_size=2", *video[2:], processes=2)
    assert_same_weights(one, two)


@pytest.mark.vision
def test_an_omni_model_hears_llamafactorys_video_audio_demo_and_exports_its_thinker(tmp_path, lf_data_dir):
    import subprocess
    import sys

    from mm_families import NO_VIDEO_REASON, build_family, video_processors_load

    if not video_processors_load():
        pytest.skip(NO_VIDEO_REASON)
    omni = build_family("qwen2_5_omni", tmp_path / "omni")
    out = tmp_path / "out"
    r = train(EXAMPLE, out, omni, *SMALL, "dataset=mllm_video_audio_demo", "eval_dataset=null",
              f"dataset_dir={lf_data_dir}", "use_audio_in_video=true", "video_max_pixels=12544", "video_fps=1.0",
              "cutoff_len=2048")
    rows = demo_rows(lf_data_dir, "mllm_video_audio_demo")
    assert f"train_samples={rows}," in r.stderr and "its thinker" in r.stderr, r.stderr[-3000:]
    merged = tmp_path / "merged"
    r = subprocess.run([sys.executable, "-m", "tuneforge.cli", "export", EXAMPLE, f"model_name_or_path={omni}",
                        f"adapter_name_or_path={out}", f"export_dir={merged}"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0 and "ollama create" not in r.stdout, r.stderr[-3000:]  # no Modelfile written
    model, processor = AutoModelForMultimodalLM.from_pretrained(merged), AutoProcessor.from_pretrained(merged)
    assert type(model).__name__ == "Qwen2_5OmniThinkerForConditionalGeneration"
    assert type(processor).__name__ == "Qwen2_5OmniProcessor"


@pytest.mark.parametrize("stage, extra", [("grpo", ["num_generations=2"]), ("ppo", ["ppo_epochs=1"])])
def test_rl_stages_sample_answers_about_images(tmp_path, vlm_dir, stage, extra):
    from mm_families import shape_prompts

    shape_prompts(tmp_path / "data")
    out = tmp_path / stage
    rl = [f"stage={stage}", "reward_funcs=accuracy", "dataset=prompts", f"dataset_dir={tmp_path / 'data'}",
          "eval_dataset=null", "max_completion_length=8", "per_device_train_batch_size=2", "max_steps=2"]
    train(EXAMPLE, out, vlm_dir, *SMALL, *rl, *extra)
    logged = [json.loads(x) for x in (out / "trainer_log.jsonl").read_text().splitlines()]
    assert any("rewards/accuracy/mean" in row for row in logged), logged[-1]
    assert (out / "adapter_model.safetensors").is_file() and (out / "processor_config.json").is_file()
    if stage == "grpo":  # held-out rewards of the trained policy, answering about the same pictures
        import subprocess
        import sys

        r = subprocess.run([sys.executable, "-m", "tuneforge.cli", "eval", EXAMPLE, f"model_name_or_path={vlm_dir}",
                            f"adapter_name_or_path={out}", f"save_dir={tmp_path / 'eval'}", "image_max_pixels=12544",
                            *rl[:5], "max_completion_length=8", "num_generations=2"],
                           capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        results = json.loads((tmp_path / "eval" / "eval_results.json").read_text())
        assert 0.0 <= results["eval_rewards/accuracy/mean"] <= 1.0
        lines = (tmp_path / "eval" / "generated_completions.jsonl").read_text().splitlines()
        assert len(lines) == 2 * 4 and json.loads(lines[0])["prompt"].count("<|image_pad|>") == 1


def test_packing_trains_qwen2_vl_and_llava_and_refuses_gemma3_before_tokenizing(tmp_path, vlm_dir):
    from mm_families import build_family

    for name, model_dir in (("qwen2_vl", vlm_dir), ("llava", build_family("llava", tmp_path / "llava"))):
        r = train(EXAMPLE, tmp_path / name, model_dir, *SMALL, "packing=true", "cutoff_len=1024")
        assert "packing=True" in r.stderr and "batches are padded" not in r.stderr, (name, r.stderr[-3000:])
    gemma3 = build_family("gemma3", tmp_path / "gemma3")
    r = train(EXAMPLE, tmp_path / "refused", gemma3, *SMALL, "packing=true", ok=False)
    assert r.returncode != 0 and "attends both ways within an image" in r.stderr and "set packing: false" in r.stderr
    assert "tokenizing" not in r.stderr
