"""The loop's arithmetic in one process: loss normalization across micro-batches, step counts, and the host
synchronizations of a step."""

from __future__ import annotations

import copy
import traceback

import pytest
import torch
from accelerate import Accelerator
from torch.overrides import TorchFunctionMode
from transformers import LlamaConfig, LlamaForCausalLM

from finetune.config import PreferenceConfig
from finetune.data import IGNORE, collate_packed, collate_padded
from finetune.data.preference import collate_pairs
from finetune.engine import attention
from finetune.objectives import Preference, Supervised
from finetune.objectives.loss import batch_loss
from finetune.run.loop import train_step


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
    from helpers import DEMO_RECIPE

    from finetune.config import load_recipe
    from finetune.errors import FinetuneError
    from finetune.run.build import max_steps_of

    by_epochs = load_recipe(
        DEMO_RECIPE,
        [
            "train.max_steps=null",
            "train.num_epochs=1.5",
            "train.global_batch_size=null",
            "train.gradient_accumulation_steps=2",
        ],
    )
    assert max_steps_of(by_epochs, list(range(10)), 2) == 8  # 5 steps per epoch
    with pytest.raises(FinetuneError, match="fewer than train.gradient_accumulation_steps=2; add data or lower it"):
        max_steps_of(by_epochs, [0], 2)


# ---- The step's host synchronizations: a GPU runs ahead of the host only if the host never waits for it.

SYNCING = {
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__int__,
    torch.Tensor.cpu, torch.Tensor.numpy, torch.nonzero, torch.Tensor.nonzero, torch.masked_select,
    torch.Tensor.masked_select, torch.unique, torch.Tensor.unique,
}  # fmt: skip
INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_, torch.Tensor.index_put}
# Host-side by design, so never a wait on a GPU: the non-fused optimizer's step counters (the loop asks for fused
# AdamW on CUDA, whose counters stay on the device) and varlen attention's per-sample SDPA, the kernel path of
# CPUs (GPUs run FlashAttention's, which takes the boundaries as a device tensor).
HOST_SIDE = ("/torch/optim/", "attention.py:_per_sample")


class SyncCounter(TorchFunctionMode):
    """Every call that makes the host wait for the device's result when the tensors live on a GPU: reading a
    value (`item`, `tolist`, `float()`, `bool()`), copying to the host, and ops whose output size depends on the
    data (`nonzero`, boolean-mask indexing). On CPU the tensors are the host's, so the calls are counted by kind."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        boolean_index = func in INDEXING and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if isinstance(args[1], tuple | list) else (args[1],))
        )
        if func in SYNCING or boolean_index:
            where = [f"{f.filename}:{f.name}" for f in traceback.extract_stack()[:-1]]
            if not any(part in frame for frame in where for part in HOST_SIDE):
                caller = next(f for f in reversed(traceback.extract_stack()[:-1]) if "/torch/" not in f.filename)
                self.calls.append(f"{func.__name__} at {caller.filename}:{caller.lineno}: {caller.line}")
        return func(*args, **(kwargs or {}))


def packed_rows(count: int, width: int = 40) -> list[dict]:
    """Rows of two samples each (positions restart), trained on part of each, as the packing collator takes them."""
    generator = torch.Generator().manual_seed(2)
    rows = []
    for n in range(count):
        first = 10 + 3 * (n % 8)
        ids = torch.randint(3, 64, (width,), generator=generator).tolist()
        targets = [t if p % 3 else IGNORE for p, t in enumerate(ids[1:] + [IGNORE])]
        positions = list(range(first)) + list(range(width - first))
        rows.append({"input_ids": ids, "target_ids": targets, "position_ids": positions, "num_tokens": width})
    return rows


def synced_calls(model, objective, micro_batches: list[dict]) -> list[str]:
    """The sync-inducing calls of one optimizer step (the second: the first measures memory)."""
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(copy.deepcopy(model), torch.optim.AdamW(model.parameters()))
    for step in (1, 2):
        with SyncCounter() as counter:
            train_step(model, optimizer, micro_batches, accelerator, max_grad_norm=1.0, step=step,
                       loss_path="chunked", objective=objective)  # fmt: skip
    return counter.calls


@pytest.mark.parametrize("objective", ["supervised", "preference"])
def test_a_step_synchronizes_the_host_once_after_its_last_backward(model, objective):
    attention.register()
    varlen = copy.deepcopy(model)
    varlen.set_attn_implementation(attention.NAME)
    if objective == "supervised":
        rows = packed_rows(4)
        micro_batches, loss = [collate_packed(rows[:2]), collate_packed(rows[2:])], Supervised("chunked")
    else:
        pairs = [{"chosen_ids": r["input_ids"][:20], "chosen_targets": r["target_ids"][:20], "rejected_ids":
                  r["input_ids"][20:], "rejected_targets": r["target_ids"][20:], "pair_index": n}
                 for n, r in enumerate(packed_rows(4))]  # fmt: skip
        micro_batches = [collate_pairs(pairs[:2], max_length=40, pad_id=0, packing=True),
                         collate_pairs(pairs[2:], max_length=40, pad_id=0, packing=True)]  # fmt: skip
        table = torch.randn(4, 2, dtype=torch.float64) - 30
        loss = Preference(PreferenceConfig(), "chunked", "precomputed", reference_logps=table)
    calls = synced_calls(varlen, loss, micro_batches)
    assert len(calls) == 1 and "on_host = " in calls[0], "\n".join(calls)
    # The batches as found on the device, without the collator's indices: the step would wait in every forward.
    found = [{k: v for k, v in b.items() if k not in ("kept_index", "cu_seq_lens")} for b in micro_batches]
    assert len(synced_calls(varlen, loss, found)) > 1 + len(micro_batches)


def test_batches_collated_by_a_worker_as_on_gpus_are_the_in_process_ones():
    """The data order is the seedable sampler's (seed, epoch), wherever the batches are collated."""
    from accelerate.utils import DataLoaderConfiguration
    from torch.utils.data import DataLoader

    from finetune.data import loader_options

    options = loader_options(torch.device("cuda"))
    assert options.pop("pin_memory") and options["num_workers"] >= 1 and loader_options(torch.device("cpu")) == {}
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    rows = packed_rows(12)
    loaders = [
        accelerator.prepare(DataLoader(rows, batch_size=4, shuffle=True, collate_fn=collate_packed,
                                       generator=torch.Generator().manual_seed(3), **extra))
        for extra in ({}, options)
    ]  # fmt: skip
    for epoch in range(2):
        for loader in loaders:
            loader.set_epoch(epoch)
        for here, there in zip(*loaders, strict=True):
            assert here.keys() == there.keys() and all(torch.equal(here[k], there[k]) for k in here), epoch


@pytest.mark.cuda
def test_on_a_gpu_a_step_waits_for_the_device_once(model):
    import traceback
    import warnings

    attention.register()
    accelerator = Accelerator(mixed_precision="bf16")
    varlen = copy.deepcopy(model)
    varlen.set_attn_implementation(attention.NAME)
    optimizer = torch.optim.AdamW(varlen.parameters(), fused=True)
    varlen, optimizer = accelerator.prepare(varlen, optimizer)
    rows = packed_rows(4)
    micro_batches = [
        {k: v.pin_memory().to("cuda", non_blocking=True) for k, v in collate_packed(part).items()}
        for part in (rows[:2], rows[2:])
    ]
    train_step(varlen, optimizer, micro_batches, accelerator, max_grad_norm=1.0, step=1, loss_path="chunked")
    torch.cuda.synchronize()
    syncs: list[str] = []  # where each one was called from: the Python frames nearest to it

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.endswith("warnings.py")]
            syncs.append("".join(traceback.format_list(frames[-5:])))

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            train_step(varlen, optimizer, micro_batches, accelerator, max_grad_norm=1.0, step=2, loss_path="chunked")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(syncs) == 1, "\n\n".join(syncs)
