"""`tuneforge eval CONFIG` from the command line: the summary on stdout, errors as one line and exit 2."""

from tuneforge.cli import main


def test_eval_command(tiny_model_dir, toy_task, tmp_path, capsys):
    cfg = tmp_path / "eval.yaml"
    cfg.write_text(f"model_name_or_path: {tiny_model_dir}\ntask: toy_test\ntask_dir: {toy_task}\nn_shot: 1\n"
                   f"template: fewshot\nsave_dir: {tmp_path / 'out'}\n")
    assert main(["eval", str(cfg), "batch_size=3"]) == 0
    out = capsys.readouterr().out
    assert "toy_test (test split, 5 questions), 1-shot, lang en" in out and "Average: " in out
    assert (tmp_path / "out" / "results.json").is_file()
    assert main(["eval", str(cfg), "task=nosuch_test"]) == 2
    err = capsys.readouterr().err
    assert "error: task 'nosuch_test': no folder 'nosuch'" in err and "tasks found: toy_dev, toy_test" in err
    assert "Traceback" not in err


def test_llamafactory_eval_file_loads(tmp_path):
    """LlamaFactory's eval YAML (llama3_lora_eval.yaml's keys) loads unchanged."""
    from tuneforge.config import load
    from tuneforge.eval import eval_kind

    cfg_file = tmp_path / "lf_eval.yaml"
    cfg_file.write_text("model_name_or_path: smollm2-135m-instruct\ntrust_remote_code: true\nfinetuning_type: lora\n"
                        "task: mmlu_test\ntemplate: fewshot\nlang: en\nn_shot: 5\nsave_dir: saves/eval\n"
                        "batch_size: 4\ndownload_mode: reuse_dataset_if_exists\n")
    cfg = load(cfg_file, for_training=False)
    assert (cfg.eval.task, cfg.model.template, cfg.eval.n_shot, cfg.eval.save_dir) == (
        "mmlu_test", "fewshot", 5, "saves/eval")
    assert eval_kind(cfg) == "mc"


def test_train_with_do_predict_runs_the_prediction(tiny_model_dir, alpaca_dir, home, tmp_path, capsys):
    """LlamaFactory's predict file: `tuneforge train` with do_train: false, do_predict: true."""
    cfg = tmp_path / "predict.yaml"
    cfg.write_text(f"model_name_or_path: {tiny_model_dir}\nstage: sft\ndo_train: false\ndo_predict: true\n"
                   f"predict_with_generate: true\neval_dataset: tiny_alpaca\ndataset_dir: {alpaca_dir}\n"
                   f"output_dir: {tmp_path / 'out'}\nper_device_eval_batch_size: 3\nmax_new_tokens: 4\n")
    assert main(["train", str(cfg)]) == 0
    assert capsys.readouterr().out.startswith("predict_bleu-4 ")
    assert len((tmp_path / "out" / "generated_predictions.jsonl").read_text().splitlines()) == 3
