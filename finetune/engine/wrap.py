"""The FSDP wrap plan: validated against the model before sharding, reported from the model after.

Silent wrong wrapping is the classic FSDP failure: a misspelled layer class or a size threshold
that matches nothing leaves the whole model in one unit, which trains but gathers every parameter
at once. Both are errors here, and the plan that really took effect is printed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy
from torch.distributed.tensor import DTensor

from finetune.errors import FinetuneError


@dataclass(frozen=True)
class Unit:
    """One FSDP unit: the parameters it all-gathers together."""

    class_name: str
    numel_global: int
    numel_local: int
    numel_trainable: int = -1
    """Parameters of the unit that train (all of them in full fine-tuning; its adapters' with PEFT);
    -1 where unknown (FSDP1's flat parameter)."""


def validate_wrap_policy(plugin: FullyShardedDataParallelPlugin, model: torch.nn.Module) -> None:
    """Check that the accelerate config's wrap policy matches modules of `model`; resolve default classes."""
    policy = plugin.auto_wrap_policy
    if policy is transformer_auto_wrap_policy:
        plugin.transformer_cls_names_to_wrap = wrap_classes(plugin.transformer_cls_names_to_wrap or [], model)
    elif policy is size_based_auto_wrap_policy:
        _validate_size_policy(plugin, model)


def wrap_classes(requested: list[str] | tuple[str, ...], model: torch.nn.Module) -> list[str]:
    """The layer classes to wrap: `requested`, or the model's `_no_split_modules`; each must occur in `model`."""
    names = [name.strip() for name in requested if name.strip()] or list(
        getattr(model, "_no_split_modules", None) or []
    )
    if not names:
        raise FinetuneError(
            f"{type(model).__name__} declares no _no_split_modules, so the wrap class cannot be inferred; set "
            f"fsdp_transformer_layer_cls_to_wrap in the accelerate config to one of: {_candidates(model)}"
        )
    present = {type(m).__name__ for m in model.modules()}
    missing = [name for name in names if name not in present]
    if missing:
        raise FinetuneError(
            f"fsdp_transformer_layer_cls_to_wrap names {', '.join(missing)}, which {type(model).__name__} does "
            f"not contain; use one of: {_candidates(model)}"
        )
    return names


def _validate_size_policy(plugin: FullyShardedDataParallelPlugin, model: torch.nn.Module) -> None:
    threshold = plugin.min_num_params
    sizes = [(name, module, _numel(module)) for name, module in model.named_modules() if module is not model]
    largest_name, _, largest = max(sizes, key=lambda item: item[2])
    # FSDP1 wraps a module holding >= threshold parameters not yet wrapped below it; accelerate's
    # FSDP2 policy wraps every module whose whole subtree holds > threshold.
    fsdp2 = plugin.fsdp_version == 2
    selected = [(name, m, n) for name, m, n in sizes if (n > threshold if fsdp2 else n >= threshold)]
    if threshold <= 0 or not selected:
        raise FinetuneError(
            f"fsdp_min_num_params={threshold} wraps no module of {type(model).__name__} (the largest below the "
            f"root, {largest_name}, has {largest:,} parameters); set fsdp_min_num_params between 1 and "
            f"{largest - 1:,}, or use fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP"
        )
    containers = [(name, n) for name, m, n in selected if isinstance(m, torch.nn.ModuleList | torch.nn.ModuleDict)]
    if fsdp2 and containers:
        name, numel = containers[0]
        raise FinetuneError(
            f"under FSDP2, fsdp_min_num_params={threshold} selects {name} ({numel:,} parameters), a "
            f"{type(model.get_submodule(name)).__name__} that fully_shard cannot wrap; use fsdp_auto_wrap_policy: "
            "TRANSFORMER_BASED_WRAP, or fsdp_version: 1 for size-based wrapping"
        )


def _candidates(model: torch.nn.Module) -> str:
    """Module classes of `model` that could be wrap units: `_no_split_modules` first, then the rest."""
    preferred = list(getattr(model, "_no_split_modules", None) or [])
    others = []
    for module in model.modules():
        name = type(module).__name__
        if module is not model and name not in preferred and name not in others and _numel(module) > 0:
            others.append(name)
    return ", ".join(preferred + others)


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def fsdp_units(model: torch.nn.Module) -> list[Unit]:
    """The FSDP units of a prepared model with global and local (this rank's) parameter counts."""
    if isinstance(model, FullyShardedDataParallel):
        units = []
        for module in FullyShardedDataParallel.fsdp_modules(model):
            flat = module._flat_param  # FSDP1 exposes no public handle on the sharded flat parameter
            if flat is not None:
                units.append(Unit(type(module.module).__name__, flat._unpadded_unsharded_size.numel(), flat.numel()))
        return units
    units, seen = [], set()
    for owner in (m for m in model.modules() if isinstance(m, FSDPModule)):
        # Tied weights appear under two modules; count each parameter once, in the first unit.
        own = [p for p in _managed_params(owner) if id(p) not in seen]
        seen.update(id(p) for p in own)
        units.append(
            Unit(
                _base_class_name(owner), sum(p.numel() for p in own), sum(local_tensor(p).numel() for p in own),
                sum(p.numel() for p in own if p.requires_grad),
            )
        )  # fmt: skip
    return units


def reshard(model: torch.nn.Module) -> None:
    """Free what a forward without a backward (evaluation) leaves gathered.

    accelerate shards the final norm and output head (with tied embeddings) as one FSDP2 unit with
    reshard_after_forward=False, which training's backward reshards; after an evaluation the unit
    would stay whole on every rank, through checkpoint saves, until the next step. Local, no
    communication; FSDP1 and DDP models have nothing to free.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _managed_params(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters of `module`'s subtree that no nested FSDP unit claims."""
    params = list(module.parameters(recurse=False))
    for child in module.children():
        if not isinstance(child, FSDPModule):
            params += _managed_params(child)
    return params


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` this rank holds: the local shard of a DTensor, else the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _base_class_name(module: torch.nn.Module) -> str:
    """`fully_shard` swaps a module's class for a generated `FSDP<Class>`; name the original class."""
    return next(base.__name__ for base in type(module).__bases__ if base is not FSDPModule)


def format_wrap_plan(units: list[Unit]) -> str:
    """A table of the units by class: how many, and parameters per unit."""
    by_class: dict[str, list[Unit]] = {}
    for unit in units:
        by_class.setdefault(unit.class_name, []).append(unit)
    total, trainable = sum(u.numel_global for u in units), sum(u.numel_trainable for u in units)
    # With adapters (some parameters frozen), each unit says how many of its parameters train.
    partial = 0 <= trainable < total
    lines = [
        f"FSDP wrap plan: {len(units)} units, {total:,} parameters"
        + (f" ({trainable:,} trainable, {total - trainable:,} frozen)" if partial else "")
    ]
    for name, members in by_class.items():
        line = f"  {name:<28} x{len(members):<4} {_range([u.numel_global for u in members])} params each"
        if partial:
            line += f", {_range([u.numel_trainable for u in members])} trainable"
        lines.append(line)
    return "\n".join(lines)


def _range(sizes: list[int]) -> str:
    return f"{sizes[0]:,}" if len(set(sizes)) == 1 else f"{min(sizes):,}-{max(sizes):,}"


def shard_frozen(
    model: torch.nn.Module,
    like: FullyShardedDataParallelPlugin | None,
    device: torch.device,
    mesh: DeviceMesh | None = None,
) -> None:
    """Shard a frozen model that only runs forwards (a preference run's reference) as training shards the
    policy: one FSDP2 unit per wrapped layer class, then the root, with the run's mixed-precision policy and
    resharding after every forward. accelerate prepares only models that train (with an optimizer) under
    FSDP2, and sharding the reference at the root alone would gather it whole for every forward. Without FSDP
    (DDP, one process) the model is simply moved to the device. `mesh`: the policy's FSDP mesh (hybrid
    sharding: replicas x shard groups), so the reference shards within the same groups; None for the world."""
    model.to(device)
    if like is None or like.fsdp_version != 2:
        return
    from torch.distributed.fsdp import fully_shard

    classes = set(wrap_classes(like.transformer_cls_names_to_wrap or [], model))
    policy = like.mixed_precision_policy
    options = {"mp_policy": policy} if policy is not None and not isinstance(policy, dict) else {}
    if mesh is not None:
        options["mesh"] = mesh
    for module in model.modules():
        if type(module).__name__ in classes:
            fully_shard(module, reshard_after_forward=True, **options)
    fully_shard(model, reshard_after_forward=True, **options)
