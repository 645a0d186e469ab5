"""The stage table and the preference-loss table: the one place that knows stages (a leaf module, no torch).

Every layer asks these rows instead of comparing stage names: config (the `stage` / `pref_loss` choices and
their rules), data (the encoder, the dataset kinds, packing), model (a value head), train (the objective, a
reference), eval (what evaluation reports) and the cli (whether the stage writes text).

A row is data. Its `encoder` is a name in the data package's encoder registry (tuneforge.data.encoders) and
its `objective` a name in train's objective registry (tuneforge.train.objectives); both resolve when a run
needs them, so reading the table (as config validation does) imports neither data nor torch.

Adding a stage: `register_stage(Stage(...))` (+ `register_encoder` if no existing encoder fits, +
`register_objective`). Adding a preference loss: a pure function of log-probs and `register_pref_loss(...)`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

# when a stage compares the policy with a reference model
# by_loss: as the pref_loss row says; by_kl: when the KL penalty's weight (beta) is above 0; by_asft: with
# use_asft_loss (its KL to the starting model)
REFERENCE_NEVER, REFERENCE_ALWAYS, REFERENCE_BY_LOSS, REFERENCE_BY_KL = "never", "always", "by_loss", "by_kl"
REFERENCE_BY_ASFT = "by_asft"
REFERENCE_RULES = (REFERENCE_NEVER, REFERENCE_ALWAYS, REFERENCE_BY_LOSS, REFERENCE_BY_KL, REFERENCE_BY_ASFT)


@dataclass(frozen=True)
class Stage:
    """One training stage.

    name: the value of the `stage` key. encoder: the data encoder (tuneforge.data.encoders) that turns raw
    rows into token rows. dataset_kinds: the DatasetAttr kinds (plain / pairwise / feedback) it trains on.
    rows: what one token row holds, the batch layout's row kind (tuneforge.batch.ROW_KINDS). objective: the
    objective's name in the objective registry (tuneforge.train.objectives). packs_by_default / can_pack:
    whether rows are packed when `packing` is not set, and whether packing is allowed at all (a stage that
    compares whole sequences cannot pack). reference: never, always, by_loss (the pref_loss row decides), by_kl or
    by_asft.
    value_head: the model gets a scalar value head (and saves it). critic: that head is a critic of the policy
    (ppo: trained on returns, saved as critic_head.safetensors, so the output stays a policy). samples: the
    objective samples completions during training (an RL stage: its rows are prompts, rewards score what it
    samples). pref_loss: the pref_loss key applies. own_keys: config keys that only this stage (and any other
    row listing them) reads; another stage refuses them away from their defaults. rl_defaults: defaults of the rl keys the schema leaves unset
    (null): a value, or the name of the key whose value it takes.
    perplexity: the objective's loss is a mean token negative log-likelihood, so evaluation reports
    exp(loss) and `tuneforge eval` can measure it. writes_text: the trained model answers in text (so `--ask`
    and generation make sense). planned: listed, not built yet (validation refuses it).
    """

    name: str
    encoder: str | None
    dataset_kinds: tuple[str, ...]
    rows: str
    objective: str | None
    summary: str = ""
    packs_by_default: bool = False
    can_pack: bool = True
    reference: str = REFERENCE_NEVER
    value_head: bool = False
    critic: bool = False
    pref_loss: bool = False
    perplexity: bool = False
    writes_text: bool = True
    samples: bool = False
    own_keys: tuple[str, ...] = ()
    rl_defaults: Mapping[str, Any] = field(default_factory=dict)
    planned: bool = False

    def __post_init__(self) -> None:
        if self.reference not in REFERENCE_RULES:
            raise ValueError(f"Stage.reference must be one of {REFERENCE_RULES}, not {self.reference!r}")
        if self.packs_by_default and not self.can_pack:
            raise ValueError(f"stage {self.name}: packs_by_default needs can_pack")
        if self.critic and not self.value_head:
            raise ValueError(f"stage {self.name}: a critic is a value head (value_head=True)")
        if not self.planned and (self.encoder is None or self.objective is None):
            raise ValueError(f"stage {self.name}: a built stage needs an encoder and an objective")


@dataclass(frozen=True)
class PrefLoss:
    """One preference loss of the stages whose row has pref_loss (dpo).

    function: the pure loss, or "module:attr" resolved on first use (so validation needs no torch). It is
    called as function(chosen, rejected, ref_chosen, ref_rejected, beta, **options) when needs_reference,
    else function(chosen, rejected, beta, **options), on per-sequence log-probs summed over the completion,
    or their per-token averages when length_normalized (the reference's too), and returns
    losses.PairLosses. options: config key -> the function's keyword (e.g. dpo_label_smoothing ->
    label_smoothing); a key not listed here does not apply to this loss."""

    name: str
    function: str | Callable[..., Any]
    needs_reference: bool = True
    length_normalized: bool = False
    options: dict[str, str] = field(default_factory=dict)
    summary: str = ""

    def resolve(self) -> Callable[..., Any]:
        if callable(self.function):
            return self.function
        module, _, attr = self.function.partition(":")
        return getattr(importlib.import_module(module), attr)


STAGES: dict[str, Stage] = {}
PREF_LOSSES: dict[str, PrefLoss] = {}


def register_stage(stage: Stage, *, replace: bool = False) -> Stage:
    """Add a row to the stage table (replace=True to redefine one); the `stage` key accepts it at once."""
    if stage.name in STAGES and not replace:
        raise ValueError(f"stage {stage.name!r} is already registered")
    STAGES[stage.name] = stage
    return stage


def register_pref_loss(loss: PrefLoss, *, replace: bool = False) -> PrefLoss:
    """Add a row to the preference-loss table; the `pref_loss` key accepts it at once."""
    if loss.name in PREF_LOSSES and not replace:
        raise ValueError(f"pref_loss {loss.name!r} is already registered")
    PREF_LOSSES[loss.name] = loss
    return loss


def unregister(name: str, table: dict) -> None:
    """Drop a row (tests that registered a toy one clean up with this)."""
    table.pop(name, None)


def stage_of(name: str) -> Stage:
    """The row of a stage name (KeyError for an unknown one: config validation has refused it before)."""
    return STAGES[name]


def built_stages() -> list[str]:
    return [s.name for s in STAGES.values() if not s.planned]


def stages_where(test: Callable[[Stage], bool]) -> list[str]:
    """Names of the built stages whose row passes test, in table order (for messages)."""
    return [s.name for s in STAGES.values() if not s.planned and test(s)]


def words(names: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def uses_reference(stage: str, pref_loss: str, beta: float = 0.0, asft: bool = False) -> bool:
    """Whether the stage (with this pref_loss, this KL weight beta, or use_asft_loss) compares the policy with a
    reference."""
    rule = STAGES[stage].reference
    if rule == REFERENCE_BY_LOSS:
        return PREF_LOSSES[pref_loss].needs_reference
    if rule == REFERENCE_BY_KL:
        return beta > 0
    if rule == REFERENCE_BY_ASFT:
        return asft
    return rule == REFERENCE_ALWAYS


class TableChoices:
    """The live names of a table, as a schema field's `choices`: a row registered later is a valid value."""

    def __init__(self, table: dict[str, Any]) -> None:
        self.table = table

    def __contains__(self, value: object) -> bool:
        return value in self.table

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.table))

    def __len__(self) -> int:
        return len(self.table)

    def __repr__(self) -> str:
        return repr(tuple(self.table))


STAGE_CHOICES = TableChoices(STAGES)
PREF_LOSS_CHOICES = TableChoices(PREF_LOSSES)


class Problem(str):
    """A broken rule in words, with the config keys at fault (`keys`), so the caller can name the fields."""

    keys: tuple[str, ...]

    def __new__(cls, text: str, *keys: str) -> Problem:
        problem = super().__new__(cls, text)
        problem.keys = keys
        return problem


def preference_problem(
    *,
    pref_loss: str | None = None,
    pref_beta: float | None = None,
    pref_ftx: float | None = None,
    simpo_gamma: float | None = None,
    dpo_label_smoothing: float | None = None,
    kto_chosen_weight: float | None = None,
    kto_rejected_weight: float | None = None,
) -> Problem | None:
    """The first rule of the preference keys that these values break, in words (None when all hold).

    The one place of these rules: config validation asks it before anything loads, and the objectives'
    constructors ask it again only to catch a programmer's direct call with bad values."""
    if pref_loss is not None and pref_loss not in PREF_LOSSES:
        return Problem(f"pref_loss '{pref_loss}' is not one of {', '.join(PREF_LOSSES)}", "pref_loss")
    if pref_beta is not None and pref_beta <= 0:
        return Problem(f"pref_beta must be > 0 (got {pref_beta})", "pref_beta")
    if pref_ftx is not None and pref_ftx < 0:
        return Problem(f"pref_ftx must be >= 0 (got {pref_ftx})", "pref_ftx")
    if simpo_gamma is not None and simpo_gamma < 0:
        return Problem(f"simpo_gamma must be >= 0 (got {simpo_gamma})", "simpo_gamma")
    if dpo_label_smoothing is not None:
        if not 0.0 <= dpo_label_smoothing < 0.5:
            return Problem(f"dpo_label_smoothing must be in [0, 0.5) (got {dpo_label_smoothing}): the share of "
                           f"labels assumed flipped; 0.5 would make the loss ignore the preference", "dpo_label_smoothing")
        takers = [n for n, loss in PREF_LOSSES.items() if "dpo_label_smoothing" in loss.options]
        if dpo_label_smoothing > 0 and pref_loss is not None and pref_loss not in takers:
            return Problem(f"dpo_label_smoothing applies to pref_loss {words(takers)} only (pref_loss is {pref_loss})",
                           "dpo_label_smoothing", "pref_loss")
    for key, value in (("kto_chosen_weight", kto_chosen_weight), ("kto_rejected_weight", kto_rejected_weight)):
        if value is not None and value <= 0:
            return Problem(f"kto_chosen_weight and kto_rejected_weight must be > 0 (got {key} {value})", key)
    return None


LOSSES = "tuneforge.train.objectives.losses"

for _stage in (
    Stage("pt", "pretrain", ("plain",), "plain", "lm", "next-token cross-entropy on documents",
          packs_by_default=True, perplexity=True, own_keys=("label_smoothing_factor", "compute_accuracy")),
    Stage("sft", "supervised", ("plain",), "plain", "lm", "cross-entropy on the assistant turns", perplexity=True,
          reference=REFERENCE_BY_ASFT,
          own_keys=("label_smoothing_factor", "compute_accuracy", "use_dft_loss", "use_eaft_loss", "eaft_alpha",
                    "use_asft_loss", "asft_alpha")),
    Stage("rm", "pairwise", ("pairwise",), "pairwise", "reward", "a reward model (a scorer): value head, -log sigma(r_chosen - r_rejected)",
          can_pack=False, value_head=True, writes_text=False),
    Stage("ppo", "prompt", ("plain",), "prompt", "ppo", "sample a completion per prompt, score it with the rewards, "
          "KL-shaped rewards, GAE on the critic's values; clipped policy and value losses", can_pack=False,
          reference=REFERENCE_ALWAYS, value_head=True, critic=True, samples=True,
          own_keys=("ppo_epochs", "ppo_buffer_size", "ppo_score_norm", "ppo_whiten_rewards", "ppo_target",
                    "ppo_kl_coef", "ppo_adaptive_kl", "ppo_kl_horizon", "ppo_gamma", "ppo_lam", "ppo_value_clip",
                    "ppo_vf_coef"),
          rl_defaults={"num_generations": 1, "max_completion_length": "max_new_tokens"}),  # LlamaFactory's ppo
    Stage("dpo", "pairwise", ("pairwise",), "pairwise", "preference", "a preference loss (pref_loss)",
          can_pack=False, reference=REFERENCE_BY_LOSS, pref_loss=True),
    Stage("kto", "feedback", ("feedback",), "feedback", "kto", "KTO on desirable / undesirable answers",
          can_pack=False, reference=REFERENCE_ALWAYS),
    Stage("grpo", "prompt", ("plain",), "prompt", "grpo", "sample num_generations answers per prompt, score them "
          "with the rewards, clipped policy gradient on group-normalized advantages", can_pack=False,
          reference=REFERENCE_BY_KL, samples=True,
          own_keys=("num_iterations", "beta", "loss_type", "scale_rewards", "mask_truncated_completions"),
          rl_defaults={"num_generations": 8, "max_completion_length": 256}),
):
    register_stage(_stage)

for _loss in (
    PrefLoss("sigmoid", f"{LOSSES}:dpo_sigmoid_loss", options={"dpo_label_smoothing": "label_smoothing"},
             summary="DPO (cDPO with dpo_label_smoothing)"),
    PrefLoss("hinge", f"{LOSSES}:dpo_hinge_loss", summary="SLiC hinge"),
    PrefLoss("ipo", f"{LOSSES}:ipo_loss", length_normalized=True, summary="IPO"),
    PrefLoss("orpo", f"{LOSSES}:orpo_loss", needs_reference=False, length_normalized=True, summary="ORPO"),
    PrefLoss("simpo", f"{LOSSES}:simpo_loss", needs_reference=False, length_normalized=True,
             options={"simpo_gamma": "gamma"}, summary="SimPO"),
):
    register_pref_loss(_loss)
