"""What an accelerate config plus the launch command say about the hardware, checked before launching.

A multi-node launch that is missing MAIN_PROCESS_IP, or whose machine count disagrees with the
scheduler, does not fail: its ranks wait for peers that never come until a rendezvous timeout.
`read_launch` turns the config file and the command-line sizes into one `Launch` and reports every
such problem at once, with the numbers; `finetune check` (run by every `make train-*` target and by
the SLURM script) calls it before any process starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from finetune.config import RecipeConfig
from finetune.errors import FinetuneError, first_line

STRATEGIES = ("full_shard", "shard_grad_op", "hybrid_shard", "ddp")

ASYNC_SAVE_NEEDS = (
    "checkpoint.async_save needs full fine-tuning under FSDP2 with fsdp_state_dict_type: SHARDED_STATE_DICT "
    "(e.g. accelerate_configs/fsdp2_full_shard.yaml); set checkpoint.async_save=false for this launch"
)


@dataclass(frozen=True)
class Launch:
    """How many processes, where, and sharded how."""

    config_path: Path
    strategy: str
    """One of STRATEGIES: how parameters, gradients and optimizer state are split across processes."""
    fsdp_version: int
    num_processes: int
    """Processes in all, over every machine."""
    num_machines: int
    machine_rank: int
    main_process_ip: str | None
    mixed_precision: str
    offload: bool
    activation_checkpointing: bool
    cpu_ram_efficient_loading: bool
    hybrid_shard_size: int | None
    """FSDP2 hybrid sharding: parallelism_config_dp_shard_size. (FSDP1's HYBRID_SHARD shards per machine.)"""
    wrap_policy: str
    """fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP."""
    wrap_classes: tuple[str, ...]
    """Layer classes FSDP wraps one unit each; empty: the model's `_no_split_modules`."""
    state_dict_type: str = "SHARDED_STATE_DICT"
    """fsdp_state_dict_type: how checkpoints hold the model (FULL_STATE_DICT or SHARDED_STATE_DICT)."""
    sequence_parallel: int = 1
    """parallelism_config_sp_size: processes each row is split over (`finetune.engine.sequence`)."""

    @property
    def data_parallel(self) -> int:
        """Processes that train on rows of their own."""
        return self.num_processes // self.sequence_parallel

    @property
    def processes_per_machine(self) -> int:
        return self.num_processes // self.num_machines

    @property
    def shard_group(self) -> int:
        """Processes one copy of the model is sharded over (the rest replicate it)."""
        if self.strategy == "ddp":
            return 1
        if self.strategy == "hybrid_shard":
            return (self.hybrid_shard_size or self.processes_per_machine) * self.sequence_parallel
        return self.num_processes

    def describe(self) -> str:
        sizes = f"{self.num_processes} processes on {self.num_machines} machine(s)"
        if self.strategy == "hybrid_shard":
            sizes += f", {self.num_processes // self.shard_group} replicas x {self.shard_group}-process shard groups"
        if self.sequence_parallel > 1:
            sizes += f", rows split over sequence groups of {self.sequence_parallel}"
        engine = f"FSDP{self.fsdp_version} " if self.strategy != "ddp" else ""
        return f"{engine}{self.strategy}, {sizes}, mixed precision {self.mixed_precision}"


def read_launch(
    config_path: Path,
    num_processes: int | None = None,
    num_machines: int | None = None,
    *,
    machine_rank: int | None = None,
    main_process_ip: str | None = None,
    wrap_classes: str | None = None,
    environ: Mapping[str, str] = os.environ,
    for_launch: bool = True,
) -> Launch:
    """The launch that `accelerate launch --config_file config_path` plus these arguments would start.

    Arguments left as None take the config file's values, as accelerate does; `environ` is where a
    SLURM allocation is read from. `for_launch=False` (planning) does not ask for the rank-0 address.
    """
    if not config_path.is_file():
        raise FinetuneError(f"accelerate config {config_path} does not exist; pass one of accelerate_configs/*.yaml")
    try:
        raw = yaml.safe_load(config_path.read_text()) or {}
    except yaml.YAMLError as exc:
        message = " ".join(str(exc).split())
        raise FinetuneError(f"accelerate config {config_path} is not valid YAML: {message}") from None
    _check_accepted(config_path, raw)
    fsdp = raw.get("fsdp_config") or {}
    is_fsdp = raw.get("distributed_type") == "FSDP"
    fsdp_version = fsdp.get("fsdp_version", 1) if is_fsdp else 0
    if fsdp_version not in (0, 1, 2):
        raise FinetuneError(
            f"accelerate config {config_path} sets fsdp_version: {fsdp_version}; FSDP comes in versions 1 and 2: "
            "use 2 (accelerate_configs/fsdp2_full_shard.yaml)"
        )
    sequence = (raw.get("parallelism_config") or {}).get("parallelism_config_sp_size", 1)
    if isinstance(sequence, bool) or not isinstance(sequence, int) or sequence < 1:
        raise FinetuneError(
            f"accelerate config {config_path} sets parallelism_config_sp_size: {sequence!r}; it is the number of "
            "processes each row is split over, a whole number >= 1 (1: no sequence parallelism)"
        )
    wrap = wrap_classes if wrap_classes is not None else fsdp.get("fsdp_transformer_layer_cls_to_wrap") or ""
    launch = Launch(
        config_path=config_path,
        strategy=_strategy(raw, fsdp, fsdp_version),
        fsdp_version=fsdp_version,
        num_processes=int(_pick(num_processes, raw.get("num_processes"), 1)),
        num_machines=int(_pick(num_machines, raw.get("num_machines"), 1)),
        machine_rank=int(_pick(machine_rank, raw.get("machine_rank"), 0)),
        main_process_ip=_pick(main_process_ip or None, raw.get("main_process_ip"), None),
        mixed_precision=str(raw.get("mixed_precision", "no")),
        offload=bool(fsdp.get("fsdp_offload_params", False)),
        activation_checkpointing=bool(fsdp.get("fsdp_activation_checkpointing", False)),
        cpu_ram_efficient_loading=bool(fsdp.get("fsdp_cpu_ram_efficient_loading", False)),
        hybrid_shard_size=_hybrid_shard_size(raw),
        wrap_policy=str(fsdp.get("fsdp_auto_wrap_policy", "NO_WRAP")),
        wrap_classes=tuple(name.strip() for name in str(wrap).split(",") if name.strip()),
        state_dict_type=str(fsdp.get("fsdp_state_dict_type", default_state_dict_type(fsdp_version))),
        sequence_parallel=sequence,
    )
    problems = launch_problems(launch, raw, environ, for_launch)
    if problems:
        raise FinetuneError(f"cannot launch with {config_path}: " + "; ".join(problems))
    return launch


def _check_accepted(config_path: Path, raw: object) -> None:
    """Refuse here what `accelerate launch` would refuse when reading the file (unknown keys, no
    distributed_type, such as a recipe passed as the accelerate config), with its reason."""
    from accelerate.commands.config.config_args import load_config_from_file

    if not isinstance(raw, dict) or "distributed_type" not in raw:
        raise FinetuneError(
            f"{config_path} is not an accelerate config (no distributed_type); pass one of accelerate_configs/*.yaml "
            "(recipes are the positional argument)"
        )
    try:
        load_config_from_file(str(config_path))
    except (ValueError, TypeError) as exc:
        reason = first_line(exc).split(", please try")[0]
        raise FinetuneError(
            f"accelerate launch would refuse {config_path} ({reason}); fix the keys, comparing with "
            "accelerate_configs/*.yaml"
        ) from None


def _pick(given, configured, default):
    if given is not None:
        return given
    return configured if configured is not None else default


def _strategy(raw: dict, fsdp: dict, fsdp_version: int) -> str:
    if raw.get("distributed_type") != "FSDP":
        return "ddp"
    if fsdp_version == 2:
        if _hybrid_shard_size(raw) is not None:
            return "hybrid_shard"
        return "full_shard" if fsdp.get("fsdp_reshard_after_forward", True) else "shard_grad_op"
    strategy = str(fsdp.get("fsdp_sharding_strategy", "FULL_SHARD")).lower()
    return strategy if strategy in STRATEGIES else "full_shard"


def hybrid_replicas(shard: int, replicate: int, processes: int) -> tuple[int, bool]:
    """Replicas of a hybrid-sharding launch, and whether its shard groups tile the processes.

    A replicate size left at 1 follows from the launch (processes / shard), so one config file
    serves any node count; shard groups need at least 2 processes (accelerate has no shard dimension
    otherwise) and must divide the process count.
    """
    if replicate == 1 and shard > 0 and processes % shard == 0:
        replicate = processes // shard
    return replicate, not (shard < 2 or processes % shard or replicate * shard != processes)


def _hybrid_shard_size(raw: dict) -> int | None:
    parallelism = raw.get("parallelism_config") or {}
    shard = parallelism.get("parallelism_config_dp_shard_size")
    if shard is None and set(parallelism) <= {"parallelism_config_sp_size"}:
        return None  # sequence groups alone (or sp_size 1, none): every process shards the model
    return int(shard or 1) if parallelism else None


def launch_problems(launch: Launch, raw: dict, environ: Mapping[str, str], for_launch: bool) -> list[str]:
    """Every inconsistency in the launch sizes, each with its fix; `for_launch` adds what only a real
    launch needs (the rank-0 address, agreement with the SLURM allocation)."""
    processes, machines = launch.num_processes, launch.num_machines
    if processes < 1 or machines < 1:
        return [f"NUM_PROCESSES={processes} and NUM_MACHINES={machines} must both be at least 1"]
    problems = []
    if raw.get("distributed_type") == "NO" and processes > 1:
        # accelerate would start one process and drop the others without a word.
        problems.append(
            f"{launch.config_path.name} runs one process (distributed_type: NO), not NUM_PROCESSES={processes}; "
            "launch it with 1, or use accelerate_configs/ddp.yaml or fsdp2_full_shard.yaml for several"
        )
    if processes % machines:
        problems.append(
            f"NUM_PROCESSES={processes} is not a multiple of NUM_MACHINES={machines}: every machine runs the same "
            f"number of processes, so use {machines} x (processes per machine), e.g. {machines * 8} for 8 GPUs each"
        )
    if not 0 <= launch.machine_rank < machines:
        problems.append(f"MACHINE_RANK={launch.machine_rank} must be between 0 and NUM_MACHINES-1={machines - 1}")
    if for_launch and machines > 1 and not launch.main_process_ip:
        problems.append(
            f"NUM_MACHINES={machines} needs MAIN_PROCESS_IP, the address of the machine with MACHINE_RANK=0 that "
            "every machine can reach (under SLURM: scontrol show hostnames $SLURM_JOB_NODELIST | head -n1)"
        )
    slurm_nodes = environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES")
    if for_launch and slurm_nodes and int(slurm_nodes) != machines:
        problems.append(
            f"NUM_MACHINES={machines} but this SLURM job has {slurm_nodes} nodes; "
            "set NUM_MACHINES=$SLURM_JOB_NUM_NODES"
        )
    parallelism = raw.get("parallelism_config") or {}
    for name in ("tp", "cp"):
        if int(parallelism.get(f"parallelism_config_{name}_size", 1)) != 1:
            problems.append(
                f"parallelism_config_{name}_size: finetune trains with data and sequence parallelism (torch's "
                "context parallelism replaces each layer's mask by causal attention, which packed rows cannot take, "
                f"and has no CPU kernel); remove it, and for long rows set parallelism_config_sp_size instead"
            )
    sequence = launch.sequence_parallel
    if sequence > 1 and launch.fsdp_version != 2:
        problems.append(
            f"parallelism_config_sp_size={sequence} (sequence parallelism) shards the model with FSDP2, not "
            f"{'FSDP1' if launch.fsdp_version == 1 else 'distributed_type: ' + str(raw.get('distributed_type'))}; "
            "start from accelerate_configs/sequence_parallel.yaml"
        )
    if processes % max(sequence, 1):
        problems.append(
            f"parallelism_config_sp_size={sequence} does not divide NUM_PROCESSES={processes} into whole sequence "
            f"groups; launch a multiple of {sequence} processes"
        )
    if launch.hybrid_shard_size is not None and not processes % max(sequence, 1):
        shard = launch.hybrid_shard_size
        replicate = int(raw["parallelism_config"].get("parallelism_config_dp_replicate_size", 1))
        data = processes // max(sequence, 1)
        if not hybrid_replicas(shard, replicate, data)[1]:
            problems.append(
                f"hybrid sharding with shard groups of dp_shard_size={shard} processes does not divide "
                f"{'the data-parallel processes' if sequence > 1 else 'NUM_PROCESSES'}={data} into whole replicas "
                f"({data} / {shard} = {data / max(shard, 1):g}); "
                "set parallelism_config_dp_shard_size to the processes per machine (at least 2) and leave "
                "dp_replicate_size out"
            )
    return problems


def check_hybrid_shard_group(world_size: int, local_world_size: int, devices_per_machine: int | None) -> None:
    """FSDP1's HYBRID_SHARD shards over the devices torch sees on one machine and replicates across
    machines. Those groups must tile the processes exactly, or shard groups would straddle machines.
    `devices_per_machine` is None on CPU, where every process is its own shard group."""
    if devices_per_machine is None:
        return
    if world_size % devices_per_machine or local_world_size != devices_per_machine:
        raise FinetuneError(
            f"hybrid sharding shards over the {devices_per_machine} devices visible on each machine, but "
            f"{local_world_size} processes run per machine out of {world_size} in all, so shard groups of "
            f"{devices_per_machine} do not divide them into whole machines; launch {devices_per_machine} processes "
            f"per machine (NUM_PROCESSES = {devices_per_machine} x NUM_MACHINES) or set CUDA_VISIBLE_DEVICES to match"
        )


def default_state_dict_type(fsdp_version: int) -> str:
    """accelerate's default fsdp_state_dict_type: FULL under FSDP1, SHARDED under FSDP2."""
    return "FULL_STATE_DICT" if fsdp_version == 1 else "SHARDED_STATE_DICT"


def recipe_launch_problems(
    recipe: RecipeConfig,
    *,
    fsdp_version: int,
    rank_zero_loading: bool,
    state_dict_type: str,
    sequence_parallel: int = 1,
    data_parallel: int = 1,
) -> list[str]:
    """What a recipe cannot do under a launch (`fsdp_version` 0: DDP or one process; `data_parallel` processes
    with rows of their own), each with its fix. The one list that `finetune check` and training's preflight both
    refuse, before anything loads."""
    problems = recipe.train.batch_problems(data_parallel)
    if recipe.peft is not None and fsdp_version == 1:
        # FSDP1 flattens a layer's frozen and trainable parameters into one buffer (use_orig_params) and keeps
        # gradient memory for all of it.
        problems.append(
            "adapters (peft) train under FSDP2, DDP or one process, not FSDP1; launch with "
            "accelerate_configs/fsdp2_full_shard.yaml (or another FSDP2 config)"
        )
    if recipe.peft is not None and fsdp_version and rank_zero_loading:
        # Rank-0 loading would have to broadcast adapters created on the meta device: not proven here.
        problems.append(
            "adapters (peft) do not support rank-0 loading yet; set fsdp_cpu_ram_efficient_loading: false in the "
            "accelerate config"
        )
    # FSDP1 gathers the root's parameters in its wrapper's forward, which transformers' generate goes around (a
    # crash at the first evaluation, measured: "'weight' must be 2-D").
    if recipe.rl is not None and fsdp_version == 1:
        problems.append(
            "online RL (rl) generates under FSDP2, DDP or one process, not FSDP1; launch with "
            "accelerate_configs/fsdp2_full_shard.yaml (or another FSDP2 config)"
        )
    elif recipe.distill is not None and recipe.distill.on_policy_fraction > 0 and fsdp_version == 1:
        problems.append(
            "on-policy distillation (distill.on_policy_fraction > 0) generates under FSDP2, DDP or one process, not "
            "FSDP1; launch with accelerate_configs/fsdp2_full_shard.yaml (or another FSDP2 config)"
        )
    elif recipe.eval.generate is not None and fsdp_version == 1:
        problems.append(
            "eval.generate answers prompts under FSDP2, DDP or one process, not FSDP1; launch with "
            "accelerate_configs/fsdp2_full_shard.yaml (or another FSDP2 config), or set eval.generate=null"
        )
    sharded = fsdp_version == 2 and state_dict_type.upper() == "SHARDED_STATE_DICT"
    if recipe.checkpoint.async_save and (not sharded or recipe.peft is not None):
        problems.append(ASYNC_SAVE_NEEDS)
    if sequence_parallel > 1:
        problems += sequence_recipe_problems(recipe, sequence_parallel)
    return problems


def sequence_recipe_problems(recipe: RecipeConfig, size: int) -> list[str]:
    """What a recipe cannot do with its rows split over sequence groups of `size` (the model's own limits are
    `finetune.engine.sequence.model_problems`)."""
    problems = []
    if recipe.model.attn_implementation != "varlen":
        problems.append(
            f"sequence parallelism (sp_size={size}) attends over the whole rows through the varlen path; set "
            f"model.attn_implementation: varlen (not {recipe.model.attn_implementation})"
        )
    if recipe.train.objective is not None:
        # Its loss would see slices of rows: right for a sum over tokens, wrong for anything per sequence.
        problems.append(
            f"sequence parallelism hands an objective slices of rows, and train.objective={recipe.train.objective} "
            "is not known to take them; launch without parallelism_config_sp_size"
        )
    if recipe.rl is not None:
        problems.append(
            f"online RL (rl) samples whole completions on each process, and sequence parallelism (sp_size={size}) "
            "splits rows; launch without parallelism_config_sp_size"
        )
    if recipe.distill is not None:
        # The teacher would need the student's split attention too; not built.
        problems.append(
            f"distillation (distill) runs its teacher on whole rows, and sequence parallelism (sp_size={size}) splits "
            "them; launch without parallelism_config_sp_size"
        )
    return problems


def environment_problems(recipe: RecipeConfig, environ: Mapping[str, str] = os.environ) -> list[str]:
    """`recipe_launch_problems` for the launch this process was started by (accelerate's environment)."""
    fsdp = environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    version = int(environ.get("FSDP_VERSION", "1")) if fsdp else 0
    from finetune.engine.sequence import launched_size  # torch's, imported when a process trains

    sequence_parallel = launched_size(environ)
    return recipe_launch_problems(
        recipe,
        fsdp_version=version,
        rank_zero_loading=fsdp and environ.get("FSDP_CPU_RAM_EFFICIENT_LOADING", "false").lower() == "true",
        state_dict_type=environ.get("FSDP_STATE_DICT_TYPE", default_state_dict_type(version)),
        sequence_parallel=sequence_parallel,
        data_parallel=max(1, int(environ.get("WORLD_SIZE", "1")) // sequence_parallel),
    )
