"""Build the Accelerator from the launch's accelerate config, and describe the engine it runs.

`accelerate launch` turns an accelerate config into environment variables; `Accelerator()` reads them. On
machines with GPUs that is all we do, besides our mixed-precision policy and the mesh of hybrid sharding and
sequence groups. On CPU-only machines the adapter in `finetune.engine.cpu_fsdp` lets the same config train with
real sharding over gloo. What the running engine is (its strategy's name, the launch as the planner describes
one, each rank's shards) is read back from accelerate's state here too.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, ParallelismConfig
from accelerate.utils import (
    DataLoaderConfiguration,
    DistributedType,
    FullyShardedDataParallelPlugin,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecision, MixedPrecisionPolicy

from finetune.engine import sequence
from finetune.engine.cpu_fsdp import enable_fsdp_on_cpu, single_process_group_env
from finetune.engine.launch import Launch, check_hybrid_shard_group, hybrid_replicas
from finetune.engine.memory import dtype_name
from finetune.engine.processes import dropped_processes, launched_world_size
from finetune.engine.sequence import launched_size as launched_sequence_size
from finetune.engine.wrap import fsdp_units, local_tensor
from finetune.errors import FinetuneError


def has_accelerator() -> bool:
    """True when torch sees a GPU-like device that accelerate drives natively."""
    return torch.accelerator.is_available() and torch.accelerator.current_accelerator().type != "mps"


def fsdp_requested() -> bool:
    """True when the accelerate config passed to `accelerate launch` asks for FSDP."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def rank_zero_loading() -> bool:
    """True when the accelerate config asks that rank 0 alone read the weights (cpu_ram_efficient_loading)."""
    return fsdp_requested() and os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() == "true"


def build_accelerator(
    *, trackers: list[str], project_dir: str, recipe_activation_checkpointing: bool, param_dtype: torch.dtype
) -> Accelerator:
    """Create the Accelerator for this process and check that every launched process joined it."""
    _check_launch_environment(recipe_activation_checkpointing)
    on_cpu = not has_accelerator()
    plugin = _fsdp_plugin(on_cpu, param_dtype) if fsdp_requested() else None
    sizes = mesh_sizes()
    if sizes is not None and sizes.sequence > 1 and (plugin is None or plugin.fsdp_version != 2):
        raise FinetuneError(
            "sequence parallelism (parallelism_config_sp_size) shards the model with FSDP2; launch with an FSDP2 "
            "config such as accelerate_configs/sequence_parallel.yaml"
        )
    # On CPU accelerate validates a parallelism config against MULTI_CPU and refuses it; sequence groups it knows
    # under DeepSpeed only. Either way the mesh is attached below, once the state is FSDP.
    attach = sizes is not None and (on_cpu or sizes.sequence > 1)
    if on_cpu and plugin is not None and "LOCAL_RANK" not in os.environ:
        single_process_group_env()
    if attach:
        del os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"]
    accelerator = Accelerator(
        cpu=on_cpu,
        fsdp_plugin=plugin,
        log_with=trackers or None,
        project_dir=project_dir,
        # A seedable sampler makes the data order a function of (seed, epoch) on every process count.
        # non_blocking: batches are copied to a GPU from pinned memory (finetune.data.loader_options) asynchronously.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, non_blocking=True),
    )
    if on_cpu and plugin is not None:
        enable_fsdp_on_cpu(accelerator, plugin)
    if attach and plugin is not None:
        _attach_mesh(accelerator, sizes)
    if accelerator.num_processes != launched_world_size():
        raise FinetuneError(
            f"the launcher started {launched_world_size()} processes but this one joined a group of "
            f"{accelerator.num_processes}: the ranks would train unsynchronized. Launch with "
            "`accelerate launch --config_file accelerate_configs/<config>.yaml -m finetune train <recipe>`"
        )
    return accelerator


@dataclass(frozen=True)
class MeshSizes:
    """How an FSDP2 launch's processes are laid out: `replicas` x `shard` x `sequence` of them."""

    replicas: int
    """Copies of the sharded model (hybrid sharding); 1: fully sharded."""
    shard: int
    """Data-parallel processes one copy is sharded over, beside the sequence groups."""
    sequence: int
    """Processes each row is split over (`finetune.engine.sequence`); 1: none."""


def mesh_sizes() -> MeshSizes | None:
    """The layout accelerate's parallelism config asks for, checked against the launch; None without one.

    A config that gives only `dp_shard_size` (the GPUs of one machine) replicates over however many machines are
    launched, so one config file serves any node count; one that gives only `sp_size` shards over every process.
    """
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return None
    world = launched_world_size()
    sizes = {
        name: int(os.environ.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1"))
        for name in ("dp_replicate", "dp_shard", "tp", "cp")
    }
    if sizes["tp"] * sizes["cp"] != 1:
        raise FinetuneError(
            "finetune trains with data and sequence parallelism; set parallelism_config_tp_size and _cp_size to 1 "
            "(torch's context parallelism replaces each layer's mask by causal attention, which packed rows cannot "
            "take, and has no CPU kernel; for long rows parallelism_config_sp_size splits each row over that many "
            "processes, packing intact)"
        )
    sequence = launched_sequence_size()  # checked: a whole number >= 1
    if world % sequence:
        raise FinetuneError(
            f"parallelism_config_sp_size={sequence} does not divide the {world} launched processes into whole "
            "sequence groups; launch a multiple of it (or set sp_size to a divisor of the process count)"
        )
    shard, replicate = sizes["dp_shard"], sizes["dp_replicate"]
    if shard == 1 and replicate == 1 and sequence == 1:  # every size 1 asks for nothing: no mesh of its own
        del os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"]
        return None
    if shard == 1 and replicate == 1:  # sequence groups alone
        return MeshSizes(1, world // sequence, sequence)
    replicate, tiles = hybrid_replicas(shard, replicate, world // sequence)
    if not tiles:
        raise FinetuneError(
            f"hybrid sharding with shard groups of dp_shard_size={shard} and dp_replicate_size={replicate} replicas "
            f"does not tile the {world // sequence} {'data-parallel' if sequence > 1 else 'launched'} processes "
            f"({replicate} x {shard} = {replicate * shard}); set parallelism_config_dp_shard_size to the processes "
            "per machine (at least 2, dividing the process count) and leave dp_replicate_size out"
        )
    os.environ["PARALLELISM_CONFIG_DP_REPLICATE_SIZE"] = str(replicate)
    return MeshSizes(replicate, shard, sequence)


def _attach_mesh(accelerator: Accelerator, sizes: MeshSizes) -> None:
    """Give accelerate the parallelism config and mesh of `sizes`, once its state is FSDP (it validates a
    parallelism config against the distributed type, and knows sequence groups under DeepSpeed only).

    Sequence groups are the mesh's `cp` dimension (`finetune.engine.sequence` says why); the config keeps `cp_size=1`,
    so that accelerate attaches none of its ring-attention hooks."""
    config = ParallelismConfig(
        dp_replicate_size=sizes.replicas, dp_shard_size=sizes.shard, tp_size=1, cp_size=1, sp_size=1
    )
    device_type = accelerator.device.type
    if sizes.sequence == 1:
        mesh = config.get_device_mesh(device_type)
    else:
        names = ("dp_replicate", "dp_shard", sequence.MESH_DIM)
        mesh = init_device_mesh(device_type, (sizes.replicas, sizes.shard, sizes.sequence), mesh_dim_names=names)
        mesh[names[:2]]._flatten("dp")
        mesh[names[1:]]._flatten("dp_shard_cp")  # FSDP2 shards over every data x sequence process
        config.device_mesh = mesh
    accelerator.state.parallelism_config = config
    accelerator.state.device_mesh = mesh


def _check_launch_environment(recipe_activation_checkpointing: bool) -> None:
    """Reject recipe/accelerate-config combinations that contradict each other or the hardware."""
    if recipe_activation_checkpointing and os.environ.get("FSDP_ACTIVATION_CHECKPOINTING", "false") == "true":
        raise FinetuneError(
            "activation checkpointing is enabled both in the recipe (train.activation_checkpointing) and in the "
            "accelerate config (fsdp_activation_checkpointing); remove one of them"
        )
    dropped = dropped_processes()
    if dropped is not None:
        asked, config = dropped
        raise FinetuneError(
            f"accelerate launch was asked for {asked} processes, and {config} starts one (distributed_type: NO) "
            "and drops the rest; launch it with --num_processes 1, or use accelerate_configs/ddp.yaml or "
            "fsdp2_full_shard.yaml for several"
        )
    mixed_precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if mixed_precision == "bf16" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
        raise FinetuneError(
            f"the accelerate config asks for mixed_precision: bf16 but {torch.cuda.get_device_name()} has no bf16; "
            "use mixed_precision: fp16 or 'no' in the accelerate config"
        )


def _fsdp_plugin(on_cpu: bool, param_dtype: torch.dtype) -> FullyShardedDataParallelPlugin:
    """The FSDP plugin from the launcher's environment, with our mixed-precision policy.

    accelerate raises while building an FSDP1 plugin with `sync_module_states` on a machine without
    an accelerator, and torch's FSDP1 refuses to sync CPU tensors anyway. On CPU we build the plugin
    with it off and broadcast rank 0's weights ourselves (`broadcast_module_states`).
    """
    version = os.environ.get("FSDP_VERSION", "1")
    if version not in ("1", "2"):  # accelerate would read the config as FSDP1's and fail on an FSDP2 setting
        raise FinetuneError(
            f"the accelerate config says fsdp_version: {version}; accelerate has FSDP 1 and 2: set fsdp_version: 2 "
            "(or start from accelerate_configs/fsdp2_full_shard.yaml)"
        )
    fsdp_version = int(version)
    if fsdp_version == 1:
        _check_fsdp1_launch(on_cpu)
    options: dict[str, Any] = {}
    policy = _mixed_precision_policy(fsdp_version, os.environ.get("ACCELERATE_MIXED_PRECISION", "no"), param_dtype)
    if policy is not None:
        options["mixed_precision_policy"] = policy
    if on_cpu and fsdp_version == 1:
        options["sync_module_states"] = False
    return FullyShardedDataParallelPlugin(**options)


def _check_fsdp1_launch(on_cpu: bool) -> None:
    """FSDP1 settings that would fail deep inside torch, or worse, train wrongly without a word."""
    if os.environ.get("FSDP_SHARDING_STRATEGY", "").upper() in ("HYBRID_SHARD", "4"):
        # FSDP1 shards over the devices torch counts on one machine and replicates across machines.
        # A shard group of one process is clamped to NO_SHARD *within that group*: gradients are then
        # never reduced across machines and the replicas silently train apart.
        devices = None if on_cpu else torch.accelerator.device_count()
        world = launched_world_size()
        if (devices or 1) == 1 and world > 1:
            where = "a CPU process" if on_cpu else "1 device per machine"
            raise FinetuneError(
                f"hybrid sharding (HYBRID_SHARD) would use shard groups of 1 process ({where}) and {world} "
                "replicas: torch's FSDP1 turns a 1-process shard group into NO_SHARD and "
                "never reduces gradients across replicas, so they would train apart. Use "
                "accelerate_configs/fsdp2_full_shard.yaml (or ddp.yaml) when each machine has one device"
            )
        check_hybrid_shard_group(world, int(os.environ.get("LOCAL_WORLD_SIZE", world)), devices)
    if on_cpu and os.environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true":
        raise FinetuneError(
            "FSDP1 CPU offload pins host memory, which needs a GPU; on a CPU-only machine use an FSDP2 config "
            "(accelerate_configs/fsdp2_offload.yaml) or pass --fsdp_offload_params false"
        )
    if on_cpu and os.environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() == "true":
        raise FinetuneError(
            "FSDP1 rank-0 loading (cpu_ram_efficient_loading) broadcasts the weights with sync_module_states, which "
            "needs a GPU; on a CPU-only machine use an FSDP2 config or pass --fsdp_cpu_ram_efficient_loading false"
        )


_COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(mixed_precision: str, param_dtype: torch.dtype) -> torch.dtype:
    """The dtype the matmuls run in: the accelerate config's mixed precision, else the parameters' own."""
    return _COMPUTE_DTYPES.get(str(mixed_precision), param_dtype)


def _mixed_precision_policy(fsdp_version: int, mixed_precision: str, param_dtype: torch.dtype) -> Any:
    """fp32 master parameters + low-precision compute: compute in bf16/fp16, reduce gradients in fp32.

    accelerate's default FSDP policy reduces gradients in the compute dtype; summed over many ranks
    in bf16 (8 bits of mantissa) that loses the small gradient components that fp32 master weights
    exist to keep. None (accelerate's default) for fp32 training and FSDP1 low-precision parameters.
    """
    compute = _COMPUTE_DTYPES.get(mixed_precision)
    # accelerate upcasts FSDP2's parameters to float32 under mixed precision, whatever model.dtype says.
    if compute is None or (param_dtype != torch.float32 and fsdp_version == 1):
        return None
    if fsdp_version == 2:
        # No output_dtype: it would cast every floating output of the root to the compute dtype, the fp32 loss
        # and per-token log-probabilities the chunked head returns as the model's output included (a summed
        # loss rounded to bf16 loses its third digit; a preference run's log-ratios, all of them).
        return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    return MixedPrecision(param_dtype=compute, reduce_dtype=torch.float32, buffer_dtype=compute)


def precision_policy(accelerator: Accelerator, requested: torch.dtype, stored: torch.dtype) -> str:
    """Which dtype each kind of tensor has in this run: `stored` is the prepared model's real parameter
    dtype, which differs from the recipe's `requested` one where accelerate upcast it."""
    compute = _COMPUTE_DTYPES.get(accelerator.mixed_precision)
    stored_name = dtype_name(stored)
    if compute is None:
        line = f"precision: {stored_name} throughout (parameters, gradients, optimizer state, compute, reduction)"
    elif stored == torch.float32:
        line = (
            f"precision: {accelerator.mixed_precision} mixed; parameters, gradients and optimizer state in float32, "
            f"compute in {dtype_name(compute)}, gradients reduced in float32"
        )
    else:
        mixed = accelerator.mixed_precision
        line = f"precision: {stored_name} parameters, gradients and optimizer state, {mixed} compute"
    if stored != requested:
        line += (
            f" (model.dtype {dtype_name(requested)} was upcast by accelerate, which keeps float32 "
            "master parameters under FSDP2 mixed precision; for pure bf16 set mixed_precision: no)"
        )
    return line


def strategy_name(accelerator: Accelerator) -> str:
    """A short human name for what this run really does, e.g. `FSDP2 (reshard_after_forward=True)`."""
    if accelerator.distributed_type != DistributedType.FSDP:
        if accelerator.num_processes > 1:
            return f"DDP over {accelerator.num_processes} processes"
        return "single process (no sharding)"
    plugin = accelerator.state.fsdp_plugin
    if plugin.fsdp_version == 2:
        detail = f"reshard_after_forward={plugin.reshard_after_forward}"
        mesh = accelerator.parallelism_config
        sp = sequence.sequence_parallel(accelerator)
        if mesh is not None and mesh.dp_replicate_enabled:
            shard = mesh.dp_shard_size * (sp.size if sp is not None else 1)  # sharded over data x sequence processes
            detail = f"hybrid: {mesh.dp_replicate_size} replicas x {shard}-process shard groups, {detail}"
        if sp is not None:
            detail = f"rows split over sequence groups of {sp.size} (all-to-all attention), {detail}"
    else:
        detail = f"sharding_strategy={plugin.sharding_strategy.name}"
    offload = ", CPU offload" if _offloads(plugin) else ""
    return f"FSDP{plugin.fsdp_version} ({detail}{offload}) over {accelerator.num_processes} processes"


def running_launch(accelerator: Accelerator) -> Launch:
    """The launch this process runs in, as `finetune plan` describes one (read from accelerate's state
    rather than a config file, which a running process does not know)."""
    plugin = accelerator.state.fsdp_plugin if accelerator.distributed_type == DistributedType.FSDP else None
    mesh = accelerator.parallelism_config
    hybrid = plugin is not None and plugin.fsdp_version == 2 and mesh is not None and mesh.dp_replicate_enabled
    if plugin is None:
        strategy = "ddp"
    elif hybrid:
        strategy = "hybrid_shard"
    elif plugin.fsdp_version == 2:
        strategy = "full_shard" if plugin.reshard_after_forward else "shard_grad_op"
    else:
        strategy = plugin.sharding_strategy.name.lower()
    per_machine = int(os.environ.get("LOCAL_WORLD_SIZE", accelerator.num_processes))  # torchrun sets it
    machines = max(1, accelerator.num_processes // max(1, per_machine))
    wrap_classes = getattr(plugin, "transformer_cls_names_to_wrap", None) or ()
    return Launch(
        config_path=Path("<running>"),
        strategy=strategy,
        fsdp_version=plugin.fsdp_version if plugin is not None else 0,
        num_processes=accelerator.num_processes,
        num_machines=machines,
        machine_rank=0,
        main_process_ip=None,
        mixed_precision=str(accelerator.mixed_precision),
        offload=plugin is not None and _offloads(plugin),
        activation_checkpointing=bool(plugin is not None and plugin.activation_checkpointing),
        cpu_ram_efficient_loading=bool(plugin is not None and plugin.cpu_ram_efficient_loading),
        hybrid_shard_size=mesh.dp_shard_size if hybrid else None,
        wrap_policy="TRANSFORMER_BASED_WRAP" if wrap_classes else "NO_WRAP",
        wrap_classes=tuple(wrap_classes),
    )


def _offloads(plugin: FullyShardedDataParallelPlugin) -> bool:
    offload = plugin.cpu_offload
    return isinstance(offload, CPUOffloadPolicy) or bool(getattr(offload, "offload_params", False))


def shard_report(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, Any]:
    """How many parameter elements this rank really holds, per FSDP unit (or per parameter) and in total.

    Measured from the local tensors: DTensor shards (FSDP2), the local FlatParameter shard (FSDP1),
    or the full parameters (DDP / single process).
    """
    if accelerator.distributed_type == DistributedType.FSDP:
        units = [dataclasses.asdict(unit) for unit in fsdp_units(model)]
    else:
        units = [
            {"class_name": n, "numel_global": p.numel(), "numel_local": p.numel()} for n, p in model.named_parameters()
        ]
    return {
        "rank": accelerator.process_index,
        "num_processes": accelerator.num_processes,
        "distributed_type": accelerator.distributed_type.value,
        "strategy": strategy_name(accelerator),
        "numel_global": sum(u["numel_global"] for u in units),
        "numel_local": sum(u["numel_local"] for u in units),
        "units": units,
    }


def local_params_fingerprint(model: torch.nn.Module) -> str:
    """A hash of the parameter values this rank holds; equal across DDP ranks iff they stayed in sync."""
    digest = hashlib.sha256()
    for param in model.parameters():
        digest.update(local_tensor(param).detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()
