"""Load the model and tokenizer a recipe names."""

from __future__ import annotations

import contextlib
import copy
import difflib
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from safetensors import SafetensorError
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from finetune.config import ModelConfig
from finetune.engine import attention as varlen
from finetune.engine.recompute import Policy, checkpoint_kwargs, tile_mlps
from finetune.errors import FinetuneError, first_line
from finetune.model.family import experts_of
from finetune.model.score_head import REGRESSION, expected_head_swap, is_reward_model, zero_score

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hub_problem(name_or_path: str, exc: BaseException) -> str | None:
    """The one line for a hub model that cannot be had for its licence or a missing login, or None."""
    text = str(exc)
    if "gated" in text.lower() or "401" in text or "403" in text:
        return (
            f"{name_or_path} is a gated model: accept its licence on https://huggingface.co/{name_or_path} with your "
            "hub account, then log in on this machine (`huggingface-cli login`, or set HF_TOKEN)"
        )
    return None


def check_model_path(name_or_path: str, setting: str = "model.name_or_path") -> None:
    """A path meant as a local folder must exist; otherwise transformers reports it as a bad hub id. `setting` is
    the recipe's setting that named it."""
    looks_local = name_or_path.startswith(("/", "./", "../", "~")) or name_or_path.count("/") > 1
    if looks_local and not Path(name_or_path).expanduser().is_dir():
        raise FinetuneError(
            f"{setting} {name_or_path} is not a folder; point it at a saved model (config.json, "
            "safetensors, tokenizer files) or a hub id such as meta-llama/Llama-3.2-1B"
        )


def model_folder(name_or_path: str) -> Path | None:
    """The local folder of a model: the path itself, or a hub model's snapshot in the cache (None
    when it is not there yet; nothing is downloaded)."""
    folder = Path(name_or_path).expanduser()
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name_or_path, local_files_only=True))
    except Exception:  # not cached, not a valid id: the hub raises many types
        return None


def base_fingerprint(name_or_path: str) -> str | None:
    """The `fingerprint.weights_fingerprint` of a base model; None while its weights are not there to hash (a hub
    model not cached yet, or cached without its weight files so far): its config alone would name every model of
    one architecture, a base and all its fine-tunes, alike."""
    from finetune.storage.fingerprint import weight_files, weights_fingerprint

    folder = model_folder(name_or_path)
    return weights_fingerprint(folder) if folder is not None and weight_files(folder) else None


# Attention kernels that come from a package of their own, and the module that package installs.
_KERNEL_PACKAGES = {"flash_attention_2": ("flash_attn", "flash-attn"), "flash_attention_3": ("flash_attn_interface",
                    "flash-attn 3 (its hopper/ build)")}  # fmt: skip


# The attention implementations transformers runs a model class with, by the flag the class sets.
_CLASS_SUPPORTS = {
    "sdpa": "_supports_sdpa",
    "flex_attention": "_supports_flex_attn",
    "flash_attention_2": "_supports_flash_attn",
    "flash_attention_3": "_supports_flash_attn",
}


def check_mlp_tiling(cfg: ModelConfig, tile_tokens: int | None) -> None:
    """`train.mlp_tile_tokens` tiles a dense MLP: a mixture of experts' block routes each token, and its routers'
    logits (the load-balancing loss) would come back per tile, so it is refused before anything loads."""
    if tile_tokens and experts_of(load_model_config(cfg)) is not None:
        raise FinetuneError(
            f"train.mlp_tile_tokens={tile_tokens} tiles dense MLPs, and {cfg.name_or_path!r} routes its tokens to "
            "experts; unset train.mlp_tile_tokens (sequence parallelism or activation offload shorten its rows' "
            "footprint instead)"
        )


def tile_model_mlps(model: PreTrainedModel, tile_tokens: int | None) -> None:
    """`train.mlp_tile_tokens` applied (`finetune.engine.recompute.tile_mlps`); refused where no decoder layer has an
    `mlp` module, rather than ignored."""
    if tile_tokens and not tile_mlps(model, tile_tokens):
        raise FinetuneError(
            f"train.mlp_tile_tokens={tile_tokens}: no decoder layer of {model.config.model_type} has an `mlp` "
            "module to tile; unset train.mlp_tile_tokens"
        )


def check_attention(cfg: ModelConfig) -> None:
    """The recipe's attention implementation runs this model, and its kernel is installed: transformers would
    raise after the launch, from every process (gpt-oss, whose heads add learned sinks, has no sdpa path; the
    varlen path knows none of sliding windows, soft-capping or attention dropout)."""
    import importlib.util

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    known = ["eager", *ALL_ATTENTION_FUNCTIONS.keys(), varlen.NAME]
    if cfg.attn_implementation not in known and "/" not in cfg.attn_implementation:  # "/": a kernel on the hub
        raise FinetuneError(
            f"model.attn_implementation={cfg.attn_implementation} is no attention implementation transformers or "
            f"finetune knows; set one of: {', '.join(dict.fromkeys(known))}"
        )
    if cfg.attn_implementation in _KERNEL_PACKAGES:
        module, package = _KERNEL_PACKAGES[cfg.attn_implementation]
        if importlib.util.find_spec(module) is None:
            raise FinetuneError(
                f"model.attn_implementation={cfg.attn_implementation} needs {package}, which is not installed; "
                "install it on every machine, or set model.attn_implementation=sdpa (or varlen for packed rows)"
            )
    config = load_model_config(cfg)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is None:  # remote code: its class is not known before it loads
        return
    runs = ["eager"] + [name for name, flag in _CLASS_SUPPORTS.items() if getattr(model_class, flag, False)]
    reason = None
    if cfg.attn_implementation == varlen.NAME:
        reason = varlen.unsupported(config)
    elif cfg.attn_implementation in _CLASS_SUPPORTS and cfg.attn_implementation not in runs:
        reason = f"transformers has no {cfg.attn_implementation} path for {model_class.__name__}"
    if reason is not None:
        raise FinetuneError(
            f"model.attn_implementation={cfg.attn_implementation} cannot run {cfg.name_or_path!r}: {reason}; set "
            f"model.attn_implementation to one of: {', '.join(runs)}"
        )


def check_packing(cfg: ModelConfig, packing: bool) -> None:
    """Packed rows attend per sample: transformers finds the samples of a row from its `position_ids` when it builds
    the attention mask, but some models build theirs without them (gpt-oss, OPT, Bloom, Falcon, MPT among causal
    LMs), so under a mask-based attention (eager, sdpa, flex) every sample would attend to the ones packed before it,
    silently. Checked on the meta device before loading: the model's mask function is called with what its forward
    passes (and the forward stops there). The varlen and flash paths read the boundaries themselves."""
    if not packing or cfg.attn_implementation not in ("eager", "sdpa", "flex_attention"):
        return
    if packed_mask_ignores_positions(load_model_config(cfg)):
        raise FinetuneError(
            f"{cfg.name_or_path} builds its attention mask without the packed rows' position_ids, so under "
            f"model.attn_implementation={cfg.attn_implementation} each packed sample would attend to the samples "
            "before it in its row; set data.packing=false (rows padded, one sample each)"
        )


class _MaskCalled(Exception):
    """Raised by the stand-in mask function: the forward has shown what it passes, and stops."""


def packed_mask_ignores_positions(config: PretrainedConfig) -> bool:
    """Whether the model of `config` builds its causal mask without the `position_ids` its forward is given
    (False where it builds none through transformers' mask functions: nothing to tell)."""
    import importlib
    import inspect

    try:
        model = meta_model(config)
    except Exception:  # remote code, or a config transformers cannot build on its own: nothing to tell
        return False
    module = importlib.import_module(type(model).__module__)
    names = [n for n in ("create_causal_mask", "create_sliding_window_causal_mask") if hasattr(module, n)]
    passed: list[dict[str, Any]] = []

    originals = {name: getattr(module, name) for name in names}

    def record(*args: Any, **kwargs: Any) -> None:
        signature = inspect.signature(originals[names[0]])
        passed.append(signature.bind_partial(*args, **kwargs).arguments)
        raise _MaskCalled

    try:
        for name in names:
            setattr(module, name, record)
        positions = torch.tensor([[0, 1, 0, 1]], device="meta")
        model(input_ids=torch.zeros(1, 4, dtype=torch.long, device="meta"), position_ids=positions, use_cache=False)
    except _MaskCalled:
        pass
    except Exception:  # a forward that cannot run on the meta device: nothing to tell
        return False
    finally:
        for name, function in originals.items():
            setattr(module, name, function)
    return bool(passed) and passed[0].get("position_ids") is None


def check_quantized_base(cfg: ModelConfig, adapters: bool, export_merged: bool = False) -> None:
    """A base saved already quantized (`quantization_config` in its config.json, as the `*-bnb-4bit` hub
    models): its weights are 4-bit codes, not numbers a full fine-tuning could update, so that is refused;
    adapter runs train on it as it is (QLoRA), and export the adapter, not a merge into codes."""
    method = quantized_method(load_model_config(cfg))
    if method is None or method in DEQUANTIZED_ON_LOAD:  # numbers once loaded: trained and merged as such
        return
    if not adapters:
        raise FinetuneError(
            f"{cfg.name_or_path} is stored quantized ({method}): its weights are codes that full fine-tuning cannot "
            "update; add a peft section (adapters train on a quantized base as it is, QLoRA) or train the "
            "unquantized model"
        )
    if export_merged:
        raise FinetuneError(
            f"{cfg.name_or_path} is stored quantized ({method}): a merged export would fold the adapter into 4-bit "
            "codes; drop output.export_merged (final/ holds the adapter, which loads onto this base) or train on "
            "the unquantized model to export it merged"
        )


# Quantizations whose weights transformers turns back into numbers on load: gpt-oss publishes its experts in MXFP4
# (4-bit floats in blocks of 32 sharing a power-of-two scale), which trains only dequantized.
DEQUANTIZED_ON_LOAD = ("mxfp4",)


def dequantizing(config: PretrainedConfig) -> Any:
    """The quantization config that loads a base stored in MXFP4 dequantized to the recipe's dtype (transformers'
    `Mxfp4Config(dequantize=True)`, which also drops `quantization_config` from the loaded model's config, so
    checkpoints and exports describe plain weights); None for any other base."""
    if quantized_method(config) not in DEQUANTIZED_ON_LOAD:
        return None
    from transformers import Mxfp4Config

    return Mxfp4Config(dequantize=True)


def quantized_method(config: PretrainedConfig | dict) -> str | None:
    """The quantization a saved model is stored in (`quant_method` of its quantization_config), or None."""
    quantization = (
        config.get("quantization_config") if isinstance(config, dict) else getattr(config, "quantization_config", None)
    )
    if quantization is None:
        return None
    if isinstance(quantization, dict):
        return str(quantization.get("quant_method", "quantized"))
    return str(getattr(quantization, "quant_method", type(quantization).__name__))


def check_max_length(cfg: ModelConfig, max_length: int, setting: str = "model.name_or_path") -> None:
    """`data.max_length` within the positions the model was built for (read from its config only): past them,
    learned position tables (GPT-2) fail in the first step, after minutes of loading, and rotary ones grade
    positions they never saw. `setting` names the model: the student's, or a second model scoring the same rows
    (a teacher, a preference reference)."""
    check_model_path(cfg.name_or_path, setting)
    check_positions(positions_of(load_model_config(cfg, setting)), max_length, cfg.name_or_path, setting)


def positions_of(config: PretrainedConfig) -> int | None:
    """The positions a model attends (its config's `max_position_embeddings`, after config_overrides), if it says."""
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def check_positions(limit: int | None, max_length: int, name: str, setting: str = "model.name_or_path") -> None:
    """`check_max_length` given the positions already read (the planner reads configs without the model's folder)."""
    if limit is not None and max_length > limit:
        which = "" if setting == "model.name_or_path" else f" ({setting})"
        raise FinetuneError(
            f"data.max_length={max_length} exceeds the {limit} positions of {name}{which}; "
            f"set data.max_length to {limit} or less"
        )


def load_tokenizer(cfg: ModelConfig, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """The model's tokenizer, with a pad token (the EOS token when the tokenizer has none) and the
    recipe's chat template in place of its own when the recipe gives one (`data.chat_template`)."""
    check_model_path(cfg.name_or_path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise FinetuneError(
            hub_problem(cfg.name_or_path, exc)
            or f"cannot load a tokenizer from {cfg.name_or_path!r} ({first_line(exc)}); set model.name_or_path "
            "to a hub id or a local folder holding the tokenizer files"
        ) from None
    if not tokenizer.is_fast:
        raise FinetuneError(f"the tokenizer of {cfg.name_or_path!r} is not a fast tokenizer; install `tokenizers`")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    named = tokenizer.chat_template if isinstance(tokenizer.chat_template, dict) else None
    if chat_template is not None:
        from finetune.data.chat import read_chat_template

        tokenizer.chat_template = read_chat_template(chat_template, named)
    elif named is not None:
        # Named templates (Hermes-2-Pro, Command-R): training renders with one, the default unless the recipe
        # names another, and exports it as the model's template.
        if "default" not in named:
            raise FinetuneError(
                f"the tokenizer of {cfg.name_or_path!r} has named chat templates ({', '.join(sorted(named))}) and "
                "no default; name the one to train with in data.chat_template"
            )
        tokenizer.chat_template = named["default"]
    return tokenizer


def check_vocabulary(
    cfg: ModelConfig,
    tokenizer: PreTrainedTokenizerBase,
    reference: str | None = None,
    setting: str = "preference.reference_model",
) -> None:
    """Before any weights load: every token the tokenizer can produce has an embedding row (else an IndexError deep
    in the forward, on a GPU a device-side assert), and a second model (a preference `reference`, a distillation
    teacher: named by `setting`) scores the same vocabulary with the same tokenizer as the policy (a smaller one
    fails in the loss, a larger one normalizes over other tokens and trains silently wrong)."""
    rows = load_model_config(cfg).get_text_config().vocab_size
    if rows is not None and len(tokenizer) > rows:
        raise FinetuneError(
            f"the tokenizer of {cfg.name_or_path!r} has {len(tokenizer):,} tokens, more than the {rows:,} rows of "
            f"the model's embedding (vocab_size in its config.json): token ids from {rows:,} on cannot be embedded; "
            "use the tokenizer saved with this model, or resize the embedding to the tokenizer and save the model"
        )
    if reference is None:
        return
    theirs = load_model_config(ModelConfig(name_or_path=reference, trust_remote_code=cfg.trust_remote_code))
    reference_rows = theirs.get_text_config().vocab_size
    if reference_rows != rows:
        raise FinetuneError(
            f"{setting} {reference!r} has {reference_rows:,} embedding rows and the model {cfg.name_or_path!r} "
            f"{rows:,}: both must score the same token ids over the same vocabulary; use one of the model's own "
            "vocabulary (the model it was fine-tuned from, or a model of its family)"
        )
    folder = model_folder(reference)
    if folder is None or not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        return  # a reference saved without a tokenizer: its vocabulary size is all there is to compare
    their_tokens = AutoTokenizer.from_pretrained(folder, trust_remote_code=cfg.trust_remote_code).get_vocab()
    ours = tokenizer.get_vocab()
    if their_tokens != ours:
        token, token_id = sorted(set(ours.items()) ^ set(their_tokens.items()), key=lambda item: (item[1], item[0]))[0]
        raise FinetuneError(
            f"the tokenizer of {setting} {reference!r} differs from the model's ({len(their_tokens):,} and "
            f"{len(ours):,} tokens; first difference: {token!r} = id {token_id:,} in one only): it would score other "
            "tokens than the ones trained; use a model with the same tokenizer"
        )


def load_model_config(
    cfg: ModelConfig, setting: str = "model.name_or_path", file_setting: str = "model.config_file"
) -> PretrainedConfig:
    """The architecture a recipe trains: from its shipped `config_file`, else from `name_or_path`. `setting` and
    `file_setting` are the recipe's settings that named them, for the messages (a teacher's: distill.teacher and
    distill.teacher_config_file)."""
    source = cfg.config_file or cfg.name_or_path
    if cfg.config_file is not None and not Path(cfg.config_file).is_file():
        raise FinetuneError(f"{file_setting} {cfg.config_file} does not exist; point it at a config.json")
    if cfg.config_file is None:
        check_model_path(cfg.name_or_path, setting)
        if (why := not_a_model(cfg.name_or_path, setting)) is not None:
            raise FinetuneError(why)
    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise FinetuneError(
            f"the architecture of {cfg.name_or_path!r} ({setting}) is not available offline ({first_line(exc)}); save "
            f"its config.json under recipes/<family>/configs/ and set {file_setting} to it, or point {setting} at a "
            "local model folder"
        ) from None
    return with_overrides(config, cfg.config_overrides)


def not_a_model(name_or_path: str, setting: str) -> str | None:
    """Why a folder without a config.json named as a model is something finetune writes that is not one (a LoRA
    adapter, a checkpoint or run folder), with the export that makes a model of it; else None."""
    folder = Path(name_or_path).expanduser()
    if not folder.is_dir() or (folder / "config.json").is_file():
        return None
    if (folder / "adapter_config.json").is_file():
        return (
            f"{setting} {name_or_path} is a LoRA adapter, not a whole model; merge it onto its base with "
            f"`finetune export <its checkpoint> <folder> --merge` (or output.export_merged: true) and set {setting} "
            "to the merged folder"
        )
    if (folder / "trainer_state.json").is_file() or (folder / "checkpoints").is_dir():
        return (
            f"{setting} {name_or_path} is a training checkpoint or run folder, not a model; export it with "
            f"`finetune export {name_or_path} <folder>` and set {setting} to that folder"
        )
    return None


def with_overrides(config: PretrainedConfig, overrides: dict[str, Any]) -> PretrainedConfig:
    """`config` with `model.config_overrides` set; a name the config does not have is refused (transformers would
    keep it as an unused attribute, and the run would train as if it had not been given)."""
    unknown = [name for name in overrides if not hasattr(config, name)]
    if unknown:
        known = sorted(config.to_dict())
        hints = [
            f"{name} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(name, known, 1)) else name
            for name in unknown
        ]
        raise FinetuneError(
            f"model.config_overrides sets {', '.join(hints)}, which the {config.model_type} config does not have; "
            "name settings of its config.json"
        )
    if not overrides:
        return config
    before = copy.deepcopy(config)
    for name, value in overrides.items():
        setattr(config, name, value)
    _check_overridden(before, config, ", ".join(overrides))
    return config


def _check_overridden(before: PretrainedConfig, after: PretrainedConfig, names: str) -> None:
    """Overrides that make a config transformers cannot build (found here, not as a KeyError in the middle of
    loading), or one whose weights have other shapes than the checkpoint's (transformers would load it with those
    weights initialized at random, and say so in a report few read)."""
    for parameters in _rope_parameter_sets(after.get_text_config()):
        rope_type = parameters.get("rope_type", parameters.get("type", "default"))
        if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
            raise FinetuneError(
                f"model.config_overrides: rope_type {rope_type!r} is not a RoPE type transformers knows (default, "
                f"{', '.join(sorted(ROPE_INIT_FUNCTIONS))}); fix the override"
            )
    try:
        after.validate()
    except Exception as exc:  # transformers' validators raise ValueError, KeyError or their own error type
        reason = " ".join(str(exc).split()).removeprefix("Class validation error for validator")
        raise FinetuneError(
            f"model.config_overrides ({names}) make a config transformers refuses ({reason.strip()}); fix them"
        ) from None
    try:
        shapes = [{n: tuple(p.shape) for n, p in meta_model(c).named_parameters()} for c in (before, after)]
    except Exception:  # an architecture transformers cannot build alone (remote code): loading will say why
        return
    changed = sorted(n for n in shapes[0].keys() | shapes[1].keys() if shapes[0].get(n) != shapes[1].get(n))
    if changed:
        raise FinetuneError(
            f"model.config_overrides ({names}) change the shapes of the model's weights ({changed[0]}"
            f"{f' and {len(changed) - 1} more' if len(changed) > 1 else ''}), so the checkpoint's weights would not "
            "fit (dropped, or initialized at random); override settings that keep every weight's shape (RoPE, "
            "positions, dropout), or train a model of that shape from its own checkpoint"
        )


def _rope_parameter_sets(config: PretrainedConfig) -> list[dict[str, Any]]:
    """The RoPE settings of a config: one dict, or one per layer type (models with sliding and full attention)."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(parameters, dict):
        return []
    if all(isinstance(value, dict) for value in parameters.values()) and parameters:
        return list(parameters.values())
    return [parameters]


def meta_model(config: PretrainedConfig) -> PreTrainedModel:
    """The model `config` describes, on the meta device: every name and shape, no memory, no weights; a reward
    model's config (a scalar sequence classifier) gives its classifier, any other its causal LM."""
    auto = AutoModelForSequenceClassification if is_reward_model(config) else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config)


def load_model(
    cfg: ModelConfig,
    activation_checkpointing: Policy,
    *,
    read_weights: bool = True,
    quantization: Any = None,
    score_pad_id: int | None = None,
) -> PreTrainedModel:
    """The model in the recipe's parameter dtype, never in the checkpoint's dtype by accident;
    `quantization` is a transformers quantization config (QLoRA's 4-bit base) or None. With `score_pad_id`, a
    reward model: the base as a sequence classifier with one output read raw (`finetune.model.score_head`),
    padded with that id, its head at zero unless the base already is a reward model.

    `read_weights=False` is rank-0 loading on the other ranks: parameters are created on the meta
    device (no file read, no memory) and receive rank 0's values when accelerate shards the model.
    Buffers are built for real, since rotary tables and the like are not in the weights to receive.
    """
    dtype, attention = DTYPES[cfg.dtype], cfg.attn_implementation
    if attention == varlen.NAME:
        varlen.register()
    try:
        config = AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code)
        config = with_overrides(config, cfg.config_overrides)
        dequantize = dequantizing(config)
        if dequantize is not None:
            del config.quantization_config  # the model built below holds plain weights
        quantization = quantization if quantization is not None else dequantize
        auto, head, trained_head = AutoModelForCausalLM, {}, is_reward_model(config)
        if score_pad_id is not None:
            auto, head = AutoModelForSequenceClassification, {**REGRESSION, "pad_token_id": score_pad_id}
            config.update(head)
        if read_weights:
            # Passed only when given: an explicit None would also drop the quantization of a base saved quantized.
            quantized = {"quantization_config": quantization} if quantization is not None else {}
            with expected_head_swap(config) if score_pad_id is not None else contextlib.nullcontext():
                model = auto.from_pretrained(
                    cfg.name_or_path, dtype=dtype, attn_implementation=attention,
                    trust_remote_code=cfg.trust_remote_code, **quantized, **cfg.config_overrides, **head,
                )  # fmt: skip
            if score_pad_id is not None and not trained_head:
                zero_score(model)
        else:
            with init_empty_weights(include_buffers=False):
                model = auto.from_config(
                    config, dtype=dtype, attn_implementation=attention, trust_remote_code=cfg.trust_remote_code
                )
            model.tie_weights()  # not done for meta parameters, and rank 0's model has them tied
        if score_pad_id is not None:  # the class its checkpoints and exports are read as (config.json written alone)
            model.config.architectures = [type(model).__name__]
    except ImportError as exc:  # an attention kernel or quantization package missing
        raise FinetuneError(f"cannot load {cfg.name_or_path!r}: {first_line(exc)}") from None
    except (OSError, ValueError, SafetensorError) as exc:  # SafetensorError: a truncated or damaged weights file
        raise FinetuneError(
            hub_problem(cfg.name_or_path, exc)
            or f"cannot load a causal LM from {cfg.name_or_path!r} ({first_line(exc)}); set model.name_or_path "
            "to a hub id or a local folder with config.json and safetensors weights"
        ) from None
    if attention == varlen.NAME and (reason := varlen.unsupported(model.config)) is not None:
        raise FinetuneError(f"model.attn_implementation=varlen cannot run {cfg.name_or_path!r}: {reason}; use sdpa")
    if experts_of(model.config) is not None:
        model.set_experts_implementation(cfg.experts_implementation)
    if activation_checkpointing != "none":
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs=checkpoint_kwargs(activation_checkpointing)
        )
    # from_pretrained returns the model in eval mode, where dropout and activation checkpointing are off.
    model.train()
    return model


def check_tied_weights(model: PreTrainedModel) -> None:
    """A model configured with tied embeddings must still share one tensor after sharding.

    Sharding replaces parameters; a wrapper that replaced the two names separately would train
    two matrices, and the export (which stores the tied tensor once) would drop one of them.
    """
    if not getattr(model.config.get_text_config(), "tie_word_embeddings", False):
        return
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    if inputs is not None and outputs is not None and inputs.weight is not outputs.weight:
        raise FinetuneError(
            f"{type(model).__name__} ties its input and output embeddings, but after sharding they are two "
            "different parameters; use an FSDP2 config (accelerate_configs/fsdp2_full_shard.yaml), which keeps "
            "them tied"
        )
