"""Training: the one loop (Trainer), driven by a stage's Objective."""

from tuneforge.train.objectives import Objective, ObjectiveOutput, lm_objective
from tuneforge.train.trainer import Trainer

__all__ = ["Objective", "ObjectiveOutput", "Trainer", "lm_objective"]
