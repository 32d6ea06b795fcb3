"""Parameter-efficient fine-tuning: LoRA and DoRA adapters from PEFT on a frozen base model.

The adapters are added before the model is sharded, so under FSDP2 each adapter lives in its
decoder layer's unit and is sharded with it (accelerate's per-layer wrap; PEFT's own FSDP wrap
policy is not used). Checkpoints hold what trains and nothing else: the adapter weights and their
optimizer state (torch.distributed.checkpoint, resharded on load like any sharded checkpoint), and
accelerate's RNG and sampler states; never the frozen base, which for a 70B model is 140 GB per save.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from accelerate import Accelerator
from accelerate.checkpointing import load_accelerator_state, save_accelerator_state
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from transformers import PreTrainedModel

from finetune.config import PeftConfig, RecipeConfig
from finetune.engine.accelerator import compute_dtype
from finetune.engine.launch import ASYNC_SAVE_NEEDS
from finetune.errors import FinetuneError, first_line
from finetune.model.family import experts_of, is_routed_expert
from finetune.model.loading import DTYPES, base_fingerprint, check_quantized_base, model_folder
from finetune.model.score_head import task_type
from finetune.storage.checkpoint import (
    ADAPTER_RECORD,
    ADAPTER_STATE,
    MODEL_FILES,
    check_resume_base,
    check_resume_kind,
)

ADAPTER_CONFIG = "adapter_config.json"
_TRAINABLE_ONLY = StateDictOptions(ignore_frozen_params=True)
# Setting only the trainable tensors leaves the frozen ones "missing"; DCP's load already refused any
# trainable tensor the checkpoint lacks, so nothing is skipped silently.
_SET_TRAINABLE = StateDictOptions(ignore_frozen_params=True, strict=False)


def add_adapters(model: PreTrainedModel, cfg: PeftConfig) -> PeftModel:
    """Freeze `model` and add the recipe's adapters; adapter weights are kept in fp32 whatever the base's dtype."""
    check_adapter_targets(model, cfg)
    targets = cfg.target_modules[0] if cfg.target_modules == ["all-linear"] else cfg.target_modules
    if targets == "all-linear" and experts_of(model.config) is not None:
        targets = linear_layers_outside_experts(model)
    lora = LoraConfig(
        r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=targets, use_dora=cfg.method == "dora",
        use_rslora=cfg.use_rslora, modules_to_save=cfg.modules_to_save or None, task_type=task_type(model.config),
        target_parameters=expert_parameters(model, cfg) or None,
    )  # fmt: skip
    try:
        adapted = get_peft_model(model, lora, autocast_adapter_dtype=True)
    except ValueError as exc:
        modules = model.named_modules()
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in modules if isinstance(m, torch.nn.Linear)})
        raise FinetuneError(
            f"peft.target_modules={cfg.target_modules} cannot be applied ({first_line(exc)}); the model's linear "
            f"modules are: {', '.join(linear)} (or use [all-linear])"
        ) from None
    _check_mergeable(adapted)
    if getattr(model, "is_activation_checkpointing", False):
        # With the embeddings frozen, checkpointed layers would get inputs that do not require grad.
        adapted.enable_input_require_grads()
    return adapted


def linear_layers_outside_experts(model: PreTrainedModel) -> list[str]:
    """`all-linear` for a mixture of experts: every linear layer but the output head, the routers and the routed
    experts, by full name. PEFT's own all-linear adds the fused experts and routers of some families (as
    `target_parameters`), which would change routing and the experts without the recipe asking."""
    from finetune.model.routing import routers

    head = model.get_output_embeddings()
    excluded = {id(module) for router in routers(model) for module in router.modules()} | {id(head)}
    return [
        name for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and id(module) not in excluded and not is_routed_expert(name)
    ]  # fmt: skip


def expert_parameters(model: PreTrainedModel, cfg: PeftConfig) -> list[str]:
    """The parameters adapted as parameters (PEFT's target_parameters), by full name: `peft.target_parameters`
    as named, and with `peft.target_experts` every fused routed-expert weight (3-D: experts x out x in)."""
    names = list(cfg.target_parameters)
    if cfg.target_experts:
        names += [
            name for name, p in model.named_parameters()
            if p.ndim == 3 and is_routed_expert(name) and name not in names
        ]  # fmt: skip
    return names


def check_adapter_targets(model: PreTrainedModel, cfg: PeftConfig) -> None:
    """Every module the recipe names exists (PEFT skips a `modules_to_save` name that matches nothing, so a
    typo would train nothing in full), and no adapter touches a tied embedding: the trained model would use
    the adapted matrix on one side only, which no merged export can reproduce."""
    parameters = [name for name, _ in model.named_parameters()]
    unknown = [n for n in cfg.target_parameters if not any(p == n or p.endswith(f".{n}") for p in parameters)]
    if unknown:
        fused = sorted({p.split(".", 3)[-1] for p, t in model.named_parameters() if t.ndim == 3}) or ["none"]
        raise FinetuneError(
            f"peft.target_parameters names {', '.join(unknown)}, which {type(model).__name__} does not have; its "
            f"3-D (fused expert) parameters are: {', '.join(fused[:6])}"
        )
    names = [name for name, _ in model.named_modules() if name]
    for key in ("modules_to_save", "target_modules"):
        wanted = [n for n in getattr(cfg, key) if n != "all-linear"]
        unknown = [n for n in wanted if not any(name == n or name.endswith(f".{n}") for name in names)]
        if unknown:
            leaves = sorted({name.rsplit(".", 1)[-1] for name in names if not name.rsplit(".", 1)[-1].isdigit()})
            raise FinetuneError(
                f"peft.{key} names {', '.join(unknown)}, which {type(model).__name__} does not have; its modules are "
                f"named: {', '.join(leaves)}"
            )
    if not getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        return
    tied = {_leaf(model, model.get_input_embeddings()), _leaf(model, model.get_output_embeddings())} - {None}
    touched = sorted(tied & {*cfg.modules_to_save, *cfg.target_modules})
    if touched:
        raise FinetuneError(
            f"peft names {', '.join(touched)} of {type(model).__name__}, whose input and output embeddings are tied "
            "(one matrix): an adapter or trained copy of one side would untie them, and no merged model could "
            "compute what trained; leave the embeddings out of peft.target_modules and peft.modules_to_save"
        )


# The layers whose adapters `finetune.export.merge` folds in exactly (Conv1D: GPT-2's transposed linear layers).
_MERGEABLE = ("Linear", "Linear4bit", "Embedding", "Conv1D")


def _check_mergeable(model: PeftModel) -> None:
    """Adapters only on layers whose merge finetune computes (PEFT also adapts convolutions and attention
    modules, whose merged export would be wrong); refused before training, not after. Parameters adapted as
    parameters (ParamWrapper: fused experts) merge as finetune.export.merge computes them."""
    from peft.tuners.lora import LoraLayer, ParamWrapper

    others = sorted(
        {f"{name} ({type(m.get_base_layer()).__name__})" for name, m in model.named_modules()
         if isinstance(m, LoraLayer) and not isinstance(m, ParamWrapper)
         and type(m.get_base_layer()).__name__ not in _MERGEABLE}
    )  # fmt: skip
    if others:
        raise FinetuneError(
            f"peft.target_modules reaches {', '.join(others[:3])}: adapters train on linear, Conv1D and embedding "
            "layers only; leave these out of peft.target_modules"
        )


def _leaf(model: torch.nn.Module, module: torch.nn.Module | None) -> str | None:
    """The last part of `module`'s name in `model` (None if it is not there)."""
    return next((name.rsplit(".", 1)[-1] for name, m in model.named_modules() if m is module and name), None)


# The adapter settings that decide which tensors a checkpoint holds and what they mean: resuming with any
# of them changed would load another adapter's state (or drop trained tensors), so it is refused.
_STRUCTURAL = ("method", "r", "alpha", "target_modules", "target_experts", "target_parameters", "use_rslora",
               "modules_to_save", "quantization")  # fmt: skip


def check_resume_adapters(checkpoint: Path, cfg: PeftConfig) -> None:
    """The recipe's adapter settings equal those the checkpoint trained with, or the one that differs is named."""
    record = checkpoint / MODEL_FILES / ADAPTER_RECORD
    saved = json.loads(record.read_text()).get("settings") if record.is_file() else None
    if saved is None:  # a checkpoint from before settings were recorded: compare what PEFT's config says
        config = json.loads((checkpoint / MODEL_FILES / ADAPTER_CONFIG).read_text())
        saved = {"method": "dora" if config.get("use_dora") else "lora", "r": config.get("r"),
                 "alpha": config.get("lora_alpha"), "use_rslora": config.get("use_rslora", False)}  # fmt: skip
    ours = dataclasses.asdict(cfg)
    differ = [
        f"peft.{key}={ours[key]} (the checkpoint trained with {saved[key]})"
        for key in _STRUCTURAL
        if key in saved and _canonical(saved[key]) != _canonical(ours[key])
    ]
    if differ:
        raise FinetuneError(
            f"checkpoint {checkpoint} holds adapters of other settings than the recipe's: {'; '.join(differ)}; "
            "resume with the settings it trained with, or start a new output.dir"
        )


def _canonical(value: Any) -> Any:
    return sorted(value) if isinstance(value, list) else value


def storage_dtype(model_dtype: torch.dtype, mixed_precision: str) -> torch.dtype:
    """The dtype QLoRA packs its 4-bit weights in and computes in: the compute dtype (the accelerate
    config's mixed precision, else the model's). FSDP's mixed precision casts every parameter to the compute
    dtype; packed bytes already in it are left as they are, where a cast of them would scramble the weights.
    The rest of the model keeps `model.dtype` (fp32 master weights under bf16 compute, say)."""
    return compute_dtype(mixed_precision, model_dtype)


def quantization_config(dtype: torch.dtype):
    """The 4-bit (nf4) loading of a QLoRA base: storage in `dtype` (`storage_dtype`), so FSDP shards the
    packed weights as ordinary `dtype` tensors and casts nothing; compute in `dtype`."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise FinetuneError(
            "peft.quantization=nf4 needs bitsandbytes; install it (pip install 'bitsandbytes~=0.50.0') or set "
            "peft.quantization=none"
        ) from None
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=dtype,
    )  # fmt: skip


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The model (through DDP/FSDP wrappers) computing as its frozen base while inside: a preference run's
    reference, with no second copy of the weights."""
    inner = getattr(model, "module", model)
    with inner.disable_adapter():
        yield


def describe_adapters(model: torch.nn.Module) -> str:
    """The log line of an adapter run: how many parameters train and how many are frozen (4-bit
    weights counted as the weights they stand for, not as their packed storage)."""
    packed = _packed_4bit(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    frozen = sum(p.numel() * packed.get(id(p), 1) for p in model.parameters() if not p.requires_grad)
    in_4bit = sum(p.numel() * packed[id(p)] for p in model.parameters() if id(p) in packed)
    quantized = f", {in_4bit:,} of them in 4 bits (nf4)" if in_4bit else ""
    from peft.tuners.lora import ParamWrapper

    wrapped = sum(isinstance(m, ParamWrapper) for m in model.modules())
    experts = f"; {wrapped} fused expert weights adapted per expert" if wrapped else ""
    return f"adapters: {trainable:,} trainable parameters, {frozen:,} frozen{quantized}{experts}"


def adapter_precision(model: torch.nn.Module, mixed_precision: str) -> str:
    """The precision line of an adapter run: the frozen base, its 4-bit weights, and the adapters.
    Adapters are fp32 parameters, so their gradients and AdamW state are fp32, and so is the gradient
    reduction (FSDP2: finetune's mixed-precision policy; DDP: the gradients' own dtype)."""
    packed = _packed_4bit(model)
    base = _dtypes([p for p in model.parameters() if not p.requires_grad and id(p) not in packed])
    adapters = _dtypes([p for p in model.parameters() if p.requires_grad])
    compute = {"bf16": "bfloat16", "fp16": "float16"}.get(mixed_precision)
    line = f"precision: frozen base in {base}"
    if packed:
        storage = _dtypes([p for p in model.parameters() if id(p) in packed])
        line += f", its linear weights in 4 bits (nf4, packed in {storage} storage, dequantized to compute)"
    line += f"; adapters, their gradients and AdamW state in {adapters}, gradients reduced in {adapters}; "
    return line + (f"compute in {compute}" if compute else f"adapters compute in {adapters}, the base in {base}")


def _packed_4bit(model: torch.nn.Module) -> dict[int, int]:
    """The 4-bit weights (by id) and how many weights each stored element packs: 2 per byte of storage."""
    return {id(m.weight): 2 * m.weight.element_size() for m in model.modules() if type(m).__name__ == "Linear4bit"}


def _dtypes(params: list[torch.Tensor]) -> str:
    return "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in params})) or "-"


def adapter_record(model: PeftModel) -> dict[str, Any]:
    """What the export needs to know of an adapter run, taken before sharding: "names", trainable
    parameter name -> the key PEFT's `save_pretrained` writes it under (from PEFT itself: its adapter
    state dict holds the parameters' own storage); "quantized", for QLoRA, the base weights that
    trained in 4 bits with their quantization settings, so that --merge can start from what training saw."""
    saved_as = {tensor.data_ptr(): key for key, tensor in get_peft_model_state_dict(model).items()}
    names = {name: saved_as[p.data_ptr()] for name, p in model.named_parameters() if p.requires_grad}
    quantized = {}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if type(weight).__name__ == "Params4bit":
            base_name = name.removeprefix("base_model.model.").replace(".base_layer", "") + ".weight"
            quantized[base_name] = {
                "blocksize": weight.blocksize, "quant_type": weight.quant_type,
                "compress_statistics": weight.compress_statistics,
            }  # fmt: skip
    settings = next(iter(quantized.values()), {})
    record = {"weights": sorted(quantized), **settings, "dtype": str(model.dtype).removeprefix("torch.")}
    return {"names": names, "quantized": record if quantized else None}


def write_adapter_files(model: PeftModel, record: dict[str, Any], folder: Path) -> None:
    """adapter_config.json (with base_model_name_or_path) and the adapter record, for the export."""
    config = dataclasses.replace(model.peft_config["default"], inference_mode=True)  # as PEFT saves it
    config.save_pretrained(folder)
    (folder / ADAPTER_RECORD).write_text(json.dumps(record, indent=1))


def save_adapter_state(accelerator: Accelerator, model: torch.nn.Module, optimizer, folder: Path) -> None:
    """What a checkpoint of an adapter run holds (collective): trainable weights and their optimizer
    state through DCP, then accelerate's RNG and sampler states; the frozen base is not saved."""
    model_state, optimizer_state = get_state_dict(model, optimizer.optimizer, options=_TRAINABLE_ONLY)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder / ADAPTER_STATE)
    # Weights and optimizer are saved above; accelerate's own function saves the rest as save_state would.
    save_accelerator_state(
        str(folder), [], [], [], accelerator._dataloaders, accelerator.process_index, accelerator.step
    )


def load_adapter_state(accelerator: Accelerator, model: torch.nn.Module, optimizer, folder: Path) -> None:
    """Restore what `save_adapter_state` wrote, resharded to this run's process count."""
    model_state, optimizer_state = get_state_dict(model, optimizer.optimizer, options=_TRAINABLE_ONLY)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=folder / ADAPTER_STATE)
    set_state_dict(
        model, optimizer.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
        options=_SET_TRAINABLE,
    )  # fmt: skip
    load_accelerator_state(str(folder), [], [], [], accelerator._dataloaders, accelerator.process_index)


class AdapterWeights:
    """Adapters (LoRA, DoRA; on a 4-bit base for QLoRA) train on a frozen base: `finetune.model.weights.Weights` for a
    recipe with a `peft` section. Checkpoints hold the adapters' state only; the export, the adapter (`record`)."""

    def __init__(self, recipe: RecipeConfig):
        self.recipe, self.cfg = recipe, recipe.peft
        self.quantization = self.cfg.quantization if self.cfg.quantization != "none" else None
        self.expert_key = (
            "peft.target_experts" if self.cfg.target_experts
            else "peft.target_parameters" if self.cfg.target_parameters else None
        )  # fmt: skip
        self.record: dict[str, Any] | None = None

    def preflight(self) -> None:
        check_quantized_base(self.recipe.model, adapters=True, export_merged=self.recipe.output.export_merged)

    def check_resume(self, resume_from: Path) -> None:
        check_resume_kind(resume_from, adapters=True)
        check_resume_adapters(resume_from, self.cfg)
        self._check_resume_base(resume_from)

    def load_quantization(self, accelerator: Accelerator) -> Any:
        if self.quantization is None:
            return None
        return quantization_config(storage_dtype(DTYPES[self.recipe.model.dtype], str(accelerator.mixed_precision)))

    def prepare(self, model: torch.nn.Module, resume_from: Path | None) -> torch.nn.Module:
        model = add_adapters(model, self.cfg)
        # Checked again now that a hub base is surely in the cache (preflight may have run before it was).
        base = base_fingerprint(self.recipe.model.name_or_path)
        if resume_from is not None:
            self._check_resume_base(resume_from)
        self.record = {**adapter_record(model), "base": base, "settings": dataclasses.asdict(self.cfg)}
        return model

    def _check_resume_base(self, resume_from: Path) -> None:
        name = self.recipe.model.name_or_path
        check_resume_base(resume_from, name, model_folder(name))

    def state_io(
        self, accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer, async_save: bool
    ) -> tuple[Any, Any]:
        if async_save:  # launch.environment_problems refuses it before loading; this says so at any call
            raise FinetuneError(ASYNC_SAVE_NEEDS)
        return (
            functools.partial(save_adapter_state, accelerator, model, optimizer),
            functools.partial(load_adapter_state, accelerator, model, optimizer),
        )

    def precision_line(self, accelerator: Accelerator, model: torch.nn.Module) -> str:
        return adapter_precision(model, accelerator.mixed_precision)

    def describe(self, model: torch.nn.Module) -> str:
        return describe_adapters(model)

    def base_switch(self) -> Callable[[torch.nn.Module], AbstractContextManager[None]]:
        return adapters_disabled
