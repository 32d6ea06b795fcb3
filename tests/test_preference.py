"""Preference tuning's pieces in one process: pairs tokenized through the chat path, packed or padded into
one forward, per-sequence log-probabilities from the chunked head equal to the full logits', and each loss
equal to what TRL computes for the same log-probabilities; TRL's DPOTrainer, end to end, as the oracle of the
log-probabilities and losses of our tokenized pairs, and of where its own tokenization trains other tokens."""

from __future__ import annotations

import copy
import shutil
import subprocess
import sys
import types
from pathlib import Path

import datasets
import pytest
import torch
import yaml
from helpers import DEMO_RECIPE, REPO, LaunchedRun, launch, recipe_overrides
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from finetune.config import DataConfig, PreferenceConfig
from finetune.data import IGNORE
from finetune.data.pack import balanced_rows
from finetune.data.preference import collate_pairs, collate_sequences, prepare_pairs
from finetune.errors import FinetuneError
from finetune.objectives.loss import sequence_logps
from finetune.objectives.preference import pair_losses


@pytest.fixture(scope="module")
def tokenizer(demo_assets):
    return AutoTokenizer.from_pretrained(demo_assets / "base")


@pytest.fixture(scope="module")
def base_tokenizer(tokenizer):
    return tokenizer


def turn(role: str, content: str) -> dict:
    return {"role": role, "content": content}


def pairs_of(samples: list[dict], tokenizer, max_length: int = 64, first_index: int = 0):
    cfg = DataConfig(train_path="x", max_length=max_length)
    return prepare_pairs([(None, datasets.Dataset.from_list(samples))], tokenizer, cfg, [None], first_index)


def test_each_side_is_the_conversation_as_rendered_with_its_last_reply_trained(tokenizer):
    prompt = [turn("user", "reverse: 1 2 3")]
    sample = {"prompt": prompt, "chosen": [turn("assistant", "3 2 1")], "rejected": [turn("assistant", "3 1 2")]}
    pairs, stats = pairs_of([sample], tokenizer)
    [row] = pairs.to_list()
    for side, reply in (("chosen", "3 2 1"), ("rejected", "3 1 2")):
        text = tokenizer.apply_chat_template([*prompt, turn("assistant", reply)], tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert row[f"{side}_ids"] == ids[: len(row[f"{side}_ids"])]  # the rendering, tokenized once
        trained = [t for t in row[f"{side}_targets"] if t != IGNORE]
        assert tokenizer.decode(trained) == f"{reply}<|end|>"  # the reply and its end-of-turn, nothing else
    assert stats.num_pairs == 1 and row["pair_index"] == 0
    # ultrafeedback_binarized's layout: a prompt string and whole conversations; the same tokens
    whole = {"prompt": "reverse: 1 2 3", "chosen": prompt + sample["chosen"], "rejected": prompt + sample["rejected"]}
    [same] = pairs_of([whole], tokenizer)[0].to_list()
    assert same == row


def test_text_pairs_get_bos_and_eos_once(tokenizer):
    [row] = pairs_of([{"prompt": "reverse: 4 5", "chosen": " 5 4", "rejected": " 4 5"}], tokenizer)[0].to_list()
    expected = tokenizer("reverse: 4 5")["input_ids"] + tokenizer(" 5 4", add_special_tokens=False)["input_ids"]
    assert row["chosen_ids"] == expected + [tokenizer.eos_token_id]
    assert row["chosen_ids"].count(tokenizer.eos_token_id) == 1


def test_long_prompts_are_cut_from_the_left_and_pairs_that_cannot_fit_are_dropped(tokenizer):
    prompt = [turn("user", " ".join(["7"] * 40))]
    fits = {"prompt": prompt, "chosen": [turn("assistant", "1")], "rejected": [turn("assistant", "2")]}
    too_long = {"prompt": prompt, "chosen": [turn("assistant", " ".join(["9"] * 40))], "rejected": fits["chosen"]}
    same = {"prompt": [turn("user", "x")], "chosen": fits["chosen"], "rejected": fits["chosen"]}
    pairs, stats = pairs_of([fits, too_long, same], tokenizer, max_length=24)
    assert (stats.num_pairs, stats.num_truncated, stats.num_too_long, stats.num_identical) == (1, 1, 1, 1)
    [row] = pairs.to_list()
    assert len(row["chosen_ids"]) <= 24 and tokenizer.decode([t for t in row["chosen_targets"] if t != IGNORE]) == (
        "1<|end|>"
    )
    with pytest.raises(FinetuneError, match="none of the 2 pairs can be trained"):
        pairs_of([too_long, same], tokenizer, max_length=24)


def trained_text(row: dict, side: str, tokenizer) -> str:
    return tokenizer.decode([t for t in row[f"{side}_targets"] if t != IGNORE])


def test_a_text_prompt_beside_replies_alone_is_the_users_turn(tokenizer):
    """TRL's layouts all train one pair alike: the prompt as messages, as text beside the replies alone, as text
    beside whole conversations (ultrafeedback_binarized), and as messages the conversations repeat."""
    prompt, chosen, rejected = (
        [turn("user", "reverse: 1 2 3")],
        [turn("assistant", "3 2 1")],
        [turn("assistant", "1 2 3")],
    )
    layouts = [
        {"prompt": prompt, "chosen": chosen, "rejected": rejected},
        {"prompt": "reverse: 1 2 3", "chosen": chosen, "rejected": rejected},
        {"prompt": "reverse: 1 2 3", "chosen": prompt + chosen, "rejected": prompt + rejected},
        {"prompt": prompt, "chosen": prompt + chosen, "rejected": prompt + rejected},
        {"chosen": prompt + chosen, "rejected": prompt + rejected},
    ]
    rows = [pairs_of([layout], tokenizer)[0].to_list() for layout in layouts]
    assert all(row == rows[0] for row in rows)
    assert tokenizer.decode(rows[0][0]["chosen_ids"]).startswith("<|bos|><|user|>reverse: 1 2 3<|end|><|assistant|>")
    other = {"prompt": "reverse: 9 9", "chosen": prompt + chosen, "rejected": prompt + rejected}
    with pytest.raises(FinetuneError, match="sample 0: prompt is text, but chosen and rejected are conversations"):
        pairs_of([other], tokenizer)


def test_multi_turn_completions_compare_every_reply_after_the_shared_prompt(tokenizer):
    """TRL's conversational pairs whose completions run several turns: what follows the shared prompt is compared,
    its assistant replies exactly (the user turns between them are context, as in supervised chat data)."""
    prompt = [turn("user", "reverse: 1 2")]
    chosen = [turn("assistant", "2 1"), turn("user", "again: 3 4"), turn("assistant", "4 3")]
    rejected = [turn("assistant", "1 2"), turn("user", "now: 5 6"), turn("assistant", "5 6")]
    [row] = pairs_of([{"prompt": prompt, "chosen": chosen, "rejected": rejected}], tokenizer)[0].to_list()
    assert trained_text(row, "chosen", tokenizer) == "2 1<|end|>4 3<|end|>"
    assert trained_text(row, "rejected", tokenizer) == "1 2<|end|>5 6<|end|>"
    history = [*prompt, turn("assistant", "2 1"), turn("user", "again: 3 4")]
    [last] = pairs_of([{"prompt": history, "chosen": chosen[2:], "rejected": rejected[2:]}], tokenizer)[0].to_list()
    assert trained_text(last, "chosen", tokenizer) == "4 3<|end|>"  # a reply in the prompt is context only
    [same] = pairs_of([{"chosen": prompt + chosen, "rejected": prompt + rejected}], tokenizer)[0].to_list()
    assert same == row


def test_a_completion_whose_replies_a_template_cannot_locate_together_names_a_preference_fix(tokenizer):
    summarizing = AutoTokenizer.from_pretrained(tokenizer.name_or_path)  # earlier replies written as a summary
    summarizing.chat_template = (
        "{%- for m in messages %}{% if m.role == 'assistant' and not loop.last %}"
        "{{- '<|assistant|>(earlier)<|end|>' }}{% else %}{{- '<|' + m.role + '|>' + m.content + '<|end|>' }}"
        "{% endif %}{% endfor %}"
    )
    prompt = [turn("user", "reverse: 1 2")]
    chosen = [turn("assistant", "2 1"), turn("user", "again: 3 4"), turn("assistant", "4 3")]
    rejected = [turn("assistant", "1 2"), turn("user", "again: 3 4"), turn("assistant", "3 4")]
    with pytest.raises(FinetuneError, match=r"\(chosen\); a pair's completion is compared as one rendering: give"):
        pairs_of([{"prompt": prompt, "chosen": chosen, "rejected": rejected}], summarizing)


def test_reasoning_is_compared_unless_data_keeps_it_as_context(tokenizer):
    sample = {
        "prompt": [turn("user", "reverse: 1 2")],
        "chosen": [turn("assistant", "<think>flip it</think>2 1")],
        "rejected": [turn("assistant", "<think>keep it</think>1 2")],
    }
    cfg = DataConfig(train_path="x", max_length=64, train_on_reasoning=False)
    pairs, stats = prepare_pairs([(None, datasets.Dataset.from_list([sample]))], tokenizer, cfg, [None])
    [row] = pairs.to_list()
    assert "flip it" in tokenizer.decode(row["chosen_ids"]) and "flip" not in trained_text(row, "chosen", tokenizer)
    assert trained_text(row, "rejected", tokenizer).endswith("1 2<|end|>")
    assert stats.num_reasoning_tokens > 0 and "(context only, not compared)" in stats.describe("train")
    [compared] = pairs_of([sample], tokenizer)[0].to_list()
    assert "flip it" in trained_text(compared, "chosen", tokenizer)


def test_reasoning_in_text_replies_is_kept_as_context_like_a_conversations(tokenizer):
    """Text pairs (prompt, chosen and rejected as text): a reply's leading <think> block is reasoning too, compared
    unless data.train_on_reasoning=false, where it stays in the ids only (both sides keep the same prompt)."""
    sample = {"prompt": "reverse: 1 2", "chosen": "<think>flip it</think>2 1", "rejected": "<think>keep it</think>1 2"}
    cfg = DataConfig(train_path="x", max_length=64, train_on_reasoning=False)
    pairs, stats = prepare_pairs([(None, datasets.Dataset.from_list([sample]))], tokenizer, cfg, [None])
    [row] = pairs.to_list()
    assert tokenizer.decode(row["chosen_ids"]).endswith("reverse: 1 2<think>flip it</think>2 1<|end|>")
    assert trained_text(row, "chosen", tokenizer) == "<think></think>2 1<|end|>"
    assert trained_text(row, "rejected", tokenizer) == "<think></think>1 2<|end|>"
    assert stats.num_reasoning_tokens > 0 and "(context only, not compared)" in stats.describe("train")
    [compared] = pairs_of([sample], tokenizer)[0].to_list()
    assert trained_text(compared, "chosen", tokenizer) == "<think>flip it</think>2 1<|end|>"
    with pytest.raises(FinetuneError, match="sample 0"):
        prepare_pairs([(None, datasets.Dataset.from_list([{**sample, "chosen": "<think>never closed"}]))],
                      tokenizer, cfg, [None])  # fmt: skip


def test_truncation_drop_drops_pairs_whose_prompt_would_be_cut(tokenizer):
    prompt = [turn("user", " ".join(["7"] * 40))]
    long = {"prompt": prompt, "chosen": [turn("assistant", "1")], "rejected": [turn("assistant", "2")]}
    short = {"prompt": [turn("user", "7")], "chosen": long["chosen"], "rejected": long["rejected"]}
    cfg = DataConfig(train_path="x", max_length=24, truncation="drop")
    pairs, stats = prepare_pairs([(None, datasets.Dataset.from_list([long, short]))], tokenizer, cfg, [None])
    assert (stats.num_pairs, stats.num_truncated, stats.num_too_long) == (1, 0, 1)
    assert len(pairs) == 1 and "7 7" not in tokenizer.decode(pairs[0]["chosen_ids"])


def test_invalid_drop_leaves_out_a_bad_pair_and_stops_past_one_percent(tokenizer):
    good = {"prompt": [turn("user", "reverse: 1 2")], "chosen": [turn("assistant", "2 1")],
            "rejected": [turn("assistant", "1 2")]}  # fmt: skip
    bad = {**good, "rejected": [turn("user", "not a reply")]}
    cfg = DataConfig(train_path="x", max_length=64, invalid="drop")
    data = datasets.Dataset.from_list([good] * 150 + [bad] + [good] * 49)
    pairs, stats = prepare_pairs([(None, data)], tokenizer, cfg, [None])
    assert (len(pairs), stats.num_pairs, stats.num_invalid, stats.num_too_long) == (199, 199, 1, 0)
    assert "1 invalid dropped (first: sample 150: rejected must end with the assistant reply" in stats.describe("x")
    with pytest.raises(FinetuneError, match="3 of its 200 samples are invalid"):
        prepare_pairs([(None, datasets.Dataset.from_list([good] * 197 + [bad] * 3))], tokenizer, cfg, [None])
    with pytest.raises(FinetuneError, match="sample 150: rejected must end with the assistant reply"):
        pairs_of([good] * 150 + [bad], tokenizer)  # data.invalid=refuse, the default


@pytest.mark.parametrize(
    ("sample", "message"),
    [
        ({"prompt": [turn("user", "a")], "chosen": [turn("assistant", "b")], "rejected": [turn("user", "c")]},
         "sample 0: rejected must end with the assistant reply"),
        ({"chosen": [turn("user", "a"), turn("assistant", "b")],
          "rejected": [turn("user", "z"), turn("assistant", "c")]},
         "sample 0: chosen and rejected have different prompts"),
        ({"prompt": "a", "chosen": "b", "rejected": 3}, "sample 0: rejected must be a list of messages or text"),
        ({"prompt": "a", "chosen": "b"}, "preference data needs chosen and rejected columns"),
    ],
)  # fmt: skip
def test_bad_pairs_name_the_sample(tokenizer, sample, message):
    with pytest.raises(FinetuneError, match=message):
        pairs_of([sample], tokenizer)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=128)  # fmt: skip
    return LlamaForCausalLM(config)


def random_rows(count: int) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    rows = []
    for n in range(count):
        sides = {}
        for side in ("chosen", "rejected"):
            prompt, reply = (
                torch.randint(3, 96, (5 + n,), generator=generator).tolist(),
                torch.randint(3, 96, (2 + 2 * n,), generator=generator).tolist(),
            )
            sides[f"{side}_ids"] = prompt + reply
            sides[f"{side}_targets"] = [IGNORE] * (len(prompt) - 1) + reply + [IGNORE]
        rows.append({**sides, "pair_index": n})
    return rows


def test_sequence_logps_packed_or_padded_chunked_or_full_are_one_value_and_one_gradient(model):
    rows = random_rows(4)
    results = {}
    for packing in (True, False):
        batch = collate_pairs(rows, max_length=40, pad_id=0, packing=packing)
        if packing:
            assert batch["input_ids"].shape[0] < 8  # sequences share rows
        for path in ("chunked", "full_logits"):
            copied = copy.deepcopy(model)
            logps = sequence_logps(copied, batch, path)
            weights = torch.linspace(-1, 1, logps.shape[0])
            (logps * weights).sum().backward()  # a different weight per sequence, as a preference loss has
            results[packing, path] = (logps.detach(), [p.grad.clone() for p in copied.parameters()])
    reference_logps, reference_grads = results[False, "full_logits"]
    # the reference by hand: each sequence alone, full logits
    for n, row in enumerate(rows):
        ids = torch.tensor([row["chosen_ids"]])
        logits = model(input_ids=ids).logits[0].float().log_softmax(-1)
        targets = torch.tensor(row["chosen_targets"])
        kept = targets != IGNORE
        assert logits[kept].gather(1, targets[kept].unsqueeze(1)).sum().item() == pytest.approx(
            reference_logps[n].item(), abs=1e-5
        )
    for logps, grads in results.values():
        torch.testing.assert_close(logps, reference_logps, atol=1e-5, rtol=0)
        for grad, reference in zip(grads, reference_grads, strict=True):
            torch.testing.assert_close(grad, reference, atol=1e-5, rtol=1e-4)


def test_packed_sequences_spread_over_rows_of_about_equal_length():
    """A micro-batch's rows are as wide as its longest: spread over rows of about equal length, these sequences leave
    no slot empty, where first fit (120+110, 100+90+60, 80+70+50+40, 30) pads 274 of 1,024 slots."""
    lengths = [120, 110, 100, 90, 80, 70, 60, 50, 40, 30]
    rows = balanced_rows(lengths, capacity=256)
    assert sorted(n for row in rows for n in row) == list(range(10))
    assert [sum(lengths[n] for n in row) for row in rows] == [150] * 5
    assert balanced_rows([256, 256, 1], capacity=256) == [[0], [1], [2]]  # none past the capacity
    sequences = [(list(range(3, 3 + length)), [IGNORE] * (length - 1) + [1]) for length in lengths]
    batch = collate_sequences(sequences, max_length=256, pad_id=0, packing=True)
    assert batch["input_ids"].shape == (5, 150) and batch["row_tokens"].tolist() == [150] * 5
    assert batch["input_ids"].flatten()[batch["last_index"]].tolist() == [2 + length for length in lengths]


def trl_cpo(loss_type: str, beta: float, smoothing: float = 0.0, gamma: float = 0.5):
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    owner = types.SimpleNamespace(
        loss_type=loss_type, beta=beta, label_smoothing=smoothing, simpo_gamma=gamma, alpha=0.0,
        accelerator=types.SimpleNamespace(device="cpu"),
    )  # fmt: skip
    return lambda chosen, rejected: CPOTrainer.cpo_loss(owner, chosen, rejected)


LOGPS = torch.tensor([-12.0, -30.5, -8.25, -41.0]), torch.tensor([-14.5, -28.0, -20.0, -39.5])
REFERENCE = torch.tensor([-13.0, -29.0, -9.0, -40.0]), torch.tensor([-13.5, -29.5, -18.0, -40.5])
TOKENS = torch.tensor([6.0, 15.0, 4.0, 20.0]), torch.tensor([7.0, 13.0, 9.0, 21.0])


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_dpo_and_ipo_equal_their_definitions_as_trl_writes_them(smoothing):
    (chosen, rejected), (ref_chosen, ref_rejected), (ct, rt) = LOGPS, REFERENCE, TOKENS
    beta = 0.1
    ours = pair_losses(PreferenceConfig(beta=beta, label_smoothing=smoothing), chosen, rejected, ref_chosen,
                       ref_rejected, ct, rt)  # fmt: skip
    # TRL's CPO "sigmoid" loss is DPO's with the reference's log-ratios folded in (cDPO's smoothing included)
    margins = (chosen - ref_chosen) - (rejected - ref_rejected)
    trl_losses, *_ = trl_cpo("sigmoid", beta, smoothing)(margins, torch.zeros(4))
    torch.testing.assert_close(ours.losses, trl_losses, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.chosen_rewards, beta * (chosen - ref_chosen))
    if smoothing == 0:  # TRL's DPOTrainer: -logsigmoid(beta * delta)
        torch.testing.assert_close(ours.losses, -torch.nn.functional.logsigmoid(beta * margins))
    # IPO as TRL's DPOTrainer computes it: log-ratios averaged per completion token
    ipo = pair_losses(PreferenceConfig(loss="ipo", beta=beta), chosen, rejected, ref_chosen, ref_rejected, ct, rt)
    delta = (chosen - ref_chosen) / ct - (rejected - ref_rejected) / rt
    torch.testing.assert_close(ipo.losses, (delta - 1 / (2 * beta)) ** 2)
    ln2 = pair_losses(PreferenceConfig(), chosen, rejected, chosen, rejected, ct, rt).losses
    torch.testing.assert_close(
        ln2, torch.full((4,), 0.693147), atol=1e-6, rtol=0
    )  # the first step, reference = policy


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_simpo_equals_trls(smoothing):
    (chosen, rejected), (ct, rt) = LOGPS, TOKENS
    cfg = PreferenceConfig(loss="simpo", beta=2.0, simpo_gamma=0.8, label_smoothing=smoothing)
    ours = pair_losses(cfg, chosen, rejected, None, None, ct, rt)
    trl_losses, trl_chosen, trl_rejected = trl_cpo("simpo", 2.0, smoothing, 0.8)(chosen / ct, rejected / rt)
    torch.testing.assert_close(ours.losses, trl_losses, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.chosen_rewards, trl_chosen)


def test_orpo_equals_trls():
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    (chosen, rejected), (ct, rt) = LOGPS, TOKENS
    owner = types.SimpleNamespace(beta=0.25, accelerator=types.SimpleNamespace(device="cpu"))
    ratio_losses, trl_chosen, *_ = ORPOTrainer.odds_ratio_loss(owner, chosen / ct, rejected / rt)
    ours = pair_losses(PreferenceConfig(loss="orpo", beta=0.25), chosen, rejected, None, None, ct, rt)
    # TRL's loss is its NLL term minus the odds-ratio term; the NLL of each pair is its chosen reply's mean
    torch.testing.assert_close(ours.losses, -chosen / ct - ratio_losses, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.chosen_rewards, trl_chosen)


# ---- TRL's DPOTrainer as the oracle, end to end: tokenization, per-sequence log-probs, losses.

ORACLE_PAIRS = [
    {"prompt": [turn("user", "reverse: 1 2 3")], "chosen": [turn("assistant", "3 2 1")],
     "rejected": [turn("assistant", "3 1 2")]},
    {"prompt": [turn("system", "Be brief."), turn("user", "reverse: 4 5"), turn("assistant", "5 4"),
                turn("user", "and 6 7 8")],
     "chosen": [turn("assistant", "8 7 6")], "rejected": [turn("assistant", "8 6 7 6")]},
]  # fmt: skip


def trl_dpo(tokenizer, pairs: datasets.Dataset, loss_type: str):
    """TRL's DPOTrainer on a tiny Llama over `tokenizer`'s vocabulary, with a reference perturbed away from the
    policy (so the losses are not all ln 2)."""
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=256)  # fmt: skip
    policy = LlamaForCausalLM(config)
    reference = copy.deepcopy(policy)
    with torch.no_grad():
        for parameter in reference.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    args = DPOConfig(output_dir="unused", per_device_train_batch_size=1, use_cpu=True, report_to=[], beta=0.1,
                     loss_type=[loss_type], max_length=None, bf16=False)  # fmt: skip
    return DPOTrainer(model=policy, ref_model=reference, args=args, train_dataset=pairs, processing_class=tokenizer)


def trl_values(trainer, row: dict) -> tuple[float, float, float]:
    """TRL's summed log-probs of the chosen and rejected completion, and its loss, for one tokenized pair."""
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, trainer.data_collator([row]), return_outputs=False)
    metrics = trainer._metrics["train"]
    return metrics["logps/chosen"][-1], metrics["logps/rejected"][-1], loss.item()


def as_trl_row(row: dict) -> dict:
    """Our tokenized pair in TRL's columns: the prompt up to the first trained token, each completion after it."""
    out = {}
    for side in ("chosen", "rejected"):
        ids, targets = row[f"{side}_ids"], row[f"{side}_targets"]
        first = next(n for n, t in enumerate(targets) if t != IGNORE) + 1  # targets are the next token's
        assert all(t != IGNORE for t in targets[first - 1 : -1])  # the trained tokens end the sequence
        out["prompt_ids"], out[f"{side}_ids"] = ids[:first], ids[first:]
    return out


# TRL tokenizes the prompt alone (with the generation prompt) and the whole conversation, and trains whatever
# follows their common prefix: on these templates that adds what the template writes after the reply's end of
# turn, or (Mistral's, which moves the system prompt into the last user turn) starts inside the prompt.
TRL_TRAINS_MORE = {"demo": [], "llama-3.1": [], "qwen-2.5": ["\n"], "gemma-3": ["\n"], "phi-3": ["\n<|endoftext|>"],
                   "mistral-v0.3": [None]}  # fmt: skip


@pytest.mark.parametrize("family", list(TRL_TRAINS_MORE))
def test_trl_dpo_trainer_computes_our_log_probs_and_losses_and_shows_where_it_tokenizes_otherwise(
    base_tokenizer, family
):
    from test_chat_templates import family_tokenizer

    tokenizer = base_tokenizer if family == "demo" else family_tokenizer(base_tokenizer, family)
    data = datasets.Dataset.from_list(ORACLE_PAIRS)
    ours = pairs_of(ORACLE_PAIRS, tokenizer, max_length=256)[0].to_list()
    for loss_type, loss in (("sigmoid", "dpo"), ("ipo", "ipo")):
        trainer = trl_dpo(tokenizer, data, loss_type)
        batch = collate_pairs(ours, max_length=256, pad_id=0, packing=True)
        with torch.no_grad():
            policy, reference = (sequence_logps(m, batch, "chunked") for m in (trainer.model, trainer.ref_model))
        tokens = torch.tensor([[sum(t != IGNORE for t in row[f"{side}_targets"]) for row in ours]
                               for side in ("chosen", "rejected")], dtype=torch.float32)  # fmt: skip
        pairs = len(ours)
        losses = pair_losses(PreferenceConfig(loss=loss, beta=0.1), policy[:pairs], policy[pairs:], reference[:pairs],
                             reference[pairs:], tokens[0], tokens[1]).losses  # fmt: skip
        for n, (row, trl_row) in enumerate(zip(ours, trainer.train_dataset, strict=True)):
            # Given our tokens, TRL's trainer computes our log-probs and our loss.
            chosen, rejected, trl_loss = trl_values(trainer, as_trl_row(row))
            assert chosen == pytest.approx(policy[n].item(), abs=1e-5)
            assert rejected == pytest.approx(policy[pairs + n].item(), abs=1e-5)
            assert trl_loss == pytest.approx(losses[n].item(), rel=1e-5, abs=1e-5)  # fp32 (IPO: ~25)
            if loss != "dpo":
                continue
            # Its own tokenization: ours is the rendered conversation, trained from the reply to its end of turn.
            same_tokens = True
            for side in ("chosen", "rejected"):
                ids, targets = row[f"{side}_ids"], row[f"{side}_targets"]
                rendered = tokenizer.apply_chat_template(ORACLE_PAIRS[n]["prompt"] + ORACLE_PAIRS[n][side],
                                                         tokenize=False)  # fmt: skip
                assert ids == tokenizer(rendered, add_special_tokens=False)["input_ids"][: len(ids)]
                reply = ORACLE_PAIRS[n][side][0]["content"]
                assert tokenizer.decode([t for t in targets if t != IGNORE]).strip() == reply + tokenizer.decode(
                    ids[-1]
                )
                theirs = trl_row["prompt_ids"] + trl_row[f"{side}_ids"]
                same_tokens &= theirs == ids and trl_row["prompt_ids"] == as_trl_row(row)["prompt_ids"]
                [extra] = TRL_TRAINS_MORE[family] or [""]
                if extra is None:  # Mistral: the two renderings part inside the prompt when there is a system turn
                    starts_in_prompt = len(trl_row["prompt_ids"]) < len(as_trl_row(row)["prompt_ids"])
                    assert starts_in_prompt == (n == 1), tokenizer.decode(trl_row[f"{side}_ids"])
                    continue
                assert theirs == ids + tokenizer(extra, add_special_tokens=False)["input_ids"]
            trl_chosen, _, _ = trl_values(trainer, trl_row)
            assert same_tokens == (not TRL_TRAINS_MORE[family] or family == "mistral-v0.3" and n == 0)
            if not same_tokens:
                assert trl_chosen < policy[n].item() - 1e-3  # the extra tokens' log-probs are in TRL's sum
            else:
                assert trl_chosen == pytest.approx(policy[n].item(), abs=1e-5)


# ---- Real runs: 2 CPU processes through accelerate launch, sharing a few launches between assertions.

DPO = {
    "data.train_path": "{pairs}/pairs_train.jsonl", "data.eval_path": "{pairs}/pairs_eval.jsonl",
    "data.format": "auto", "preference.loss": "dpo", "preference.beta": 0.1, "optim.lr": "1e-3",
    "optim.warmup_steps": 0, "train.max_steps": 8, "train.micro_batch_size": 4, "train.eval_every_steps": 4,
    "checkpoint.save_every_steps": 4, "checkpoint.keep_last": 2,
}  # fmt: skip


def demo_pairs(assets: Path) -> Path:
    """The demo's first 64 training and 16 held-out pairs, in a folder of their own beside its data: the runs train
    8 steps of 8 pairs, one epoch of these, and a precomputed reference scores every pair before step 1."""
    folder = assets / "pairs-64"
    if not folder.exists():
        partial = folder.with_suffix(".partial")
        partial.mkdir()
        for name, count in (("pairs_train.jsonl", 64), ("pairs_eval.jsonl", 16)):
            lines = (assets / "data" / name).read_text().splitlines(keepends=True)[:count]
            (partial / name).write_text("".join(lines))
        partial.rename(folder)
    return folder


def preference_run(
    tmp_path, assets, config="fsdp2_full_shard.yaml", processes=2, launch_args: tuple[str, ...] = (), **extra
) -> LaunchedRun:
    output_dir = tmp_path / "out"
    values = {key: str(value).format(pairs=demo_pairs(assets)) for key, value in {**DPO, **extra}.items()}
    overrides = recipe_overrides(assets, output_dir, **values)
    result = launch(config, overrides, num_processes=processes, launch_args=launch_args)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return LaunchedRun(result, output_dir)


@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory, demo_assets) -> LaunchedRun:
    """Full DPO under FSDP2 on 2 processes: precomputed reference, packed pairs, 8 steps of 8 pairs."""
    return preference_run(tmp_path_factory.mktemp("dpo"), demo_assets)


@pytest.mark.multiprocess
def test_dpo_starts_at_ln2_logs_its_metrics_and_exports_the_trained_model(dpo_run):
    metrics = dpo_run.metrics()
    losses = {m["step"]: m for m in metrics if "loss" in m}
    assert sorted(losses) == list(range(1, 9))
    assert losses[1]["loss"] == pytest.approx(0.693147, abs=1e-6)  # the reference is the initial policy
    assert losses[1]["rewards/margins"] == pytest.approx(0.0, abs=1e-6) and losses[1]["pairs"] == 8
    for name in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "logps/chosen", "logps/rejected"):
        assert name in losses[8]
    evaluated = [m for m in metrics if "eval_loss" in m]
    assert [m["step"] for m in evaluated] == [4, 8] and "eval_rewards/accuracies" in evaluated[-1]
    assert "reference: log-probabilities of 80 pairs precomputed with the initial weights" in dpo_run.log
    assert (dpo_run.output_dir / "reference_logps.safetensors").is_file()
    assert losses[8]["rewards/margins"] != 0.0 and 0.0 <= losses[8]["rewards/accuracies"] <= 1.0
    script = (
        "import sys, torch; from safetensors.torch import load_file; from transformers import AutoModelForCausalLM; "
        "ref = load_file(sys.argv[2]); model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval(); "
        "torch.no_grad().__enter__(); logits = model(input_ids=ref['input_ids']).logits; "
        "print((logits - ref['logits']).abs().max().item())"
    )
    args = [str(dpo_run.output_dir / "final"), str(dpo_run.output_dir / "final_logits.safetensors")]
    reloaded = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
    assert reloaded.returncode == 0 and float(reloaded.stdout.split()[-1]) <= 1e-5, reloaded.stderr[-2000:]


@pytest.mark.multiprocess
def test_one_process_with_eight_micro_batches_equals_two_processes_with_four(dpo_run, demo_assets, tmp_path):
    """The loss of a step is the mean over all its pairs, whatever the split: 1 x 1 x 8 (processes x
    micro-batch x accumulation) against the fixture's 2 x 4 x 1."""
    single = preference_run(tmp_path, demo_assets, processes=1, **{
        "train.micro_batch_size": 1, "train.gradient_accumulation_steps": 8, "train.eval_every_steps": 0,
        "checkpoint.save_every_steps": 0,
    })  # fmt: skip
    ours = {m["step"]: m for m in single.metrics() if "loss" in m}
    theirs = {m["step"]: m for m in dpo_run.metrics() if "loss" in m}
    assert sorted(ours) == sorted(theirs)
    for step, logged in ours.items():
        assert logged["loss"] == pytest.approx(theirs[step]["loss"], abs=1e-5), step
        assert logged["grad_norm"] == pytest.approx(theirs[step]["grad_norm"], rel=1e-4), step
    # 8 AdamW steps (lr 1e-3) amplify float rounding where a gradient is near 0: the weights agree to 1e-4 (a
    # mean of per-micro-batch means instead of the mean over pairs would differ in the loss at step 1 already).
    a = load_file(single.output_dir / "final" / "model.safetensors")
    b = load_file(dpo_run.output_dir / "final" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-4


@pytest.mark.multiprocess
def test_pairs_split_over_a_sequence_group_train_what_whole_pairs_train(dpo_run, demo_assets, tmp_path):
    """sp=2: each process holds half of every pair's sequences; the group adds up their log-probabilities (the
    precomputed reference's too), so losses, eval metrics and weights are those of whole pairs (the fixture: 2
    data-parallel processes of 4 pairs)."""
    data = tmp_path / "pairs"  # a copy, so that no cached reference is found: the group computes its own
    data.mkdir()
    for name in ("pairs_train.jsonl", "pairs_eval.jsonl"):
        shutil.copy(demo_pairs(demo_assets) / name, data / name)
    split = preference_run(
        tmp_path, demo_assets, config="sequence_parallel.yaml",
        launch_args=("--parallelism_config_sp_size", "2"),
        **{
            "train.micro_batch_size": 8, "model.attn_implementation": "varlen", "checkpoint.save_every_steps": 0,
            "data.train_path": data / "pairs_train.jsonl", "data.eval_path": data / "pairs_eval.jsonl",
        },
    )  # fmt: skip
    assert "rows split over sequence groups of 2" in split.log
    assert "reference: log-probabilities of 80 pairs precomputed" in split.log
    ours, theirs = split.metrics(), dpo_run.metrics()
    for key in ("loss", "eval_loss"):
        mine, fixture = [m for m in ours if key in m], [m for m in theirs if key in m]
        assert [m["step"] for m in mine] == [m["step"] for m in fixture]
        for a, b in zip(mine, fixture, strict=True):
            assert a[key] == pytest.approx(b[key], abs=1e-5)
            accuracy = key.replace("loss", "rewards/accuracies")
            assert a[accuracy] == pytest.approx(b[accuracy], abs=1e-6)
    assert [m["pairs"] for m in ours if "loss" in m] == [8] * 8
    a = load_file(split.output_dir / "final" / "model.safetensors")
    b = load_file(dpo_run.output_dir / "final" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-4


@pytest.mark.multiprocess
@pytest.mark.parametrize(("processes", "tolerance"), [(2, 0.0), (1, 1e-5)])
def test_resume_is_exact_and_reads_the_precomputed_reference(dpo_run, demo_assets, tmp_path, processes, tolerance):
    output_dir = tmp_path / "out"
    shutil.copytree(dpo_run.output_dir / "checkpoints" / "step_4", output_dir / "checkpoints" / "step_4")
    shutil.copy(dpo_run.output_dir / "reference_logps.safetensors", output_dir)
    resumed = preference_run(tmp_path, demo_assets, processes=processes, **{
        "checkpoint.resume": "auto", "train.micro_batch_size": 8 // processes,
    })  # fmt: skip
    assert "precomputed with the initial weights" not in resumed.log  # read, never recomputed from trained weights
    expected = {m["step"]: m["loss"] for m in dpo_run.metrics() if "loss" in m}
    losses = {m["step"]: m["loss"] for m in resumed.metrics() if "loss" in m}
    assert sorted(losses) == [5, 6, 7, 8]
    for step, loss in losses.items():
        assert abs(loss - expected[step]) <= tolerance, (step, loss, expected[step])


@pytest.mark.multiprocess
def test_a_resume_without_its_reference_or_from_a_supervised_checkpoint_is_refused(dpo_run, one_process_run, tmp_path):
    def train(output_dir, *extra):
        overrides = [f"{key}={value}" for key, value in DPO.items() if not key.startswith("data.")]
        command = [sys.executable, "-m", "finetune", "train", str(DEMO_RECIPE), *overrides, "data.format=auto",
                   f"output.dir={output_dir}", "checkpoint.resume=auto", *extra]  # fmt: skip
        return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)

    supervised = tmp_path / "supervised"
    shutil.copytree(one_process_run.output_dir / "checkpoints" / "step_8", supervised / "checkpoints" / "step_8")
    recipe = yaml.safe_load((dpo_run.output_dir / "recipe.yaml").read_text())
    data = [f"data.{key}={recipe['data'][key]}" for key in ("train_path", "eval_path")]
    result = train(supervised, *data, f"model.name_or_path={recipe['model']['name_or_path']}")
    assert result.returncode == 2 and "is of a supervised run, and this recipe trains preference" in result.stderr
    assert "Traceback" not in result.stderr
    without = tmp_path / "without_reference"
    shutil.copytree(dpo_run.output_dir / "checkpoints" / "step_4", without / "checkpoints" / "step_4")
    result = train(without, *data, f"model.name_or_path={recipe['model']['name_or_path']}")
    assert result.returncode == 2 and "reference_logps.safetensors (the reference log-probabilities" in result.stderr
    assert sorted(p.name for p in without.iterdir()) == ["checkpoints"]  # nothing written


@pytest.fixture(scope="module")
def lora_dpo_run(tmp_path_factory, demo_assets) -> LaunchedRun:
    """DPO with LoRA adapters under FSDP2 on 2 processes: the reference is the model with its adapters off."""
    return preference_run(tmp_path_factory.mktemp("lora_dpo"), demo_assets, **{
        "peft.r": 8, "train.max_steps": 4, "checkpoint.save_every_steps": 0, "train.eval_every_steps": 0,
        "optim.lr": "5e-3",
    })  # fmt: skip


@pytest.mark.multiprocess
def test_lora_dpo_uses_the_base_as_its_reference_and_exports_the_adapter(lora_dpo_run):
    losses = {m["step"]: m for m in lora_dpo_run.metrics() if "loss" in m}
    assert losses[1]["loss"] == pytest.approx(0.693147, abs=1e-6)  # adapters start as zero updates
    assert losses[4]["rewards/margins"] != 0.0
    assert (
        "precomputed" not in lora_dpo_run.log
        and not (lora_dpo_run.output_dir / "reference_logps.safetensors").exists()
    )
    assert (lora_dpo_run.output_dir / "final" / "adapter_model.safetensors").is_file()


@pytest.mark.multiprocess
def test_a_reference_model_gives_the_precomputed_references_losses(dpo_run, demo_assets, tmp_path):
    """preference.reference=model: a second frozen copy, sharded with the policy's per-layer units, computes the
    reference online; with the initial weights as that copy, every step equals the precomputed run's."""
    online = preference_run(tmp_path, demo_assets, **{
        "preference.reference": "model", "preference.reference_model": demo_assets / "base",
        "train.eval_every_steps": 0, "checkpoint.save_every_steps": 0,
    })  # fmt: skip
    assert "frozen, sharded as the policy over a 2 mesh (preference.reference=model)" in online.log
    assert "precomputed" not in online.log and not (online.output_dir / "reference_logps.safetensors").exists()
    ours = {m["step"]: m["loss"] for m in online.metrics() if "loss" in m}
    theirs = {m["step"]: m["loss"] for m in dpo_run.metrics() if "loss" in m}
    assert sorted(ours) == sorted(theirs) and ours[1] == pytest.approx(0.693147, abs=1e-6)
    for step, loss in ours.items():
        assert loss == pytest.approx(theirs[step], abs=1e-5), step


@pytest.mark.multiprocess
def test_under_hybrid_sharding_the_reference_model_shards_within_the_policys_groups(dpo_run, demo_assets, tmp_path):
    """4 processes as 2 replicas x 2-process shard groups: the reference is sharded on the policy's 2-D mesh (not
    over all 4 ranks, which would make its every all-gather cross the replicas), and the run trains as the
    2-process one with the precomputed reference (the same 8 pairs a step)."""
    hybrid = ("--num_machines", "1", "--parallelism_config_dp_shard_size", "2", "--fsdp_activation_checkpointing",
              "false")  # fmt: skip
    online = preference_run(tmp_path, demo_assets, "hybrid_shard.yaml", 4, hybrid, **{
        "preference.reference": "model", "preference.reference_model": demo_assets / "base",
        "train.micro_batch_size": 2, "train.eval_every_steps": 0, "checkpoint.save_every_steps": 0,
        "output.export": "false",
    })  # fmt: skip
    assert "hybrid: 2 replicas x 2-process shard groups" in online.log
    assert "frozen, sharded as the policy over a 2 x 2 mesh" in online.log
    ours = {m["step"]: m["loss"] for m in online.metrics() if "loss" in m}
    theirs = {m["step"]: m["loss"] for m in dpo_run.metrics() if "loss" in m}
    assert ours[1] == pytest.approx(0.693147, abs=1e-6)
    for step, loss in ours.items():
        assert loss == pytest.approx(theirs[step], abs=1e-5), step


def test_impossible_preference_settings_are_refused_before_loading():
    from finetune.config import ConfigError, load_recipe

    for overrides, message in (
        (["preference.loss=simpo", "preference.reference=precomputed"], "simpo uses no reference model"),
        (["preference.reference=model"], "preference.reference=model needs preference.reference_model"),
        (["preference.beta=0", "preference.label_smoothing=0.5"], r"beta must be > 0.*label_smoothing must be in"),
        (["preference.loss=ipo", "preference.label_smoothing=0.1"], "label_smoothing applies to dpo and simpo"),
        (["preference.simpo_gamma=1"], "simpo_gamma applies to loss: simpo"),
        (["preference.loss=dpo", "data.format=chat"], "a preference section trains on pairs, not data.format=chat"),
        (["preference.loss=dpo", "data.completion_only_loss=false"], "completion_only_loss=false trains prompts too"),
        (
            ["preference.loss=dpo", "data.multi_turn=per_turn"],
            "data.multi_turn=per_turn applies to supervised chat data",
        ),
    ):
        with pytest.raises(ConfigError, match=message):
            load_recipe(DEMO_RECIPE, ["data.format=auto", *overrides])
