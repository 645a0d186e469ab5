"""What every reward reads: the completions of one batch, with their prompts and their rows' columns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RewardInputs:
    """n completions. prompts[i]: the rendered prompt of completion i (chat template and generation prompt
    applied); completions[i]: its decoded text; columns[i]: its dataset row's other columns; completion_ids[i]:
    its token ids; texts[i]: prompt and completion as a reward model reads them."""

    prompts: list[str]
    completions: list[str]
    columns: list[dict[str, Any]]
    completion_ids: list[list[int]]
    texts: list[str]

    def column_names(self) -> list[str]:
        """Every column any row has, in the order first seen."""
        return list(dict.fromkeys(name for row in self.columns for name in row))

    def column(self, name: str) -> list[Any]:
        """That column's value for each completion (None where a row lacks it)."""
        return [row.get(name) for row in self.columns]
