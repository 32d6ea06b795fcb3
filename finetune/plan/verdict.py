"""`finetune plan` and `finetune check`: the report a recipe's estimates make on a launch, a table per strategy
and the verdict lines for the configured one (what fits, the longest row that fits, the cheapest activation
checkpointing that does), and the policy a running training takes from the same estimates.
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from finetune.config import RecipeConfig
from finetune.engine.accelerator import running_launch
from finetune.engine.launch import STRATEGIES, Launch, recipe_launch_problems
from finetune.engine.recompute import Policy
from finetune.engine.sequence import model_problems
from finetune.engine.wrap import wrap_classes
from finetune.errors import FinetuneError
from finetune.model.loading import (
    check_attention,
    check_mlp_tiling,
    check_packing,
    check_positions,
    check_quantized_base,
)
from finetune.plan.estimates import Estimate, estimate
from finetune.plan.shape import ModelShape, micro_batch_line, planned_model, recipe_shape, rollout_rows, trainable_line

if TYPE_CHECKING:
    from accelerate import Accelerator


def parse_memory(text: str) -> int:
    """'80GB' / '80GiB' / '24 GB' -> bytes (GB = 10^9, GiB = 2^30)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT])(i?)B\s*", text, re.IGNORECASE)
    if match is None:
        raise FinetuneError(f"--gpu-memory {text!r} is not a size; write it like 80GB or 24GiB")
    power = "KMGT".index(match.group(2).upper()) + 1
    base = 1024 if match.group(3) else 1000
    size = int(float(match.group(1)) * base**power)
    if size <= 0:
        raise FinetuneError(f"--gpu-memory {text!r} is no memory; give the memory of one device, like 80GB")
    return size


def refuse_launch(recipe: RecipeConfig, launch: Launch) -> None:
    """What keeps this recipe from training on this launch at all (an rl run split over sequence groups, FSDP1
    where only FSDP2 serves), refused as training would refuse it: no plan for a launch that cannot run."""
    problems = recipe_launch_problems(
        recipe, fsdp_version=launch.fsdp_version if launch.strategy != "ddp" else 0,
        rank_zero_loading=launch.cpu_ram_efficient_loading, state_dict_type=launch.state_dict_type,
        sequence_parallel=launch.sequence_parallel, data_parallel=launch.data_parallel,
    )  # fmt: skip
    if problems:
        raise FinetuneError(f"cannot train with {launch.config_path}: " + "; ".join(problems))


def plan(recipe: RecipeConfig, launch: Launch, gpu_memory: int) -> str:
    """The report: a table per strategy and a verdict for the configured one."""
    refuse_launch(recipe, launch)
    shape = recipe_shape(recipe)
    refuse_positions(shape, recipe)
    estimates = {strategy: estimate(shape, recipe, launch, strategy) for strategy in STRATEGIES}
    largest = max(e.device_total("none") for e in estimates.values())
    unit_name, gib = ("GiB", 2**30) if largest >= 2**30 else ("MiB", 2**20)
    lines = [
        f"{shape.name}: {shape.parameters:,} parameters ({recipe.model.dtype}){trainable_line(shape)}, largest wrap "
        f"unit {shape.largest_unit:,}; micro-batch {micro_batch_line(recipe)} x {recipe.data.max_length} tokens; "
        f"{launch.num_processes} processes on {launch.num_machines} machine(s); mixed precision "
        f"{launch.mixed_precision}",
        f"per device, {unit_name} (device memory {gpu_memory / gib:.1f}):",
        f"  {'strategy':<15} {'params':>8} {'grads':>8} {'optim':>8} {'gather':>8} {'activ.':>8} {'act.+AC':>8} "
        f"{'total':>8} {'total+AC':>9}",
    ]
    for strategy, e in estimates.items():
        marker = "*" if strategy == launch.strategy else " "
        lines.append(
            f"{marker} {strategy:<15} {e.parameters / gib:>8.2f} {e.gradients / gib:>8.2f} "
            f"{e.optimizer_state / gib:>8.2f} {e.gather_buffers / gib:>8.2f} {e.activations / gib:>8.2f} "
            f"{e.activations_checkpointed / gib:>8.2f} {e.device_total('none') / gib:>8.2f} "
            f"{e.device_total('full') / gib:>9.2f}"
        )
    chosen = estimates[launch.strategy]
    policy = run_policy(chosen, recipe, launch, gpu_memory)
    if recipe.train.recompute == "auto" and not launch.activation_checkpointing:
        policy = f"auto, so {policy}"
    lines.append(
        f"activation checkpointing (this run: {policy}), activations per device: none "
        f"{chosen.activations / gib:.2f}, selective {chosen.activations_selective / gib:.2f}, full "
        f"{chosen.activations_checkpointed / gib:.2f} {unit_name}"
    )
    lines.append(
        f"host RAM per machine: {chosen.host_at_load / gib:.1f} {unit_name} at load"
        f"{' (rank 0 loads, cpu_ram_efficient_loading)' if launch.cpu_ram_efficient_loading else ''}, "
        f"{chosen.host_at_export / gib:.1f} {unit_name} at export"
        + (
            f", {chosen.host_offloaded / gib:.1f} {unit_name} of offloaded layer inputs (train.activation_offload)"
            if chosen.host_offloaded
            else ""
        )
    )
    if chosen.generation is not None:
        rollout = chosen.generation
        once = rollout.gathers_once(chosen, gpu_memory)
        gathered = (
            "parameters whole on the device (no sharding)"
            if launch.strategy == "ddp"
            else f"the whole model gathered once per rollout, {rollout.whole / gib:.2f}"
            if once
            else f"parameters gathered per layer at every token, {rollout.per_layer / gib:.2f}"
        )
        peak = rollout.total(chosen) - rollout.per_layer + (rollout.whole if once else rollout.per_layer)
        rows = rollout_rows(recipe, launch)
        kind = "rl" if recipe.rl is not None else "on-policy distill"
        kind += ", a static cache" if recipe.rl is not None and recipe.rl.rollout_cache == "static" else ""
        if recipe.rl is not None and recipe.rl.agents:  # the answers' padding (see generation_bytes)
            kind += f", episodes of up to {recipe.rl.max_turns} turns with room for their answers' padding"
        each = " (one a row; a packed row's other samples add theirs)" if recipe.data.packing and kind != "rl" else ""
        lines.append(
            f"generation ({kind}: {rows} completions a step{each}): KV cache {rollout.kv_cache / gib:.2f}, "
            f"{gathered}, logits {rollout.logits / gib:.2f}; {peak / gib:.2f} {unit_name} per device while generating"
        )
    if chosen.device_at_load:
        lines.append(
            f"device memory at load: {chosen.device_at_load / gib:.1f} {unit_name} (the whole 4-bit base on every "
            "device until it is sharded)"
        )
    lines.append(f"verdict (* = this config): {verdict(shape, recipe, launch, gpu_memory)}")
    lines.append(_longest_line(shape, recipe, launch, gpu_memory))
    return "\n".join(lines)


def refuse_positions(shape: ModelShape, recipe: RecipeConfig) -> None:
    """A data.max_length past the positions of the model (or its teacher), refused as training refuses it."""
    name = recipe.distill.teacher if shape.positions_of == "distill.teacher" and recipe.distill else None
    check_positions(shape.positions, recipe.data.max_length, name or recipe.model.name_or_path, shape.positions_of)


def _longest_line(shape: ModelShape, recipe: RecipeConfig, launch: Launch, gpu_memory: int) -> str:
    """The longest row memory allows, no longer than the positions the model (and its teacher) attend."""
    longest = longest_fitting_length(shape, recipe, launch, gpu_memory)
    pieces = _long_row_pieces(shape, recipe, launch)
    if shape.positions is not None and longest >= shape.positions:
        whose = "the teacher's (distill.teacher)" if shape.positions_of == "distill.teacher" else "the model's"
        return (
            f"longest data.max_length this launch fits: {shape.positions:,} tokens, {whose} positions (memory alone "
            f"would allow {longest:,}; {pieces})"
        )
    if not longest:
        return "longest data.max_length this launch fits: none of 1,024 tokens or more"
    return f"longest data.max_length this launch fits: {longest:,} tokens ({pieces})"


def _long_row_pieces(shape: ModelShape, recipe: RecipeConfig, launch: Launch) -> str:
    """Which of the pieces that lengthen a row this launch uses, and which it does not (ALST's set: sequence
    parallelism, tiled MLP and loss, activation checkpointing with its inputs offloaded, state offloaded)."""
    pieces = {
        f"sequence parallel over {launch.sequence_parallel}": launch.sequence_parallel > 1,
        f"MLP tiles of {recipe.train.mlp_tile_tokens or 0:,} tokens": bool(recipe.train.mlp_tile_tokens),
        "chunked loss": recipe.train.loss_path == "chunked",
        "activation checkpointing": launch.activation_checkpointing or recipe.train.recompute != "none",
        "layer inputs offloaded": recipe.train.activation_offload,
        "parameters and optimizer state offloaded": launch.offload,
    }
    used = [piece for piece, on in pieces.items() if on]
    unused = {
        "train.mlp_tile_tokens": not recipe.train.mlp_tile_tokens and not shape.routed,  # tiles: dense MLPs only
        "train.activation_offload": not recipe.train.activation_offload,
        "an offload config": not launch.offload,
        "parallelism_config_sp_size": launch.sequence_parallel == 1 and launch.num_processes > 1,
    }
    without = [name for name, missing in unused.items() if missing]
    return f"with {', '.join(used) or 'none of the pieces'}" + (f"; not with {', '.join(without)}" if without else "")


def longest_fitting_length(shape: ModelShape, recipe: RecipeConfig, launch: Launch, gpu_memory: int) -> int:
    """The longest `data.max_length`, in steps of 1,024 tokens, whose estimate fits `gpu_memory` under the run's
    checkpointing policy (`auto`: the cheapest that fits), everything else as the recipe says; 0 if none does."""

    def fits(length: int) -> bool:
        resized = replace(recipe, data=replace(recipe.data, max_length=length))
        chosen = estimate(shape, resized, launch, launch.strategy)
        return chosen.device_peak(run_policy(chosen, resized, launch, gpu_memory)) <= usable_memory(gpu_memory)

    low, high = 0, 2**12  # in units of 1,024 tokens: up to 4,194,304
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle * 1024) else (low, middle - 1)
    return low * 1024


def verdict(shape: ModelShape, recipe: RecipeConfig, launch: Launch, gpu_memory: int) -> str:
    """fits / fits with checkpointing or offload / does not fit, for the configured strategy."""
    chosen = estimate(shape, recipe, launch, launch.strategy)
    checkpointing = run_policy(chosen, recipe, launch, gpu_memory)
    usable = usable_memory(gpu_memory)
    kept = f"{(gpu_memory - usable) / 2**30:.1f} of the device's {gpu_memory / 2**30:.1f} kept as headroom"
    if chosen.device_at_load > usable:
        return (
            f"does not fit at load ({chosen.device_at_load / 2**30:.1f} GiB needed of {usable / 2**30:.1f}; {kept}): "
            "transformers loads the whole 4-bit base onto every device before accelerate shards it; use devices "
            f"with at least {math.ceil(chosen.device_at_load / 2**30 * 1.1)} GiB"
        )
    need = chosen.device_peak(checkpointing)
    if need <= usable:
        at_load = " at load" if chosen.device_at_load > chosen.device_total(checkpointing) else ""
        return f"fits ({need / 2**30:.1f} of {usable / 2**30:.1f} GiB{at_load}; {kept})"
    if checkpointing == "none" and chosen.device_total("selective") <= usable:
        return "fits with selective activation checkpointing (train.activation_checkpointing: selective)"
    if checkpointing != "full" and chosen.device_total("full") <= usable:
        return "fits with activation checkpointing (train.activation_checkpointing: full)"
    if launch.strategy != "ddp" and not launch.offload:
        offloaded = estimate(
            shape, recipe, replace(launch, offload=True, activation_checkpointing=True), launch.strategy
        )
        if offloaded.device_total("full") <= usable:
            return "fits with CPU offload and activation checkpointing (accelerate_configs/fsdp2_offload.yaml)"
    more = math.ceil(need / usable * launch.num_processes)
    return (
        f"does not fit ({need / 2**30:.1f} GiB needed of {usable / 2**30:.1f}; {kept}); "
        f"shard over more devices (about {more}), lower micro_batch_size or max_length"
    )


def run_policy(chosen: Estimate, recipe: RecipeConfig, launch: Launch, gpu_memory: int | None) -> Policy:
    """The activation-checkpointing policy the run uses: the accelerate config's (full) or the recipe's,
    `auto` resolved by `cheapest_policy` on the launch's estimate `chosen`."""
    if launch.activation_checkpointing:
        return "full"
    if recipe.train.recompute != "auto":
        return recipe.train.recompute
    return cheapest_policy(chosen, gpu_memory)


def cheapest_policy(chosen: Estimate, gpu_memory: int | None) -> Policy:
    """`train.activation_checkpointing: auto`: the first of none, selective, full (least recomputation first)
    whose estimated peak (`chosen`, the launch's strategy) fits `gpu_memory` less its headroom; full when none does
    (the verdict then says what else to change); none when there is no device memory to fit (CPU)."""
    if gpu_memory is None:
        return "none"
    policies: tuple[Policy, ...] = ("none", "selective", "full")
    usable = usable_memory(gpu_memory)
    return next((policy for policy in policies if chosen.device_peak(policy) <= usable), "full")


def usable_memory(gpu_memory: int) -> int:
    """What a plan may fill of a device's memory: all but a headroom for what no estimate counts, 5% for the
    caching allocator's fragmentation and 1 GiB for the CUDA context, its kernels and NCCL's buffers (5% more on
    devices under 20 GiB)."""
    return gpu_memory - gpu_memory // 20 - min(2**30, gpu_memory // 20)


_RECOMPUTED = {
    "none": "every activation kept, nothing recomputed",
    "full": "each decoder layer keeps its input and recomputes its forward in backward",
    "selective": "decoder layers keep matmul and attention outputs and recompute the rest",
}


def recompute_policy(recipe: RecipeConfig, accelerator: Accelerator) -> tuple[Policy, str | None]:
    """The recipe's activation-checkpointing policy, `auto` resolved by the plan's estimate against this
    device's memory (`cheapest_policy`), and its log line (None for none, asked for)."""
    requested = recipe.train.recompute
    if requested != "auto":
        line = f"activation checkpointing: {requested} ({_RECOMPUTED[requested]})" if requested != "none" else None
        if recipe.train.activation_offload:
            line = f"{line}; layer inputs kept in host memory until their backward (train.activation_offload)"
        return requested, line
    cuda = accelerator.device.type == "cuda"
    memory = torch.cuda.get_device_properties(accelerator.device).total_memory if cuda else None
    launch = running_launch(accelerator)
    policy = cheapest_policy(estimate(recipe_shape(recipe), recipe, launch, launch.strategy), memory)
    reason = (
        f"the first that the plan fits in {memory / 2**30:.1f} GiB"
        if memory
        else f"{accelerator.device.type}: no device memory to fit"
    )
    return policy, f"activation checkpointing: auto, so {policy} ({reason}; {_RECOMPUTED[policy]})"


def check(recipe: RecipeConfig, launch: Launch, gpu_memory: int) -> str:
    """`finetune check`: everything about a launch that can be known before starting it, offline.

    The recipe and launch sizes were validated when they were read; here the model is built on the
    meta device from its config, its wrap classes are found in it, and the memory plan is given.
    Problems raise FinetuneError; a plan that does not fit is reported, not refused (it is an estimate).
    """
    refuse_launch(recipe, launch)
    check_attention(recipe.model)
    check_mlp_tiling(recipe.model, recipe.train.mlp_tile_tokens)
    check_packing(recipe.model, recipe.data.packing)
    check_quantized_base(recipe.model, adapters=recipe.peft is not None, export_merged=recipe.output.export_merged)
    model = planned_model(recipe)
    problems = model_problems(model.config, launch.sequence_parallel)
    if problems:
        raise FinetuneError(f"cannot train with {launch.config_path}: " + "; ".join(problems))
    shape = recipe_shape(recipe, model)
    refuse_positions(shape, recipe)
    source = recipe.model.config_file or recipe.model.name_or_path
    lines = [f"model: {shape.name} from {source}, {shape.parameters:,} parameters{trainable_line(shape)}"]
    if launch.strategy != "ddp" and launch.wrap_policy == "TRANSFORMER_BASED_WRAP":
        classes = wrap_classes(launch.wrap_classes, model)
        units = sum(type(m).__name__ in classes for m in model.modules())
        lines.append(f"wrap: {units} units of {', '.join(classes)}")
    lines.append(f"launch: {launch.describe()}")
    lines.append(f"memory per device: {verdict(shape, recipe, launch, gpu_memory)}")
    lines.append(_template_line(recipe))
    return "\n".join(lines)


def _template_line(recipe: RecipeConfig) -> str:
    """The recipe's chat template tried on probe conversations, where its tokenizer is on this machine."""
    from finetune.data.chat import probe_template
    from finetune.model.loading import load_tokenizer, model_folder

    if model_folder(recipe.model.name_or_path) is None:
        return "chat template: not checked (the tokenizer of model.name_or_path is not on this machine yet)"
    tokenizer = load_tokenizer(recipe.model, recipe.data.chat_template)
    line = probe_template(tokenizer)
    if recipe.rl is not None and recipe.rl.agents:  # how episodes will read calls and answer them
        from finetune.rollouts.tool_calls import tool_template

        template = tool_template(tokenizer)
        line += f"\n{template.describe()}"
        difference = template.history_difference()
        if difference is not None:
            line += f"\n  the history renders finished turns otherwise ({difference}): episodes keep what was read"
    return line
