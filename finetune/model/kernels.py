"""`model.kernels: liger`: a decoder's elementwise work in fused GPU kernels.

In an eager step on a GPU about a quarter of the time goes to elementwise multiplies and dtype copies (the H200
profile of 2026-11-28: `aten::mul` 13.5%, `aten::copy_` 11.3%): RMSNorm's fp32 round trip, SwiGLU's
silu(gate) * up, the rotary embedding's rotate-and-add, each several passes over the activations. liger-kernel
(the `gpu` extra) has each as one Triton kernel with its own backward, and patches a loaded model's modules in
place: the norms' and MLPs' forwards are rebound on the instances (their parameters and names unchanged, so
checkpoints, adapters and exports are untouched) and the family's rotary function replaced in its modelling
module. Its cross-entropy kernels are not used: finetune computes its loss itself (`finetune.objectives.loss`).

Regional compilation (`--dynamo_use_regional_compilation`) fuses the same work with inductor's kernels on any
device; which is faster is the GPU check's measurement (bench/gpu.py's liger and compile variants). Triton has
no CPU backend, so the setting is refused without a CUDA device rather than ignored.
"""

from __future__ import annotations

import inspect

import torch
from transformers import PretrainedConfig, PreTrainedModel

from finetune.errors import FinetuneError
from finetune.model.family import experts_of

LIGER = "liger"
# Every kernel but the loss's: finetune's chunked loss never hands logits to the model's loss function.
_LIGER_SETTINGS = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                   "fused_linear_cross_entropy": False}  # fmt: skip


def check_kernels(kernels: str | None, config: PretrainedConfig, name: str) -> None:
    """Before anything loads: `model.kernels` can run here, for this model (`name`, whose config is `config`)."""
    if kernels is None:
        return
    if not torch.cuda.is_available():
        raise FinetuneError(
            f"model.kernels={kernels}: liger-kernel's kernels are Triton GPU kernels and this machine has no CUDA "
            "device; unset model.kernels (regional compilation, --dynamo_use_regional_compilation, fuses the same "
            "work on any device)"
        )
    if experts_of(config) is not None:
        # finetune wraps a mixture's routers (fp32 routing, its balancing loss: finetune.model.routing), and liger's
        # expert kernels replace the blocks around them: the two together are not proven here.
        raise FinetuneError(
            f"model.kernels={kernels}: {name!r} is a mixture of experts, whose routing finetune runs itself; liger's "
            "kernels are used for dense models only: unset model.kernels"
        )
    supported = _liger_model_types()
    model_type = config.model_type
    if model_type not in supported:
        raise FinetuneError(
            f"model.kernels={kernels}: liger-kernel has no kernels for {name!r} (model type {model_type}); unset "
            f"model.kernels. It has them for {', '.join(sorted(supported))}"
        )


def fuse(model: PreTrainedModel, kernels: str | None) -> str | None:
    """`model.kernels` applied to a loaded model; the log line that says so, or None. Apply before adapters wrap
    its linear layers (liger's MLP forward calls them by name, LoRA's or not)."""
    if kernels is None:
        return None
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    apply = MODEL_TYPE_TO_APPLY_LIGER_FN[model.config.model_type]
    accepted = inspect.signature(apply).parameters  # a family's settings: gemma's MLP is GeGLU, not SwiGLU
    apply(model=model, **{key: value for key, value in _LIGER_SETTINGS.items() if key in accepted})
    return f"kernels: RMSNorm, SwiGLU and rotary embeddings in liger-kernel's fused kernels (model.kernels={kernels})"


def _liger_model_types() -> set[str]:
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as exc:
        raise FinetuneError(
            f"model.kernels={LIGER} needs liger-kernel ({exc}): pip install 'finetune[gpu]' (`make setup` installs "
            "it on a machine with a CUDA GPU)"
        ) from None
    return set(MODEL_TYPE_TO_APPLY_LIGER_FN)
