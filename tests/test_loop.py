"""The loop's arithmetic in one process: loss normalization across micro-batches, and step counts."""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

from finetune.data import IGNORE, collate_padded
from finetune.loop import train_step
from finetune.loss import batch_loss


def rows_with_uneven_targets() -> list[dict]:
    """Four samples whose lengths and trained-token counts differ a lot, as real chat data does."""
    generator = torch.Generator().manual_seed(0)
    rows = []
    for length, trained in ((30, 25), (6, 1), (18, 3), (9, 8)):
        ids = torch.randint(3, 64, (length,), generator=generator).tolist()
        targets = [IGNORE] * (length - trained - 1) + ids[length - trained :] + [IGNORE]
        rows.append({"input_ids": ids, "target_ids": targets})
    return rows


def update_after(model: torch.nn.Module, micro_batches: list[dict]) -> list[torch.Tensor]:
    """Parameter change of one SGD(lr=1) step, i.e. minus the gradient the loop computed."""
    accelerator = Accelerator(cpu=True)
    model = copy.deepcopy(model)
    before = [p.detach().clone() for p in model.parameters()]
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    train_step(model, optimizer, micro_batches, accelerator, max_grad_norm=0.0, step=1, loss_path="chunked")
    return [b - p.detach() for b, p in zip(before, model.parameters(), strict=True)]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
    )
    return LlamaForCausalLM(config)


def test_accumulation_split_does_not_change_the_update(model):
    rows = rows_with_uneven_targets()
    whole = update_after(model, [collate_padded(rows, pad_id=0)])
    split = update_after(model, [collate_padded(rows[:2], pad_id=0), collate_padded(rows[2:], pad_id=0)])
    for a, b in zip(whole, split, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_update_is_the_gradient_of_the_per_token_mean(model):
    rows = rows_with_uneven_targets()
    update = update_after(model, [collate_padded(rows[:2], pad_id=0), collate_padded(rows[2:], pad_id=0)])
    reference = copy.deepcopy(model)
    batch = collate_padded(rows, pad_id=0)
    num_targets = (batch["target_ids"] != IGNORE).sum()
    (batch_loss(reference, batch, "full_logits").total / num_targets).backward()
    for got, param in zip(update, reference.parameters(), strict=True):
        torch.testing.assert_close(got, param.grad, atol=1e-6, rtol=1e-5)
    # The data is uneven enough that a mean of per-micro-batch means would give another update.
    naive = copy.deepcopy(model)
    for half in (rows[:2], rows[2:]):
        b = collate_padded(half, pad_id=0)
        (batch_loss(naive, b, "full_logits").total / (b["target_ids"] != IGNORE).sum() / 2).backward()
    assert not all(torch.allclose(g, p.grad, atol=1e-4) for g, p in zip(update, naive.parameters(), strict=True))


def test_epochs_become_steps_and_too_little_data_is_an_error():
    from conftest import DEMO_RECIPE

    from finetune.config import load_recipe
    from finetune.errors import FinetuneError
    from finetune.loop import _max_steps

    by_epochs = load_recipe(
        DEMO_RECIPE, ["train.max_steps=null", "train.num_epochs=1.5", "train.gradient_accumulation_steps=2"]
    )
    assert _max_steps(by_epochs, list(range(10))) == 8  # 5 steps per epoch
    with pytest.raises(FinetuneError, match="fewer than train.gradient_accumulation_steps=2; add data or lower it"):
        _max_steps(by_epochs, [0])
