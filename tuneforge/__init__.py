"""tuneforge: one config, every fine-tuning stage, any scale."""

__version__ = "0.1.0"
