"""What each rank really holds: bytes and dtypes measured on the local tensors, not estimated.

Taken during the first optimizer step: parameter bytes held between forward and backward (where
FSDP full shard and shard-grad-op differ), then parameters, gradients and optimizer state right
after the update, before gradients are freed. Local means the DTensor shard under FSDP2, the
flat-parameter shard under FSDP1, the whole tensor under DDP or a single process.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.distributed.fsdp import FullyShardedDataParallel

from finetune.engine.wrap import fsdp_units, local_tensor

FIELDS = (
    "parameters",
    "gradients",
    "optimizer_state",
    "parameters_after_forward",
    "activations",
    "step_peak",
    "unsharded_parameters",
    "trainable_parameters",
)


@dataclass
class MemoryReport:
    """Bytes held by one rank, and the dtypes in force."""

    parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    parameters_after_forward: int = 0
    """Parameter bytes held when the forward pass has finished (before backward)."""
    activations: int = 0
    """Bytes autograd saved for backward in one micro-batch's forward (parameters excluded). Under
    activation checkpointing this sees only what is saved outside the checkpointed layers."""
    step_peak: int = 0
    """Peak memory growth during step 1 over the memory in use before it: on GPUs the allocator's
    peak; on CPU the resident-set high-water mark (reset through /proc/self/clear_refs)."""
    unsharded_parameters: int = 0
    """Bytes of all the model's parameters, unsharded: what one rank holds without sharding."""
    trainable_parameters: int = 0
    """Of `parameters`, the bytes of those that train (with adapters, the adapters'; else all)."""
    dtypes: dict[str, str] = field(default_factory=dict)


class MemoryProbe:
    """Measures one training step: attach before the step's forward, `measure_update` after its update."""

    def __init__(self, model: torch.nn.Module, accelerator: Accelerator):
        self.model, self.accelerator = model, accelerator
        self.report = MemoryReport()
        self.before = _reset_peak(accelerator.device)
        self.handles = [model.register_forward_hook(self._after_forward, always_call=True)]
        first_linear = next((m for m in model.modules() if isinstance(m, torch.nn.Linear)), None)
        if first_linear is not None:
            self.handles.append(first_linear.register_forward_hook(self._record_compute_dtype))

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        held = sum(_local_bytes(p) for p in self.model.parameters())
        self.report.parameters_after_forward = max(self.report.parameters_after_forward, held)

    def _record_compute_dtype(self, module: torch.nn.Module, args: Any, output: torch.Tensor) -> None:
        self.report.dtypes["compute"] = dtype_name(output.dtype)

    def counting_activations(self) -> torch.autograd.graph.saved_tensors_hooks:
        """Context around one micro-batch's forward: sum the distinct storages saved for backward."""
        seen: set[int] = set()
        total = 0

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal total
            is_param = isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)
            storage = tensor.untyped_storage()
            if not is_param and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
                self.report.activations = max(self.report.activations, total)
            return tensor

        return torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)

    def measure_update(self, optimizer: torch.optim.Optimizer) -> None:
        """Call after `optimizer.step()` and before gradients are zeroed."""
        for handle in self.handles:
            handle.remove()
        params = list(self.model.parameters())
        report = self.report
        report.parameters = sum(_local_bytes(p) for p in params)
        report.trainable_parameters = sum(_local_bytes(p) for p in params if p.requires_grad)
        report.gradients = sum(_local_bytes(p.grad) for p in params if p.grad is not None)
        states = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
        report.optimizer_state = sum(_local_bytes(t) for t in states)
        report.unsharded_parameters = _unsharded_bytes(self.model, params)
        report.step_peak = max(0, _peak(self.accelerator.device) - self.before)
        report.dtypes.update(
            parameters=dtype_name(local_tensor(params[0]).dtype),
            gradients=dtype_name(next(local_tensor(p.grad).dtype for p in params if p.grad is not None)),
            optimizer_state=dtype_name(next(t.dtype for t in states if t.dim() > 0)),
            gradient_reduction=dtype_name(_reduce_dtype(self.accelerator, params[0])),
        )


def gather_reports(accelerator: Accelerator, report: MemoryReport) -> list[MemoryReport]:
    """Every rank's report, on every rank (collective)."""
    local = torch.tensor([getattr(report, name) for name in FIELDS], dtype=torch.int64, device=accelerator.device)
    rows = accelerator.gather(local).view(accelerator.num_processes, len(FIELDS)).tolist()
    return [MemoryReport(**dict(zip(FIELDS, row, strict=True)), dtypes=report.dtypes) for row in rows]


def memory_metrics(reports: list[MemoryReport]) -> dict[str, int | str]:
    """Flat scalar metrics (trackers take no nesting): memory/rank<i>/<field> bytes and dtype/<role>."""
    metrics: dict[str, int | str] = {}
    for rank, report in enumerate(reports):
        metrics.update({f"memory/rank{rank}/{name}": getattr(report, name) for name in FIELDS})
    metrics.update({f"dtype/{role}": dtype for role, dtype in reports[0].dtypes.items()})
    return metrics


def format_reports(reports: list[MemoryReport]) -> str:
    """A table of MiB per rank, with each column's ratio to the unsharded parameter bytes."""
    mib = 2**20
    unsharded = reports[0].unsharded_parameters / mib
    # With adapters the parameters split into trainable and frozen: gradients and optimizer state exist for the first.
    partial = any(r.trainable_parameters < r.parameters for r in reports)
    trainable_header = f" {'trainable':>10} {'frozen':>10}" if partial else ""
    lines = [
        f"memory per rank in step 1, measured on the local tensors (MiB; all parameters unsharded: {unsharded:.1f})",
        f"{'rank':>4} {'params':>10}{trainable_header} {'grads':>10} {'optimizer':>10} {'params@fwd':>11}",
    ]
    for rank, r in enumerate(reports):
        split = f" {r.trainable_parameters / mib:>10.1f} {(r.parameters - r.trainable_parameters) / mib:>10.1f}"
        lines.append(
            f"{rank:>4} {r.parameters / mib:>10.1f}{split if partial else ''} {r.gradients / mib:>10.1f} "
            f"{r.optimizer_state / mib:>10.1f} {r.parameters_after_forward / mib:>11.1f}"
        )
    dtypes = reports[0].dtypes
    lines.append(
        f"dtypes: parameters {dtypes.get('parameters')}, gradients {dtypes.get('gradients')}, optimizer state "
        f"{dtypes.get('optimizer_state')}, compute {dtypes.get('compute')}, gradient reduction "
        f"{dtypes.get('gradient_reduction')}"
    )
    return "\n".join(lines)


def _reset_peak(device: torch.device) -> int:
    """Start measuring peak memory now; returns the memory in use now."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    with contextlib.suppress(OSError):  # without /proc the peak is the process's peak so far
        Path("/proc/self/clear_refs").write_text("5")  # Linux: reset the resident-set high-water mark
    return _proc_status("VmRSS")


def _peak(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _proc_status("VmHWM")


def _proc_status(field: str) -> int:
    """A memory figure of /proc/self/status in bytes (0 where there is no /proc)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _local_bytes(tensor: torch.Tensor) -> int:
    local = local_tensor(tensor)
    return local.numel() * local.element_size()


def _unsharded_bytes(model: torch.nn.Module, params: list[torch.Tensor]) -> int:
    """Full-model parameter bytes; FSDP1's sharded parameters are views that lost their full size,
    so there the wrap plan's global counts are used."""
    element_size = local_tensor(params[0]).element_size()
    if isinstance(model, FullyShardedDataParallel):
        return sum(unit.numel_global for unit in fsdp_units(model)) * element_size
    return sum(p.numel() for p in params) * element_size  # DTensor.numel() is the global count


def _reduce_dtype(accelerator: Accelerator, param: torch.Tensor) -> torch.dtype:
    """The dtype gradients are all-reduced / reduce-scattered in: the FSDP mixed-precision policy's
    reduce dtype, else the parameters' (DDP reduces the gradients as they are)."""
    if accelerator.distributed_type == DistributedType.FSDP:
        policy = accelerator.state.fsdp_plugin.mixed_precision_policy
        reduce_dtype = getattr(policy, "reduce_dtype", None)
        if reduce_dtype is not None:
            return reduce_dtype
    return local_tensor(param).dtype


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> `bfloat16`."""
    return str(dtype).removeprefix("torch.")
