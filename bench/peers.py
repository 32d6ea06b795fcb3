"""What the peer scripts (trainer_ddp.py, trl_sft.py, trl_dpo.py) share: writing their step timings, leaving DDP
cleanly."""

from __future__ import annotations

import gc
import json

import torch.distributed as dist


def write_steps(path: str, step_seconds: list[float], **counts: list[int]) -> None:
    """The wall time and the global counts (target tokens, pairs) of every step, written once (by rank 0)."""
    if dist.get_rank() == 0:
        with open(path, "w") as file:
            json.dump({"step_seconds": step_seconds, **counts}, file)


def close_ddp() -> None:
    """End the process group with every rank in step, after the caller dropped its trainer and model: a rank
    that exits while DDP's gloo threads still run aborts ("terminate called without an active exception")."""
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
