"""What a normal run prints besides finetune's own lines: one progress bar per tokenized split and one for
training, and the libraries' warnings when something is wrong; not their per-rank progress bars, their info
lines per checkpoint, or warnings about how finetune itself calls them.

`FINETUNE_VERBOSE=1` (or `finetune train --verbose`) leaves every library as it is, to debug with."""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator

VERBOSE = "FINETUNE_VERBOSE"


def verbose() -> bool:
    return os.environ.get(VERBOSE, "0") not in ("", "0")


def quiet_libraries() -> None:
    """Silence, for this process, what the libraries print on every normal run (unless verbose)."""
    if verbose():
        return
    # accelerate's save_state logs a dozen "[RANK 0] Saving ..." lines per checkpoint at info level.
    logging.getLogger("accelerate").setLevel(logging.WARNING)
    # bitsandbytes warns, on import, that an optional CPU kernel package (`kernels`) is not installed.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    # PEFT asks transformers for `is_gradient_checkpointing`, a name transformers 5 deprecates.
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
    # Under sequence parallelism accelerate shards the model over the mesh's flattened data x sequence dimension,
    # slicing it from the root mesh as its own context parallelism does; torch warns that this will change.
    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh", category=UserWarning)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # "Loading weights", from every rank
    # On a CPU, transformers says it will dequantize an MXFP4 base (gpt-oss) "to bf16": finetune asked it to, into
    # the recipe's dtype (model.dequantizing), on every device.
    logging.getLogger("transformers.quantizers.quantizer_mxfp4").addFilter(_Dropping("MXFP4 inference on CPU"))


class _Dropping(logging.Filter):
    """Drops the records whose message starts with `start`."""

    def __init__(self, start: str):
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.start)


@contextlib.contextmanager
def no_datasets_bars() -> Iterator[None]:
    """datasets' own bars off while inside (reading files, filtering, packing: steps of a split whose one bar is
    its tokenization's), unless verbose."""
    import datasets

    if verbose() or not datasets.is_progress_bar_enabled():
        yield
        return
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        datasets.enable_progress_bars()
