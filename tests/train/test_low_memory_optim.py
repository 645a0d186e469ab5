"""The memory-efficient optimizers (GaLore, APOLLO, BAdam, Adam-mini, Muon): one step equals the package's own
optimizer built by hand on a copy of the model; each does what users rely on (GaLore projects only its targets,
BAdam trains one block and switches on time, Muon takes only the hidden matrices); and a run resumed from its middle
ends where the uninterrupted one did (the projectors, the active block and all state are in the checkpoint)."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from train_helpers import collate, load_model, make_cfg, random_dataset

from tuneforge.train import Trainer
from tuneforge.train.low_memory_optim import LayerwiseOptimizer, build_low_memory_optimizer, muon_params

pytest.importorskip("galore_torch")
pytest.importorskip("apollo_torch")
pytest.importorskip("badam")
pytest.importorskip("adam_mini")

LENGTHS = [5, 8, 6, 9, 4, 7, 10, 6]
LAYERWISE = {"gradient_accumulation_steps": 1, "max_grad_norm": 0}
CASES = {
    "galore": dict(use_galore=True, galore_rank=4, galore_update_interval=3),
    "galore_layerwise": dict(use_galore=True, galore_rank=4, galore_update_interval=3, galore_layerwise=True,
                             **LAYERWISE),
    "apollo": dict(use_apollo=True, apollo_rank=4, apollo_update_interval=3),
    "apollo_svd_layerwise": dict(use_apollo=True, apollo_rank=4, apollo_update_interval=3, apollo_proj="svd",
                                 apollo_layerwise=True, **LAYERWISE),
    "badam_layer": dict(use_badam=True, badam_switch_interval=3),
    "badam_random": dict(use_badam=True, badam_switch_interval=1, badam_switch_mode="random"),
    "adam_mini": dict(use_adam_mini=True),
    "muon": dict(use_muon=True, weight_decay=0.1),
}


def run_cfg(out, model_dir, **keys):
    base = dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=4, save_steps=2,
                save_strategy="steps", learning_rate=1e-2, lr_scheduler_type="cosine", warmup_steps=1)
    return make_cfg(out, model_dir, **{**base, **keys})


def losses(output_dir) -> list[float]:
    log = json.loads((output_dir / "trainer_state.json").read_text())["log_history"]
    return [e["loss"] for e in log if "loss" in e]


@pytest.mark.parametrize("keys", list(CASES.values()), ids=list(CASES))
def test_resume_in_the_middle_is_exact(tmp_path, tiny_model_dir, keys):
    data = random_dataset(LENGTHS * 2)
    first = load_model(tiny_model_dir, seed=0)
    Trainer(run_cfg(tmp_path / "a", tiny_model_dir, **keys), first, None, data, None, collate).train()
    shutil.copytree(tmp_path / "a" / "checkpoint-2", tmp_path / "b" / "checkpoint-2")
    second = load_model(tiny_model_dir, seed=1)
    cfg = run_cfg(tmp_path / "b", tiny_model_dir, resume_from_checkpoint=True, **keys)
    Trainer(cfg, second, None, data, None, collate).train()
    after = dict(second.named_parameters())
    for name, weight in first.named_parameters():
        torch.testing.assert_close(after[name], weight, rtol=0, atol=0, msg=name)  # equal
    a, b = losses(tmp_path / "a"), losses(tmp_path / "b")
    assert b == pytest.approx(a, abs=1e-6)  # the resumed log holds the first steps too
    assert a[0] != a[3]  # it trained


def one_step(model, optimizer, batch) -> None:
    out = model(**batch.model_inputs, labels=batch.targets["labels"])
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def batch_of(lengths=(5, 8)):
    return collate([random_dataset(list(lengths), seed=3)[i] for i in range(len(lengths))])


def built(tmp_path, tiny_model_dir, **keys):
    cfg = make_cfg(tmp_path, tiny_model_dir, learning_rate=1e-2, weight_decay=0.1, **keys)
    model = load_model(tiny_model_dir)
    return cfg, model, build_low_memory_optimizer(model, cfg)


def decay_split(model, exclude=()):
    """LlamaFactory's / tuneforge's groups: matrices decay, norms and biases do not."""
    skip = {id(p) for p in exclude}
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n and id(p) not in skip]
    no_decay = [p for n, p in model.named_parameters() if (p.ndim < 2 or "norm" in n) and id(p) not in skip]
    return decay, no_decay


def linear_weights(model):
    return [m.weight for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]


def assert_same_step(ours, model, reference_model, reference_optimizer, steps=2):
    batch = batch_of()
    for _ in range(steps):
        one_step(model, ours, batch)
        one_step(reference_model, reference_optimizer, batch)
    for (name, p), q in zip(model.named_parameters(), reference_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7, msg=name)


@pytest.mark.parametrize("layerwise", [False, True])
def test_galore_step_equals_the_packages_own(tmp_path, tiny_model_dir, layerwise):
    from galore_torch import GaLoreAdamW

    keys = dict(use_galore=True, galore_rank=4, galore_target=["q_proj", "down_proj"], galore_layerwise=layerwise)
    cfg, model, ours = built(tmp_path, tiny_model_dir, **keys, **(LAYERWISE if layerwise else {}))
    assert isinstance(ours, LayerwiseOptimizer) == layerwise
    ref = copy.deepcopy(model)
    targets = [m.weight for n, m in ref.named_modules() if n.endswith(("q_proj", "down_proj"))]
    decay, no_decay = decay_split(ref, targets)
    reference = GaLoreAdamW([{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": 0.1},
                             {"params": targets, "weight_decay": 0.1, "rank": 4, "update_proj_gap": 200,
                              "scale": 2.0, "proj_type": "std"}], lr=1e-2, eps=1e-8)
    assert_same_step(ours, model, ref, reference)
    # only the targets carry projectors, and their Adam moments are rank x width, not the full matrix
    optimizers = ours.optimizers if layerwise else [ours]
    states = {id(p): s for o in optimizers for p, s in o.state.items()}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name != "lm_head":
            state = states[id(module.weight)]
            projected = name.endswith(("q_proj", "down_proj"))
            assert ("projector" in state) == projected, name
            assert (state["exp_avg"].shape != module.weight.shape) == projected, name
            if projected:
                assert 4 in state["exp_avg"].shape


def test_apollo_step_equals_the_packages_own(tmp_path, tiny_model_dir):
    from apollo_torch import APOLLOAdamW

    cfg, model, ours = built(tmp_path, tiny_model_dir, use_apollo=True, apollo_rank=4, apollo_scale_front=True)
    ref = copy.deepcopy(model)
    targets = linear_weights(ref)
    decay, no_decay = decay_split(ref, targets)
    group = {"rank": 4, "proj": "random", "proj_type": "std", "update_proj_gap": 200, "scale": 32.0,
             "scale_type": "channel"}
    reference = APOLLOAdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0},
                             {"params": targets, "weight_decay": 0.1, **group}], lr=1e-2, eps=1e-8,
                            scale_front=True)
    # APOLLO seeds each matrix's random projection by its position among the optimizer's parameters
    order = [p for g in ours.param_groups for p in g["params"]]
    ref_order = [p for g in reference.param_groups for p in g["params"]]
    names = {id(p): n for n, p in model.named_parameters()}
    ref_names = {id(p): n for n, p in ref.named_parameters()}
    assert [names[id(p)] for p in order] == [ref_names[id(p)] for p in ref_order]
    assert_same_step(ours, model, ref, reference)


def test_adam_mini_step_equals_the_packages_own(tmp_path, tiny_model_dir):
    from adam_mini import Adam_mini

    cfg, model, ours = built(tmp_path, tiny_model_dir, use_adam_mini=True)
    ref = copy.deepcopy(model)
    reference = Adam_mini(named_parameters=ref.named_parameters(), lr=1e-2, weight_decay=0.1, dim=32, n_heads=4,
                          n_kv_heads=2, verbose=False)
    assert_same_step(ours, model, ref, reference)
    # one second-moment value per head / neuron: far fewer than the weights
    values = sum(s["vmean"].numel() if "vmean" in s else s["v"].numel() for s in ours.state.values())
    assert values < sum(p.numel() for p in model.parameters()) / 10


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest(tmp_path, tiny_model_dir):
    cfg, model, ours = built(tmp_path, tiny_model_dir, use_muon=True)
    hidden = muon_params(model)
    assert {id(p) for p in hidden} == {id(p) for p in linear_weights(model)}  # not the (tied) embeddings
    ref = copy.deepcopy(model)
    ref_hidden = linear_weights(ref)
    decay, no_decay = decay_split(ref, ref_hidden)
    muon = torch.optim.Muon(ref_hidden, lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                              lr=1e-2)

    class Both:
        def step(self):
            muon.step()
            adamw.step()

        def zero_grad(self, set_to_none=True):
            muon.zero_grad(set_to_none)
            adamw.zero_grad(set_to_none)

    assert_same_step(ours, model, ref, Both())
    assert [type(o).__name__ for o in ours.optimizers] == ["Muon", "AdamW"]


def test_badam_trains_one_block_and_switches_on_time(tmp_path, tiny_model_dir):
    cfg, model, ours = built(tmp_path, tiny_model_dir, use_badam=True, badam_switch_interval=2)
    batch = batch_of()
    trained = []
    for _ in range(5):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        one_step(model, ours, batch)
        changed = {n.split(".")[2] for n, p in model.named_parameters() if not torch.equal(p, before[n])
                   and n.startswith("model.layers.")}
        others = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])
                  and not n.startswith("model.layers.")]
        assert others == []  # embeddings, final norm: never (BAdam's blocks are the decoder layers)
        trained.append(changed)
    # ascending, a new block every 2 steps; badam counts its first switch from step 0, so the first block has 1
    assert trained == [{"0"}, {"1"}, {"1"}, {"0"}, {"0"}]


def test_badam_step_equals_the_packages_own(tmp_path, tiny_model_dir):
    from badam import BlockOptimizer

    cfg, model, ours = built(tmp_path, tiny_model_dir, use_badam=True, badam_start_block=1)
    ref = copy.deepcopy(model)
    decay, no_decay = decay_split(ref)
    base = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=1e-2)
    reference = BlockOptimizer(base, list(ref.named_parameters()), switch_block_every=50, start_block=1,
                               switch_mode="ascending", verbose=0)
    assert_same_step(ours, model, ref, reference)


def test_pure_bf16_trains_the_bf16_weights_themselves(tmp_path, tiny_model_dir):
    from tuneforge.model.load import load_model as load_for_training

    mixed = load_for_training(make_cfg(tmp_path, tiny_model_dir, bf16=True), torch.device("cpu"))
    assert {p.dtype for p in mixed.parameters()} == {torch.float32}  # bf16 mixed precision: fp32 weights
    cfg = make_cfg(tmp_path, tiny_model_dir, pure_bf16=True, max_steps=2, learning_rate=1e-2)
    model = load_for_training(cfg, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # no fp32 copy anywhere
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = Trainer(cfg, model, None, random_dataset(LENGTHS), None, collate)
    trainer.train()
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    moments = [s["exp_avg"] for s in trainer.optimizer.state.values()]
    assert moments and {m.dtype for m in moments} == {torch.bfloat16}


def test_badam_keeps_the_weights_in_bf16_and_an_fp32_copy_of_the_active_block(tmp_path, tiny_model_dir):
    from tuneforge.model.load import load_model as load_for_training

    cfg = make_cfg(tmp_path, tiny_model_dir, bf16=True, use_badam=True, max_steps=1)
    model = load_for_training(cfg, torch.device("cpu"))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    trainer = Trainer(cfg, model, None, random_dataset(LENGTHS), None, collate)
    trainer.train()
    copies = trainer.optimizer.state_dict()["fp32_block"]
    block = [p for n, p in model.named_parameters() if n.startswith("model.layers.0.")]
    assert [c.dtype for c in copies] == [torch.float32] * len(block)
    for copy_, weight in zip(copies, block, strict=True):
        torch.testing.assert_close(copy_.to(torch.bfloat16), weight, rtol=0, atol=0)


def test_galore_projectors_keep_only_their_rank_r_matrix(tmp_path, tiny_model_dir):
    """galore-torch slices its projection out of the whole SVD factor; the optimizer keeps the slice alone."""
    cfg, model, ours = built(tmp_path, tiny_model_dir, use_galore=True, galore_rank=4)
    one_step(model, ours, batch_of())
    projectors = [s["projector"].ortho_matrix for s in ours.state.values() if "projector" in s]
    assert projectors and all(m.untyped_storage().nbytes() == m.numel() * 4 for m in projectors)
    assert {4} <= {d for m in projectors for d in m.shape}
