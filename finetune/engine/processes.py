"""The launched processes at run time: how many were launched, a free port, stopping together on a preemption
signal or a user error on one of them, dealing work out evenly, and tearing the group down in step.
"""

from __future__ import annotations

import gc
import os
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
from accelerate import Accelerator
from accelerate.utils import (
    broadcast_object_list,
)

from finetune.errors import FinetuneError

T = TypeVar("T")


def launched_world_size() -> int:
    """Number of processes the launcher started (1 when run without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def dropped_processes() -> tuple[int, str] | None:
    """(processes asked for, the config) when `accelerate launch --num_processes N` (N > 1) started this process
    alone: its one-process launcher (a config with distributed_type: NO, such as single_gpu.yaml) drops N without
    a word and passes nothing of it on, so N is read from the launcher's command line (Linux's /proc). None when
    a launcher started the processes (torchrun sets WORLD_SIZE), when there was no `accelerate launch`, or where
    /proc cannot tell."""
    if "WORLD_SIZE" in os.environ:
        return None
    try:
        argv = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().decode().split("\0")
    except (OSError, UnicodeDecodeError):
        return None
    launcher = any(a.endswith("accelerate.commands.launch") for a in argv) or (
        any(Path(a).name == "accelerate" for a in argv) and "launch" in argv
    )
    options = dict(_options(argv))
    asked = options.get("num_processes")
    if not launcher or asked is None or not asked.isdigit() or int(asked) <= 1:
        return None
    return int(asked), Path(options.get("config_file", "the accelerate config")).name


def _options(argv: list[str]) -> list[tuple[str, str]]:
    """`--name value` and `--name=value` pairs of a command line, names with '_' for '-'."""
    pairs = []
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            name, _, value = arg[2:].partition("=")
            if not value and i + 1 < len(argv):
                value = argv[i + 1]
            pairs.append((name.replace("-", "_"), value))
    return pairs


def free_port() -> int:
    """A TCP port on the loopback address that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PreemptionSignals:
    """Turns SIGTERM and SIGINT into a request to checkpoint and stop at the next step boundary.

    Schedulers (SLURM, Kubernetes) send SIGTERM before killing a job, often more than once (torchrun
    forwards its own SIGTERM to the workers too), so repeats are absorbed while the checkpoint is
    written. A second Ctrl-C (SIGINT) falls through to its previous handler and interrupts at once.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.received = False
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> PreemptionSignals:
        if self.enabled:
            for signum in self.SIGNALS:
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.received and signum == signal.SIGINT:
            signal.signal(signum, self.previous[signum])
            signal.raise_signal(signum)
        self.received = True

    @property
    def flag(self) -> float:
        """1.0 if this process received a signal: summed over processes with the step's loss (`train_step`),
        so that all of them stop at the same step without a collective of its own."""
        return float(self.enabled and self.received)


def main_process_first(accelerator: Accelerator, build: Callable[[], T]) -> T:
    """`build()` on the main process, then on the others (which find its caches), like accelerate's
    `main_process_first`, except that a user error on the main process is raised on every process:
    none is left waiting at a barrier for a process that has exited, to fail with a gloo traceback."""
    error: list[str | None] = [None]
    if accelerator.is_main_process:
        try:
            result = build()
        except FinetuneError as exc:
            error = [str(exc)]
    broadcast_object_list(error)  # also the barrier at which the others wait for the main process
    if error[0] is not None:
        raise FinetuneError(error[0])
    if not accelerator.is_main_process:
        result = build()
    return result


def equal_share(total: int, world: int, rank: int) -> tuple[list[int], int]:
    """This process's items of `total` (every `world`-th from `rank`), lengthened by repeating its last so that
    every process runs as many forwards (a collective each, under FSDP); and how many are its own."""
    mine = list(range(rank, total, world))
    own = len(mine)
    return mine + [mine[-1] if mine else 0] * (-(-total // world) - own), own


def raised_together(accelerator: Accelerator, attempt: Callable[..., T], *args: Any) -> T:
    """`attempt(*args)` on every process, failing on all of them when it fails on one (a collective: every process
    calls it). A user error on one process would otherwise leave the others waiting in their next collective
    until it exits, and their lost-peer traceback, not its message, would be what the user reads: each process
    raises the message of the first process that failed, naming it."""
    error: FinetuneError | None = None
    try:
        result = attempt(*args)
    except FinetuneError as exc:
        error = exc
    if accelerator.num_processes > 1:
        failed = torch.tensor([float(error is not None)], device=accelerator.device)
        torch.distributed.all_reduce(failed, op=torch.distributed.ReduceOp.MAX)
        if failed.item():
            messages: list[str | None] = [None] * accelerator.num_processes
            torch.distributed.all_gather_object(messages, None if error is None else str(error))
            rank, message = next((r, m) for r, m in enumerate(messages) if m is not None)
            raise FinetuneError(f"{message} (on process {rank})") from error
    if error is not None:
        raise error
    return result


def lost_peer(exc: BaseException) -> bool:
    """Whether `exc` is a collective failing because another process exited (after its own error)."""
    closed = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
    return isinstance(exc, torch.distributed.DistError) or (
        isinstance(exc, RuntimeError) and any(text in str(exc) for text in closed)
    )


def shutdown() -> None:
    """Tear the process group down with every rank in step, after the last collective.

    Call it once training has returned on every rank, so that the wrapped model and everything
    else holding work on the group is already freed: destroying the group first and freeing DDP or
    FSDP objects afterwards can leave a rank blocked in teardown while its peer has exited. Never
    call it on an error path, where peers may never reach the barrier.
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        gc.collect()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
