"""Export a trained model as a Hugging Face folder with consolidated safetensors weights."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import PreTrainedTokenizerBase


def gather_full_state_dict(accelerator: Accelerator, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on the main process (empty elsewhere under FSDP); collective.

    Under FSDP this uses torch.distributed.checkpoint's `get_model_state_dict`, which serves FSDP1
    and FSDP2 alike, gathering onto the main process's CPU memory. One exception: FSDP1's
    offload-to-CPU gather segfaults when the parameters already live on the CPU (it frees the
    unsharded buffer that the "offloaded" tensors still alias), so FSDP1 CPU runs gather without
    offload, giving every rank a full copy.
    """
    if accelerator.distributed_type != DistributedType.FSDP:
        return accelerator.get_state_dict(model)
    fsdp1_on_cpu = accelerator.state.fsdp_plugin.fsdp_version == 1 and accelerator.device.type == "cpu"
    options = StateDictOptions(full_state_dict=True, cpu_offload=not fsdp1_on_cpu)
    return get_model_state_dict(model, options=options)


def _with_tied_aliases(model: torch.nn.Module, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Make every name of a parameter shared by several modules (tied embeddings) refer to one tensor.

    A gathered state dict holds a shared parameter under one of its names, or under each name as
    separate copies. save_pretrained recognises ties by shared storage, and only then stores the
    weight once under the name from_pretrained expects (the input embedding) instead of lm_head.
    """
    names_by_param: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        clean = name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")
        names_by_param.setdefault(id(param), []).append(clean)
    complete = dict(state_dict)
    for names in names_by_param.values():
        present = next((name for name in names if name in state_dict), None)
        if present is not None and len(names) > 1:
            for name in names:
                complete[name] = state_dict[present]
    return complete


def export_model(
    accelerator: Accelerator,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: Path,
    dtype: torch.dtype,
    max_shard_size: str = "5GB",
) -> None:
    """Gather the full state dict and write config, generation config, tokenizer and weights to `out_dir`.

    Must be called on every process (gathering is collective). The folder is written under a
    temporary name and renamed when complete, so `out_dir` never holds a half-written model.
    """
    state_dict = gather_full_state_dict(accelerator, model)
    if accelerator.is_main_process:
        partial = out_dir.with_name(out_dir.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        unwrapped = accelerator.unwrap_model(model)
        # Convert first: converting after aliasing would turn the shared tensor back into separate copies.
        state_dict = _with_tied_aliases(unwrapped, {name: tensor.to(dtype) for name, tensor in state_dict.items()})
        # save_pretrained drops tied duplicates (lm_head of a tied model) the way from_pretrained expects.
        unwrapped.save_pretrained(partial, state_dict=state_dict, max_shard_size=max_shard_size)
        # save_pretrained records the live model's dtype; config.json must state the dtype of these weights.
        config = copy.deepcopy(unwrapped.config)
        config.dtype = dtype
        config.save_pretrained(partial)
        tokenizer.save_pretrained(partial)
        previous = out_dir.with_name(out_dir.name + ".previous")
        if out_dir.exists():
            out_dir.rename(previous)
        partial.rename(out_dir)
        shutil.rmtree(previous, ignore_errors=True)
    accelerator.wait_for_everyone()
