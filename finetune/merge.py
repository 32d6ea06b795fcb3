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

from finetune.checkpoint import ADAPTER_RECORD, MODEL_FILES, tensor_names, trained_base
from finetune.errors import FinetuneError, first_line
from finetune.export import CheckpointWeights, _SafetensorsWeights, adapter_tensors

_PREFIX = "base_model.model."  # PEFT's prefix of every saved adapter key


def merged_weights(checkpoint: Path, onto: str = "dequantized") -> tuple[CheckpointWeights, list[list[str]]]:
    """The base model's weights with the adapter of `checkpoint` folded in, and the model's tensor
    names (tied ones grouped), from the base config saved with the checkpoint. `onto` matters for
    QLoRA only: the base as training saw it (dequantized 4-bit) or the original weights."""
    from transformers import AutoConfig

    from finetune.model import meta_model

    config = json.loads((checkpoint / MODEL_FILES / "adapter_config.json").read_text())
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise FinetuneError(f"checkpoint {checkpoint} has per-module ranks or alphas, which --merge does not fold")
    model = meta_model(AutoConfig.from_pretrained(checkpoint / MODEL_FILES))
    # GPT-2 style Conv1D layers store (in, out): their update is transposed, as PEFT's fan_in_fan_out does.
    transposed = {name for name, module in model.named_modules() if type(module).__name__ == "Conv1D"}
    base = _base_weights(config["base_model_name_or_path"], trained_base(checkpoint))
    record = json.loads((checkpoint / MODEL_FILES / ADAPTER_RECORD).read_text())
    quantized = record.get("quantized") if onto == "dequantized" else None
    merged = MergedWeights(base, adapter_tensors(checkpoint), config, transposed, quantized)
    return merged, tensor_names(model)


class MergedWeights(CheckpointWeights):
    """Base weights by name, with the adapter's updates applied as each tensor is read."""

    def __init__(
        self,
        base: CheckpointWeights,
        adapter: dict[str, torch.Tensor],
        config: dict,
        transposed: set[str],
        quantized: dict | None = None,
    ):
        super().__init__(base.shapes, base.dtypes)
        self.base, self.transposed, self.quantized = base, transposed, quantized
        self.as_trained = set(quantized["weights"]) if quantized else set()
        self.scaling = config["lora_alpha"] / (math.sqrt(config["r"]) if config.get("use_rslora") else config["r"])
        self.parts: dict[str, dict[str, torch.Tensor]] = {}  # "<module>.weight" -> lora_A, lora_B, magnitude
        self.replaced: dict[str, torch.Tensor] = {}  # modules_to_save: trained in full
        for key, tensor in adapter.items():
            name = key.removeprefix(_PREFIX)
            for part in ("lora_A", "lora_B", "lora_magnitude_vector"):
                module, found, _ = name.partition(f".{part}")
                if found:
                    self.parts.setdefault(f"{module}.weight", {})[part] = tensor
                    break
            else:
                self.replaced[name] = tensor
        unknown = sorted(set(self.parts) - set(self.shapes))
        if unknown:
            raise FinetuneError(
                f"the adapter updates {', '.join(unknown[:3])}, which the base model does not have; merge onto the "
                "base model the adapter was trained on"
            )

    def read_into(self, targets: dict[str, torch.Tensor]) -> None:
        changed = self.parts.keys() | self.replaced.keys() | self.as_trained
        plain = {name: t for name, t in targets.items() if name not in changed}
        if plain:
            self.base.read_into(plain)
        for name, target in targets.items():
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
        """PEFT's Linear.merge in fp32: W + delta for LoRA; m / ||W + delta||_row * (W + delta) for DoRA."""
        parts = self.parts[name]
        delta = (parts["lora_B"].float() @ parts["lora_A"].float()) * self.scaling
        if name.removesuffix(".weight") in self.transposed:
            delta = delta.T
        if "lora_magnitude_vector" not in parts:
            return weight + delta
        norm = torch.linalg.norm(weight + 1 * delta, dim=1).to(weight.dtype)
        factor = parts["lora_magnitude_vector"].float() / norm
        return factor.view(-1, 1) * (weight + delta)


def _base_weights(name_or_path: str, trained_on: str | None) -> CheckpointWeights:
    """The base model's safetensors: a local folder, or a hub model (from the cache, else downloaded);
    refused when they are not the weights the adapter trained on (`trained_on`: their fingerprint)."""
    folder = Path(name_or_path).expanduser()
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        try:
            folder = Path(snapshot_download(name_or_path, allow_patterns=["*.safetensors", "*.json"]))
        except Exception as exc:  # offline, gated, missing: the hub raises many types
            raise FinetuneError(
                f"the base model {name_or_path!r} that the adapter names is not available ({first_line(exc)}); "
                "export without --merge, or make the base model reachable (a local folder or the hub cache)"
            ) from None
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FinetuneError(f"the base model folder {folder} holds no safetensors weights to merge the adapter into")
    from finetune.model import weights_fingerprint

    if trained_on is not None and weights_fingerprint(folder) != trained_on:
        raise FinetuneError(
            f"the base model {name_or_path!r} is not the one the adapter trained on (its config or weights changed "
            "since); point base_model_name_or_path in the checkpoint's hf/adapter_config.json at the base it trained "
            "on, or export without --merge"
        )
    return _SafetensorsWeights(files)
