"""Training: the one loop (Trainer), driven by a stage's Objective.

The names are imported on first use: `tuneforge train` imports tuneforge.train.launch to relaunch itself under
torchrun, and that parent process must not spend seconds importing torch, peft and the trainer first."""

__all__ = ["Objective", "ObjectiveOutput", "Trainer", "lm_objective"]


def __getattr__(name: str):
    if name == "Trainer":
        from tuneforge.train.trainer import Trainer

        return Trainer
    if name in ("Objective", "ObjectiveOutput", "lm_objective"):
        from tuneforge.train import objectives

        return getattr(objectives, name)
    raise AttributeError(f"module 'tuneforge.train' has no attribute {name!r}")
