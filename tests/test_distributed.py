"""Launch-environment and FSDP-plugin checks that need no processes."""

from __future__ import annotations

import pytest
import torch
from accelerate.utils import FullyShardedDataParallelPlugin
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from finetune.engine.accelerator import _check_launch_environment
from finetune.errors import FinetuneError
from finetune.model.dropout import checkpoint_dropout_exactly, dropout_site


def test_bf16_on_a_gpu_without_bf16_names_the_fix(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "Tesla V100-SXM2-32GB")
    with pytest.raises(FinetuneError, match="Tesla V100-SXM2-32GB has no bf16; use mixed_precision: fp16 or 'no'"):
        _check_launch_environment(recipe_activation_checkpointing=False)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    _check_launch_environment(recipe_activation_checkpointing=False)


def test_activation_checkpointing_in_one_place_is_fine(monkeypatch):
    monkeypatch.setenv("FSDP_ACTIVATION_CHECKPOINTING", "true")
    with pytest.raises(FinetuneError, match="remove one of them"):
        _check_launch_environment(recipe_activation_checkpointing=True)
    _check_launch_environment(recipe_activation_checkpointing=False)


def _gpt2() -> torch.nn.Module:
    return AutoModelForCausalLM.from_config(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2)).train()


def _llama(**kwargs) -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, **kwargs
    )
    return AutoModelForCausalLM.from_config(config).train()


def _plugin(**kwargs) -> FullyShardedDataParallelPlugin:
    return FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True, **kwargs)


def test_fsdp2_checkpointing_of_a_model_with_dropout_moves_to_transformers():
    gpt2, plugin = _gpt2(), _plugin(activation_checkpointing=True)
    assert dropout_site(gpt2) == "transformer.drop p=0.1"
    assert "checkpointed by transformers" in checkpoint_dropout_exactly(plugin, gpt2)
    assert not plugin.activation_checkpointing and gpt2.is_activation_checkpointing

    llama, plugin = _llama(), _plugin(activation_checkpointing=True)
    assert dropout_site(llama) is None and checkpoint_dropout_exactly(plugin, llama) is None
    assert plugin.activation_checkpointing and not llama.is_activation_checkpointing
    assert dropout_site(_llama(attention_dropout=0.1)) == "attention_dropout=0.1"

    assert checkpoint_dropout_exactly(_plugin(activation_checkpointing=False), _gpt2()) is None
    offloaded = _plugin(activation_checkpointing=True, activation_checkpointing_offload=True)
    with pytest.raises(FinetuneError, match="set fsdp_activation_checkpointing: false"):
        checkpoint_dropout_exactly(offloaded, _gpt2())


def test_under_bf16_fsdp2_the_loss_and_log_probs_stay_fp32():
    """The chunked head returns the summed loss (and a preference run's per-token log-probabilities) as the model's
    output: FSDP2's mixed-precision policy must not round the root's outputs to bf16 (the loss would lose its
    third digit). One process, a 1-rank gloo group, the policy training uses."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from finetune.data import IGNORE
    from finetune.engine.accelerator import _mixed_precision_policy
    from finetune.engine.processes import free_port
    from finetune.objectives.loss import batch_loss, sequence_logps

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = _llama(tie_word_embeddings=False)
        policy = _mixed_precision_policy(2, "bf16", torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        ids = torch.randint(3, 64, (2, 24))
        targets = torch.cat([ids[:, 1:], torch.full((2, 1), IGNORE)], dim=1)
        batch = {"input_ids": ids, "target_ids": targets, "attention_mask": torch.ones_like(ids)}
        total = batch_loss(model, batch, "chunked").total
        reference = batch_loss(model, batch, "full_logits").total
        assert total.dtype == torch.float32
        # bf16 would round a sum near 190 to a multiple of 1 (8 bits of mantissa); fp32 keeps it to 1e-4 here
        assert total.item() == pytest.approx(reference.item(), abs=1e-2)
        assert total.item() != round(total.item())
        sequences = torch.where(targets != IGNORE, torch.arange(2).unsqueeze(1), -1)
        batch = {**batch, "sequence_ids": sequences, "sequence_targets": torch.tensor([23, 23])}
        logps = sequence_logps(model, batch, "chunked")
        assert logps.dtype == torch.float32 and logps.sum().item() == pytest.approx(-total.item(), abs=1e-2)
    finally:
        dist.destroy_process_group()
