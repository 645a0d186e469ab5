"""The batch contract between the collator, the trainer and the objectives (a leaf module every layer may import).

A collated micro-batch is a `Batch`:
- `model_inputs`: exactly what the model's forward takes (input_ids, attention_mask or position_ids, the
  padding-free boundaries cu_seq_lens_q / ..., shared_prefix, and later pixel_values, image_grid_thw, ...).
  position_ids is (rows, seq), or for a 3-D rope model's flat / packed media rows (4, rows, seq): the text
  positions, then the model's own three rope rows (`text_positions` reads the first either way).
  Objectives pass it through untouched: nothing filters it by a list of names.
- `targets`: what the objective reads beside the model (labels, sequence_ids / sequence_ends,
  target_positions / target_ids / target_sequences, kto_tags, ref_logps, and later rewards or advantages).
- `layout`: how the rows are laid out, decided once by the workflow, never guessed from column names.
- `num_rows` / `num_tokens`: dataset rows and real (non-padding) tokens, counted by the collator from the rows
  as they were before padding or prompt sharing, for the trainer's throughput figures (an objective that samples
  adds the completions' tokens in its prepare).
- `sample_seeds`: for objectives that sample (prepare), one seed per dataset row, a function of the run's seed,
  the epoch and the row's index, set by the trainer: what a row samples does not depend on the micro-batch or
  the process it lands in, and a resumed run samples what the uninterrupted one did.

Prompt rows (the RL stages) collate to no model inputs at all: `targets` holds `prompt_ids` (a list of token-id
lists) and `columns` (each row's other dataset columns, for the rewards); the objective's prepare samples the
completions and builds the model inputs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any

ROW_KINDS = ("plain", "pairwise", "feedback", "prompt")
PAIRED_ROWS = ("pairwise", "feedback")  # row kinds that hold two sequences on one prompt
# row kinds whose sequences may share one copy of their prompt: a pair's two, a prompt's sampled answers
SHARED_PROMPT_ROWS = (*PAIRED_ROWS, "prompt")
# the dataset column holding a row's processed media (serialized tensors); a preference row's sequences prefix it
# (chosen_, rejected_, kl_)
MEDIA_COLUMN = "mm_inputs"


@dataclass(frozen=True)
class Layout:
    """rows: what one dataset row holds: plain (one sequence), pairwise (chosen + rejected), feedback (a judged
    answer + its KL pair) or prompt (a prompt to sample completions from: the RL stages). flat: padding-free, the micro-batch is one row with its sequences back to back.
    packed: a row holds several samples (position ids restart at 0 inside it). shared_prefix: the sequences that
    begin with the same prompt share one copy of it (flat only): a pair's two, or the answers an RL objective
    sampled for one prompt (its collated batch is then a plain one with this flag)."""

    rows: str = "plain"
    flat: bool = False
    packed: bool = False
    shared_prefix: bool = False

    def __post_init__(self) -> None:
        if self.rows not in ROW_KINDS:
            raise ValueError(f"Layout.rows must be one of {ROW_KINDS}, not {self.rows!r}")
        if self.shared_prefix and not self.flat:
            raise ValueError("a shared-prefix layout is padding-free (flat)")

    @property
    def samples_share_rows(self) -> bool:
        """True when one row of input_ids may hold several samples, so a position whose next token starts
        another sample (position id 0) must never be a target."""
        return self.flat or self.packed


@dataclass
class Batch:
    model_inputs: dict[str, Any]
    targets: dict[str, Any] = field(default_factory=dict)
    layout: Layout = field(default_factory=Layout)
    num_rows: int = 0
    num_tokens: int = 0
    sample_seeds: tuple[int, ...] | None = None

    def to(self, device: Any) -> Batch:
        """The same batch with its tensors on device (non-tensor values as they are)."""

        def move(values: dict[str, Any]) -> dict[str, Any]:
            return {k: v.to(device, non_blocking=True) if hasattr(v, "to") and hasattr(v, "device") else v
                    for k, v in values.items()}

        return replace(self, model_inputs=move(self.model_inputs), targets=move(self.targets))


def sample_seed(*parts: Any) -> int:
    """A 63-bit seed from its parts (the run's seed, the epoch, a row's index, a completion's number, ...): the
    same parts give the same seed, different parts unrelated ones."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


def text_positions(model_inputs: dict[str, Any]) -> Any:
    """The (rows, seq) text positions of a batch: position_ids, or their first row in the 4-row form of a 3-D rope
    model's packed media rows."""
    positions = model_inputs["position_ids"]
    return positions[0] if positions.dim() == 3 else positions


def position_samples(model_inputs: dict[str, Any]) -> Any:
    """(rows, seq): the sample each position belongs to, numbered 0, 1, ... over the whole batch, when samples share
    rows (each starts at text position 0)."""
    starts = text_positions(model_inputs) == 0
    return (starts.flatten().cumsum(0) - 1).clamp(min=0).view_as(starts)
