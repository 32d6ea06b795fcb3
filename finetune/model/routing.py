"""The routers of a mixture of experts: routing in fp32, and the load-balancing loss that keeps experts in use.

Routing in fp32. Under bf16 mixed precision a router would compute its logits, their softmax and the top-k
weights in bf16, whose 8 bits of mantissa flip near-tied choices between experts from one step to the next.
Each router here runs with autocast off on fp32 copies of its input and of its (gathered) parameters, as
Megatron-LM's fp32 router does: its logits and routing weights are fp32 whatever the compute dtype, and its
gradients flow back through the casts to the parameters FSDP gathered.

The balancing loss. The models add `router_aux_loss_coef * aux_loss` to their own loss only when they compute
it from `labels`; finetune computes its loss from the hidden states, so it adds the term itself: the routers'
logits are recorded during each training forward (never during evaluation or a reference's forward: no
gradients there), and the model family's own `load_balancing_loss_func` turns them into the term over the
micro-batch's real tokens (padding excluded, packed rows included). Convention: a micro-batch's term is
weighted by the units the objective averages over (target tokens, or pairs), like its loss, so a step
minimizes mean loss + coef * (the unit-weighted mean of its micro-batches' balancing terms), the same for
any number of processes given the same micro-batches. At perfect balance the term equals top_k.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.func import functional_call

from finetune.engine.batch import Batch
from finetune.engine.sequence import sum_over_group
from finetune.errors import FinetuneError
from finetune.model.family import experts_of, is_routed_expert


def router_class(model: torch.nn.Module) -> tuple[type, int] | None:
    """The module class whose output holds a layer's router logits, and that output's index, as the model
    declares them to transformers' output recording; None for a model without routers."""
    for module in model.modules():
        recorder = (getattr(module, "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None and getattr(recorder, "target_class", None) is not None:
            return recorder.target_class, recorder.index
    return None


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    found = router_class(model)
    return [] if found is None else [m for m in model.modules() if isinstance(m, found[0])]


def route_in_fp32(model: torch.nn.Module) -> int:
    """Make every router of `model` compute in fp32 (see the module's docstring); returns how many."""
    found = routers(model)
    for router in found:
        router.forward = functools.partial(_fp32_forward, _Holder(router))
    return len(found)


class _Holder(torch.nn.Module):
    """A router under a name, so that functional_call can swap its parameters for one call of its own forward."""

    def __init__(self, router: torch.nn.Module):
        super().__init__()
        self.router, self.own_forward = router, type(router).forward

    def forward(self, *args, **kwargs):
        return self.own_forward(self.router, *args, **kwargs)


def _fp32_forward(holder: _Holder, hidden_states: torch.Tensor, *args, **kwargs):
    parameters = {f"router.{name}": p.float() for name, p in holder.router.named_parameters()}
    with torch.autocast(hidden_states.device.type, enabled=False):
        return functional_call(holder, parameters, (hidden_states.float(), *args), kwargs, strict=False)


def set_up_routing(
    model: torch.nn.Module,
    requested_coefficient: float | None,
    compute_dtype: torch.dtype,
    sequence_group: dist.ProcessGroup | None = None,
) -> tuple[BalancingLoss | None, str | None]:
    """Route `model`'s experts in fp32 and record its routers for the balancing loss (None: off), with the log line;
    nothing for a dense model. Call on the model as prepared (the routers are found through any wrapper). Under
    sequence parallelism `sequence_group` holds the other slices of the rows."""
    coefficient = balancing_coefficient(model.config, requested_coefficient)  # refuses one a model cannot take
    experts = experts_of(model.config)
    if experts is None:
        return None, None
    implementation = getattr(model.config.get_text_config(), "_experts_implementation", None) or "eager"
    if implementation == "grouped_mm":
        check_grouped_mm_shapes(model, compute_dtype)
    route_in_fp32(model)
    balancing = BalancingLoss(model, coefficient, sequence_group) if coefficient > 0 else None
    source = "train.router_aux_loss_coef" if requested_coefficient is not None else "the model's coefficient"
    term = f"balancing loss x{coefficient:g} ({source})" if balancing else "no balancing loss"
    return balancing, (
        f"experts: {experts.active} of {experts.total} per token ({implementation}); routers in fp32; {term}"
    )


def check_grouped_mm_shapes(model: torch.nn.Module, compute_dtype: torch.dtype) -> None:
    """torch's grouped matmul needs every dimension of an expert's weights to span a multiple of 16 bytes in the
    compute dtype; refuse other shapes before the first step fails deep inside it."""
    size = torch.empty(0, dtype=compute_dtype).element_size()
    for name, parameter in model.named_parameters():
        if is_routed_expert(name) and parameter.dim() == 3:
            odd = [n for n in parameter.shape[1:] if n * size % 16]
            if odd:
                raise FinetuneError(
                    f"{name} has experts of shape {tuple(parameter.shape[1:])}, and grouped_mm needs each dimension "
                    f"to be a multiple of {16 // size} elements in {str(compute_dtype).removeprefix('torch.')} "
                    f"({odd[0]} is not); set model.experts_implementation=batched_mm"
                )


def check_experts_recipe(
    config, quantization: str | None, requested_coefficient: float | None, adapts_experts: str | None = None
) -> None:
    """What a recipe asks of a model's experts, checked from its config before anything loads: a balancing loss
    only where the model has one; adapters on experts (`adapts_experts`: the peft key that asks for them,
    target_experts or target_parameters) only where there are experts; no 4-bit base for a mixture of experts,
    whose experts bitsandbytes would leave unquantized (it quantizes linear layers; transformers holds the
    experts as fused 3-D tensors)."""
    balancing_coefficient(config, requested_coefficient)
    experts = experts_of(config)
    if adapts_experts is not None and experts is None:
        # target_parameters would adapt a dense model's 2-D weights too, but nothing past training knows them:
        # the merge folds parameter adapters into fused expert weights only.
        raise FinetuneError(
            f"{adapts_experts} adapts the fused expert weights of a mixture of experts, and this {config.model_type} "
            f"model is dense; remove {adapts_experts} (target_modules: [all-linear] covers its MLPs)"
        )
    if experts is not None and quantization is not None:
        raise FinetuneError(
            f"peft.quantization={quantization} quantizes linear layers only, and this {config.model_type} model "
            f"holds its {experts.total} experts per layer as fused 3-D tensors, most of its weights, which would stay "
            "in the base's dtype; remove peft.quantization (LoRA on a bf16 base) or train a dense model"
        )


def balancing_coefficient(config, requested: float | None) -> float:
    """`train.router_aux_loss_coef` for this model: the requested value, else the model's own (0 for a dense model
    or one that routes without a balancing loss); a positive value for a model that has no such loss is refused."""
    own = getattr(config.get_text_config(), "router_aux_loss_coef", None)
    has_loss = experts_of(config) is not None and own is not None
    if requested is None:
        return float(own) if has_loss else 0.0
    if requested > 0 and not has_loss:
        kind = "is dense" if experts_of(config) is None else "routes without a balancing loss"
        raise FinetuneError(
            f"train.router_aux_loss_coef={requested}, but the {config.model_type} model {kind}; remove "
            "train.router_aux_loss_coef"
        )
    return requested


@dataclass
class BalancingLoss:
    """Records router logits during training forwards and computes the balancing term of each."""

    model: torch.nn.Module
    coefficient: float
    sequence_group: dist.ProcessGroup | None = None
    """Under sequence parallelism, the processes holding the other slices of the rows: the term is the rows'."""
    load: torch.Tensor | None = None
    """Tokens routed to each expert of each MoE layer (layers x experts) since the last `load_metrics`."""
    _logits: list[torch.Tensor] = field(default_factory=list)
    _recording: bool = False

    def __post_init__(self):
        found = router_class(self.model)
        if found is None:
            raise FinetuneError(
                "the model has no routers whose logits transformers records; set train.router_aux_loss_coef=0"
            )
        self.index = found[1]
        experts = experts_of(self.model.config)
        self.num_experts, self.top_k = experts.total, experts.active
        # The family's own function, from the module that defines its routers.
        self.loss_function = getattr(sys.modules[found[0].__module__], "load_balancing_loss_func", None)
        if self.loss_function is None:
            raise FinetuneError(
                f"transformers defines no balancing loss for {found[0].__name__} routers; set "
                "train.router_aux_loss_coef=0"
            )
        for router in routers(self.model):
            router.register_forward_hook(self._record)

    def _record(self, module: torch.nn.Module, inputs: tuple, output) -> None:
        if self._recording and torch.is_grad_enabled():  # not a reference's or an evaluation's forward
            self._logits.append(output[self.index] if isinstance(output, tuple) else output)

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        self._logits.clear()
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def take(self, batch: Batch) -> torch.Tensor:
        """The balancing term of the forward just recorded, over the batch's real tokens; the logits are released.
        Each layer's tokens per expert are added to `load` (on the device: no sync)."""
        logits, self._logits = tuple(self._logits), []
        mask = real_tokens(batch)
        with torch.no_grad():
            weights = mask.reshape(-1, 1).to(logits[0].device, torch.float32).expand(-1, self.top_k).reshape(-1)
            chosen = [layer.topk(self.top_k, dim=-1).indices.reshape(-1) for layer in logits]
            counts = torch.zeros(len(logits), self.num_experts, device=logits[0].device)
            for layer, experts in enumerate(chosen):
                counts[layer].scatter_add_(0, experts, weights)
            self.load = counts if self.load is None or self.load.shape != counts.shape else self.load + counts
        if self.sequence_group is not None:
            return balancing_over_group(logits, self.num_experts, self.top_k, mask, self.sequence_group)
        return self.loss_function(logits, self.num_experts, self.top_k, mask)

    def load_metrics(self, reduce) -> dict[str, float]:
        """Each MoE layer's expert load since the last call: the busiest expert's tokens over the mean expert's,
        over all processes (`reduce`: a sum across them); 1 is perfect balance, num_experts / top_k the worst."""
        if self.load is None:
            return {}
        load, self.load = reduce(self.load), None
        ratios = (load.max(dim=1).values / load.mean(dim=1).clamp(min=1e-9)).tolist()
        return {f"expert_load/{layer}": ratio for layer, ratio in enumerate(ratios)}


def balancing_over_group(
    logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int, mask: torch.Tensor, group: dist.ProcessGroup
) -> torch.Tensor:
    """The balancing term of rows split over a sequence group, from this process's slice of them: the families'
    `load_balancing_loss_func` (one function, the same in every MoE model transformers ships) is num_experts x the
    dot product of each expert's share of top-k choices and its mean routing probability, both sums over every
    layer's real tokens divided by their count. Those sums are added up over the group (the probabilities'
    differentiably), so that every process gets the term of the whole rows, each token counted once."""
    device = logits[0].device
    flat_mask = mask.reshape(-1).to(device, torch.float32)
    choices = torch.zeros(num_experts, device=device)
    probabilities = torch.zeros(num_experts, device=device)
    for layer in logits:
        weights = torch.softmax(layer.float(), dim=-1)
        selected = weights.topk(top_k, dim=-1).indices.reshape(-1)
        choices = choices.scatter_add(0, selected, flat_mask.repeat_interleave(top_k))
        probabilities = probabilities + (weights * flat_mask.unsqueeze(-1)).sum(dim=0)
    counts = torch.cat([choices, (flat_mask.sum() * len(logits)).reshape(1)])
    dist.all_reduce(counts, group=group)
    probabilities = sum_over_group(probabilities, group)
    rows = counts[-1]
    return num_experts * torch.sum((counts[:-1] / rows) * (probabilities / rows))


def real_tokens(batch: Batch) -> torch.Tensor:
    """1 at each real token of a batch, 0 at padding: its attention mask, or for packed rows (no mask) the first
    `row_tokens` positions of each row."""
    if "attention_mask" in batch:
        return batch["attention_mask"]
    rows, length = batch["input_ids"].shape
    positions = torch.arange(length, device=batch["input_ids"].device).expand(rows, length)
    return (positions < batch["row_tokens"].to(positions.device).unsqueeze(1)).long()
