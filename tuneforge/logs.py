"""How a tuneforge process logs: one format, INFO on the main process, and the libraries' notices that a user can do
nothing about kept out of the log (the CLI and Ray's workers set it up the same way)."""

from __future__ import annotations

import logging
import os

FORMAT, DATE_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"
NOISY = ("httpx", "urllib3", "filelock", "fsspec", "datasets", "matplotlib", "PIL")


def setup(level: int, *, force: bool = False) -> None:
    """force: replace the root logger's handlers (a Ray worker's process has some already)."""
    logging.basicConfig(level=level, format=FORMAT, datefmt=DATE_FORMAT, force=force)
    for name in NOISY:
        logging.getLogger(name).setLevel(logging.WARNING)
    # bitsandbytes warns at import about an optional kernels package even when nothing is quantized
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    quiet_torchao()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import datasets
    import transformers

    transformers.logging.set_verbosity_warning()
    transformers.logging.disable_progress_bar()  # our own bar is the one that matters
    datasets.disable_progress_bars()  # the data log line reports the counts


def _no_cuda() -> bool:
    import torch

    return not torch.cuda.is_available()


class _ImportNotices(logging.Filter):
    """Drops a record whose message contains one of `texts` (with cuda_only, only where CUDA is not available);
    passes every other one."""

    def __init__(self, *texts: str, cuda_only: bool = False) -> None:
        super().__init__()
        self.texts, self.cuda_only = texts, cuda_only

    def filter(self, record: logging.LogRecord) -> bool:
        return not (any(t in record.getMessage() for t in self.texts) and (not self.cuda_only or _no_cuda()))


def quiet_torchao() -> None:
    """transformers imports torchao where it is installed (the optim / fp8 extras), and torchao's import warns
    that its CUDA kernels and Triton cannot load, also on a machine without CUDA, where nothing uses them, and
    calls a torch registration that torch has deprecated (torchao's to change, not the user's)."""
    cuda_only = _ImportNotices("Failed to load", "Detected no triton", cuda_only=True)
    deprecated_enum = _ImportNotices("is an Enum subclass and is now natively supported")
    for name, notices in (("torchao", cuda_only), ("torchao.kernel.intmm", cuda_only),
                          ("torch.utils._pytree", deprecated_enum)):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ImportNotices) for f in logger.filters):  # set up once per process
            logger.addFilter(notices)
