"""`finetune export --merge`: an adapter checkpoint as a plain transformers model folder.

The base model's weights are read from its safetensors files (the folder or cached hub model that
adapter_config.json names) a few tensors at a time, each adapted weight gets its update folded in
(LoRA: W + s * B @ A; DoRA: that, rescaled per output row to the trained magnitude), in fp32, and
the result is written by the same shard-at-a-time exporter as any checkpoint: memory stays about
one output shard. The arithmetic is PEFT's `merge_and_unload`, step for step: in fp32 the files are
bit-identical to it; for a bf16 base the merge happens in fp32 before the cast (PEFT adds in bf16).

A QLoRA adapter trained against the 4-bit base, not the original weights: by default each weight
that trained in 4 bits is quantized and dequantized exactly as training loaded it (bitsandbytes, same
block size and type) before the update is added, so the merged model computes what the trained one
did; `onto="original"` adds the update to the original weights instead (closer to the base's own
quality, further from what the adapter was fitted to).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from finetune.errors import FinetuneError, first_line
from finetune.export.weight_files import CheckpointWeights, SafetensorsWeights, adapter_tensors
from finetune.model.family import HubLayout
from finetune.model.score_head import is_reward_model
from finetune.storage.checkpoint import ADAPTER_RECORD, MODEL_FILES, tensor_names, trained_base

_PREFIX = "base_model.model."  # PEFT's prefix of every saved adapter key
_TRANSPOSED = ("Conv1D", "Embedding")
# PEFT's names of an adapter's parts (an embedding's low-rank pair has names of its own) -> the part merged.
_PARTS = {"lora_A": "lora_A", "lora_B": "lora_B", "lora_embedding_A": "lora_A", "lora_embedding_B": "lora_B",
          "lora_magnitude_vector": "lora_magnitude_vector"}  # fmt: skip


def merged_weights(checkpoint: Path, onto: str = "dequantized") -> tuple[CheckpointWeights, list[list[str]]]:
    """The base model's weights with the adapter of `checkpoint` folded in, and the model's tensor
    names (tied ones grouped), from the base config saved with the checkpoint. `onto` matters for
    QLoRA only: the base as training saw it (dequantized 4-bit) or the original weights."""
    from transformers import AutoConfig

    from finetune.model.loading import meta_model

    config = json.loads((checkpoint / MODEL_FILES / "adapter_config.json").read_text())
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise FinetuneError(f"checkpoint {checkpoint} has per-module ranks or alphas, which --merge does not fold")
    model = meta_model(AutoConfig.from_pretrained(checkpoint / MODEL_FILES))
    transposed = transposed_layers(model)
    base = _base_weights(config["base_model_name_or_path"], trained_base(checkpoint))
    record = json.loads((checkpoint / MODEL_FILES / ADAPTER_RECORD).read_text())
    quantized = record.get("quantized") if onto == "dequantized" else None
    adapter = adapter_tensors(checkpoint)
    experts = ExpertUpdates(model, config, adapter)  # takes the adapter's fused-expert tensors out of it
    # The base's files are in the layout its family is published in (finetune.model.family); the adapter names the
    # model's modules as held in memory.
    hub, groups = HubLayout.of(model), tensor_names(model)
    if hub is not None:
        adapter, groups = {_hub_key(hub, key): tensor for key, tensor in adapter.items()}, hub.groups(groups)
        transposed = {hub.name(f"{layer}.weight").removesuffix(".weight") for layer in transposed}
    experts.in_layout(hub)
    merged = MergedWeights(base, adapter, config, transposed, quantized, experts)
    if is_reward_model(model.config):
        merged.swap_head(groups)
    return merged, groups


class ExpertUpdates:
    """The updates of parameters adapted as parameters (PEFT's ParamWrapper, `target_parameters`: fused expert
    weights, experts x out x in), one fused parameter at a time, in the names the base's files use.

    PEFT saves a module's adapted parameters as nested wrappers (`...experts.lora_A` for the last one named,
    `...experts.base_layer.lora_A` for the one before) that do not name the parameter: which is which, and
    whether PEFT swapped its in and out features, is read off PEFT's own wrapping of the model on the meta
    device. Each update is PEFT's: per expert e, B_e @ A_e times the scaling, in the parameter's layout."""

    def __init__(self, model: torch.nn.Module, config: dict, adapter: dict[str, torch.Tensor]):
        self.scaling = _scaling(config)
        self.parts: dict[str, tuple[torch.Tensor, torch.Tensor, int, bool]] = {}  # parameter -> A, B, experts, swap
        self.pieces: dict[str, str] = {}  # name in the base's files -> the fused parameter it is (part of)
        self.shapes: dict[str, torch.Size] = {}
        self.hub: HubLayout | None = None
        if not config.get("target_parameters"):
            return
        for prefix, (parameter, experts, swapped) in _parameter_wrappers(model, config).items():
            a, b = adapter.pop(f"{prefix}.lora_A.weight"), adapter.pop(f"{prefix}.lora_B.weight")
            self.parts[parameter] = (a, b, experts, swapped)
        self.shapes = {name: p.shape for name, p in model.named_parameters() if name in self.parts}
        plain = [name for name, shape in self.shapes.items() if len(shape) != 3]
        if plain:  # a limit of the merge, not a fault of the checkpoint: say so before reading anything
            raise FinetuneError(
                f"the adapter adapts {', '.join(plain)} through target_parameters, and the merge folds such updates "
                "only into fused expert weights (experts x out x in); export without --merge (PEFT loads the adapter "
                "onto the base), or train that weight with peft.target_modules"
            )

    def in_layout(self, hub: HubLayout | None) -> None:
        """Name each update's pieces as the base's files store them (fused, or one tensor per expert)."""
        for name, shape in self.shapes.items():
            stored = hub.convert(name, torch.empty(shape, device="meta")) if hub is not None else {name: None}
            self.pieces |= dict.fromkeys(stored, name)
        self.hub = hub

    def delta(self, parameter: str) -> dict[str, torch.Tensor]:
        """The update of fused `parameter` in fp32, as the pieces the base's files store."""
        a, b, experts, swapped = self.parts[parameter]
        a = a.float().reshape(experts, -1, a.shape[-1])  # experts x r x in
        b = b.float().reshape(b.shape[0], -1, experts)  # out x r x experts
        delta = torch.einsum("o r e, e r i -> e o i" if swapped else "o r e, e r i -> e i o", b, a) * self.scaling
        return self.hub.convert(parameter, delta) if self.hub is not None else {parameter: delta}


def _scaling(config: dict) -> float:
    """The factor of every update B @ A of an adapter (PEFT's adapter_config): alpha / r, or alpha / sqrt(r)."""
    return config["lora_alpha"] / (math.sqrt(config["r"]) if config.get("use_rslora") else config["r"])


def _parameter_wrappers(model: torch.nn.Module, config: dict) -> dict[str, tuple[str, int, bool]]:
    """For each ParamWrapper PEFT puts on `model` for the adapter `config`: its key prefix in a saved adapter ->
    (the parameter it adapts, by full name; its number of experts; whether PEFT swapped in and out features)."""
    import copy

    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import ParamWrapper

    keep = {"r", "lora_alpha", "target_modules", "target_parameters", "use_rslora", "modules_to_save"}
    lora = LoraConfig(**{k: v for k, v in config.items() if k in keep}, task_type="CAUSAL_LM")
    with torch.device("meta"):
        wrapped = get_peft_model(copy.deepcopy(model), lora)
    found = {}
    for name, module in wrapped.named_modules():
        if isinstance(module, ParamWrapper):
            owner = name.removeprefix(_PREFIX).replace(".base_layer", "")
            found[name] = (f"{owner}.{module.parameter_name}", module.num_experts, module._did_swap_in_out_features)
    return found


def _hub_key(hub: HubLayout, key: str) -> str:
    """A PEFT adapter key (`base_model.model.<module>.lora_A.weight`, `...<module>.weight` for a module trained
    whole) with its module's name as the hub layout has it."""
    name = key.removeprefix(_PREFIX)
    for part in _PARTS:
        module, found, rest = name.partition(f".{part}")
        if found:
            return _PREFIX + hub.name(f"{module}.weight").removesuffix(".weight") + found + rest
    return _PREFIX + hub.name(name)


def transposed_layers(model: torch.nn.Module) -> set[str]:
    """The layers whose adapter update is transposed: GPT-2 style Conv1D layers store (in, out), and embeddings
    (tokens, width) with their adapter's B @ A as (width, tokens); DoRA's magnitude is then per column (PEFT's
    fan_in_fan_out)."""
    return {name for name, module in model.named_modules() if type(module).__name__ in _TRANSPOSED}


class MergedWeights(CheckpointWeights):
    """Base weights by name, with the adapter's updates applied as each tensor is read."""

    def __init__(
        self,
        base: CheckpointWeights,
        adapter: dict[str, torch.Tensor],
        config: dict,
        transposed: set[str],
        quantized: dict | None = None,
        experts: ExpertUpdates | None = None,
    ):
        super().__init__(dict(base.shapes), dict(base.dtypes))
        self.base, self.transposed, self.quantized, self.experts = base, transposed, quantized, experts
        self.as_trained = set(quantized["weights"]) if quantized else set()
        self.scaling = _scaling(config)
        self.parts: dict[str, dict[str, torch.Tensor]] = {}  # "<module>.weight" -> lora_A, lora_B, magnitude
        self.replaced: dict[str, torch.Tensor] = {}  # modules_to_save: trained in full
        for key, tensor in adapter.items():
            name = key.removeprefix(_PREFIX)
            for part, merged_as in _PARTS.items():
                module, found, rest = name.partition(f".{part}")
                if found and rest in ("", ".weight"):
                    self.parts.setdefault(f"{module}.weight", {})[merged_as] = tensor
                    break
            else:
                self.replaced[name] = tensor
        if self.as_trained:
            try:
                import bitsandbytes  # noqa: F401
            except ImportError:
                raise FinetuneError(
                    "this adapter trained on a 4-bit (QLoRA) base, and merging onto that base as training saw it "
                    "needs bitsandbytes: install it (pip install 'bitsandbytes~=0.50.0'), or pass --merge-onto "
                    "original to merge onto the original weights"
                ) from None
        unknown = sorted(set(self.parts) - set(self.shapes))
        if unknown:
            raise FinetuneError(
                f"the adapter updates {', '.join(unknown[:3])}, which the base model does not have; merge onto the "
                "base model the adapter was trained on"
            )

    def swap_head(self, groups: list[list[str]]) -> None:
        """A reward model merged onto the causal LM it was made from: the base's output layer, which the classifier
        lacks, is left out, and the `score` head, trained in full beside the adapter, comes in."""
        known = {name for group in groups for name in group}
        for name in [name for name in self.shapes if name not in known and name.startswith("lm_head.")]:
            del self.shapes[name], self.dtypes[name]
        for name, tensor in self.replaced.items():
            if name not in self.shapes:
                self.shapes[name], self.dtypes[name] = tensor.shape, tensor.dtype

    def read_into(self, targets: dict[str, torch.Tensor]) -> None:
        pieces = self.experts.pieces if self.experts is not None else {}
        changed = self.parts.keys() | self.replaced.keys() | self.as_trained | pieces.keys()
        plain = {name: t for name, t in targets.items() if name not in changed}
        if plain:
            self.base.read_into(plain)
        # A fused expert parameter's update is computed once for the pieces of it this shard holds.
        for parameter in dict.fromkeys(pieces[name] for name in targets if name in pieces):
            for name, delta in self.experts.delta(parameter).items():
                if name in targets:
                    weight = torch.empty(self.shapes[name], dtype=torch.float32)
                    self.base.read_into({name: weight})
                    targets[name].copy_(weight + delta)
        for name, target in targets.items():
            if name in pieces:
                continue
            if name in self.replaced:
                target.copy_(self.replaced[name])
            elif name in changed:
                weight = torch.empty(self.shapes[name], dtype=torch.float32)
                self.base.read_into({name: weight})
                if name in self.as_trained:
                    weight = self._as_trained(weight)
                target.copy_(self._merge(name, weight) if name in self.parts else weight)

    def _as_trained(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight as QLoRA training computed with it: loaded in the training dtype, quantized to 4
        bits as bitsandbytes' Params4bit does, dequantized."""
        import bitsandbytes.functional as bnb

        q = self.quantized
        packed, state = bnb.quantize_4bit(
            weight.to(getattr(torch, q["dtype"])).contiguous(), blocksize=q["blocksize"],
            compress_statistics=q["compress_statistics"], quant_type=q["quant_type"],
        )  # fmt: skip
        return bnb.dequantize_4bit(packed, state).float()

    def _merge(self, name: str, weight: torch.Tensor) -> torch.Tensor:
        """PEFT's merge in fp32, for a Linear, Conv1D or Embedding layer: W + delta for LoRA; for DoRA that
        rescaled to the trained magnitude m over the norm of each output feature, m / ||W + delta|| * (W + delta),
        where an output feature is a row of a Linear's weight and a column of the (transposed) others'."""
        parts = self.parts[name]
        delta = (parts["lora_B"].float() @ parts["lora_A"].float()) * self.scaling
        transposed = name.removesuffix(".weight") in self.transposed
        if transposed:
            delta = delta.T
        if "lora_magnitude_vector" not in parts:
            return weight + delta
        # The norm as PEFT takes it: over each output feature's row of the (out, in) view.
        rows = (weight.T + delta.T) if transposed else (weight + 1 * delta)
        norm = torch.linalg.norm(rows, dim=1).to(weight.dtype)
        factor = parts["lora_magnitude_vector"].float() / norm
        return factor.view(1, -1) * (weight + delta) if transposed else factor.view(-1, 1) * (weight + delta)


def _base_weights(name_or_path: str, trained_on: str | None) -> CheckpointWeights:
    """The base model's safetensors: a local folder, or a hub model (from the cache, else downloaded);
    refused when they are not the weights the adapter trained on (`trained_on`: their fingerprint)."""
    folder = Path(name_or_path).expanduser()
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        try:
            folder = Path(snapshot_download(name_or_path, allow_patterns=["model*.safetensors", "*.json"]))
        except Exception as exc:  # offline, gated, missing: the hub raises many types
            raise FinetuneError(
                f"the base model {name_or_path!r} that the adapter names is not available ({first_line(exc)}); "
                "export without --merge, or make the base model reachable (a local folder or the hub cache)"
            ) from None
    from finetune.model.loading import DEQUANTIZED_ON_LOAD, quantized_method
    from finetune.storage.fingerprint import matches

    config = folder / "config.json"
    method = quantized_method(json.loads(config.read_text())) if config.is_file() else None
    if method is not None and method not in DEQUANTIZED_ON_LOAD:
        raise FinetuneError(
            f"the base model {name_or_path!r} is stored quantized ({method}), so there are no weights to fold the "
            "adapter into, only codes; export without --merge (the adapter loads onto this base), or merge onto the "
            "unquantized model by pointing base_model_name_or_path in hf/adapter_config.json at it"
        )
    files = model_weight_files(folder)
    if trained_on is not None and not matches(folder, trained_on):
        raise FinetuneError(
            f"the base model {name_or_path!r} is not the one the adapter trained on (its config or weights changed "
            "since); point base_model_name_or_path in the checkpoint's hf/adapter_config.json at the base it trained "
            "on, or export without --merge"
        )
    return _Mxfp4Weights(SafetensorsWeights(files)) if method == "mxfp4" else SafetensorsWeights(files)


class _Mxfp4Weights(CheckpointWeights):
    """A base stored in MXFP4 (gpt-oss's experts: `<name>_blocks`, two 4-bit floats a byte, 32 to a block, and
    `<name>_scales`, a power of two a block), read as the weights training loaded: what transformers dequantizes
    them to, under the fused names and in the layout the model holds them (experts x in x out), in the dtype the
    base stores its other weights in (bf16 on the hub; every MXFP4 value is exact in it). One fused tensor at a
    time, as the exporter asks for them."""

    def __init__(self, stored: SafetensorsWeights):
        self.stored = stored
        self.dtype = stored.training_dtype()  # the codes are integers: the plain weights' dtype
        self.packed: dict[str, tuple[str, str]] = {}  # fused name -> its blocks and scales
        shapes, dtypes = {}, {}
        for name, shape in stored.shapes.items():
            fused = name.removesuffix("_blocks")
            if name.endswith("_blocks") and f"{fused}_scales" in stored.shapes:
                experts, outputs, blocks, pairs = shape
                shapes[fused], dtypes[fused] = torch.Size([experts, blocks * pairs * 2, outputs]), self.dtype
                self.packed[fused] = (name, f"{fused}_scales")
            elif not (name.endswith("_scales") and f"{name.removesuffix('_scales')}_blocks" in stored.shapes):
                shapes[name], dtypes[name] = shape, stored.dtypes[name]
        super().__init__(shapes, dtypes)

    def read_into(self, targets: dict[str, torch.Tensor]) -> None:
        from transformers.integrations.mxfp4 import convert_moe_packed_tensors

        plain = {name: target for name, target in targets.items() if name not in self.packed}
        if plain:
            self.stored.read_into(plain)
        for name in targets.keys() & self.packed.keys():
            codes = {key: torch.empty(self.stored.shapes[key], dtype=torch.uint8) for key in self.packed[name]}
            self.stored.read_into(codes)
            blocks, scales = (codes[key] for key in self.packed[name])
            targets[name].copy_(convert_moe_packed_tensors(blocks, scales, dtype=self.dtype))


def model_weight_files(folder: Path) -> list[Path]:
    """The safetensors files of the model in `folder`, as transformers reads them: those its index names, else
    `model.safetensors`; other safetensors beside them (an adapter, consolidated or original copies) are not
    the model's."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [name for name in names if not (folder / name).is_file()]
        if missing:
            raise FinetuneError(
                f"the base model folder {folder} lacks {', '.join(missing[:3])}, which its index names; download "
                "the model again"
            )
        return [folder / name for name in names]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    raise FinetuneError(
        f"the base model folder {folder} holds no model.safetensors (or index) to merge the adapter into; save the "
        "base with save_pretrained (safetensors), or export without --merge"
    )
