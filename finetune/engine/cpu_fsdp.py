"""Real FSDP on CPU-only machines: the adapter between accelerate and gloo.

accelerate never selects FSDP without an accelerator device (its state machine enables FSDP only for them), and a
plain `Accelerator()` inside processes started by `accelerate launch` on one CPU process reports no process group:
it would train unsharded. The functions below close both gaps so that the *same* config file trains with real
sharding over gloo, and do by hand what FSDP1 cannot do for CPU tensors (`sync_module_states`). Written against
accelerate 1.15; `check_cpu_fsdp` fails loudly if a later accelerate stops honouring it.
"""

from __future__ import annotations

import os

import accelerate
import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import (
    DistributedType,
    FullyShardedDataParallelPlugin,
)
from torch.distributed.fsdp import CPUOffloadPolicy

from finetune.engine.processes import free_port


def single_process_group_env() -> None:
    """Let one CPU process launched with an FSDP config form a 1-rank gloo group.

    accelerate launches a single process without torchrun, so there is no process group and it
    would train unsharded, unable to read (or write) the FSDP checkpoints of a multi-process run.
    On GPUs one process with an FSDP config is FSDP over one rank; this makes CPU behave the same.
    """
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))


def enable_fsdp_on_cpu(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin) -> None:
    """Switch a MULTI_CPU (gloo) accelerator to FSDP, as accelerate itself does for GPUs.

    Both states must change: AcceleratorState copies PartialState's fields, and setting only one
    of them is silently undone. FSDP1 also needs the device to be plain `cpu`, not `cpu:0`.
    """
    for state in (accelerator.state, PartialState()):
        state.distributed_type = DistributedType.FSDP
        state.device = torch.device("cpu")
    accelerator.state.fsdp_plugin = plugin
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    if isinstance(plugin.cpu_offload, CPUOffloadPolicy):
        # FSDP2's offload pins host memory, which needs a GPU; on CPU the shards already live in host RAM.
        plugin.cpu_offload = CPUOffloadPolicy(pin_memory=False)
    check_cpu_fsdp(accelerator, plugin)


def check_cpu_fsdp(accelerator: Accelerator, plugin: FullyShardedDataParallelPlugin) -> None:
    """Fail loudly if this accelerate version no longer honours the adapter."""
    honoured = (
        accelerator.distributed_type == DistributedType.FSDP
        and PartialState().distributed_type == DistributedType.FSDP
        and accelerator.state.fsdp_plugin is plugin
        and accelerator.is_fsdp2 == (plugin.fsdp_version == 2)
    )
    if not honoured:
        raise RuntimeError(
            f"the CPU FSDP adapter (tested with accelerate 1.15) does not take effect with accelerate "
            f"{accelerate.__version__}: distributed_type={accelerator.distributed_type}. Pin accelerate~=1.15.0 "
            "or update finetune/engine/cpu_fsdp.py"
        )


def broadcast_module_states(accelerator: Accelerator, model: torch.nn.Module) -> None:
    """Copy rank 0's parameters and buffers to every rank: FSDP1's `sync_module_states`, done by hand on CPU."""
    requested = os.environ.get("FSDP_SYNC_MODULE_STATES", "false").lower() == "true"
    fsdp1_on_cpu = (
        accelerator.distributed_type == DistributedType.FSDP
        and accelerator.state.fsdp_plugin.fsdp_version == 1
        and accelerator.device.type == "cpu"
    )
    if not (requested and fsdp1_on_cpu):
        return
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            torch.distributed.broadcast(tensor.data, src=0)
