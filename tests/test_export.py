"""`finetune export`: SHARDED and FULL checkpoints, from 1 and 2 processes, tied and untied models,
to a folder that from_pretrained loads in a fresh process and that gives the trained model's logits."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, LaunchedRun
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from finetune.export.consolidate import FINAL_LOGITS
from finetune.storage.checkpoint import MARKER, MODEL_FILES, TENSOR_NAMES

pytestmark = pytest.mark.multiprocess

RUNS = [
    "fsdp2_run",  # Llama, SHARDED, 2 processes
    "shard_grad_op_run",  # Llama, FULL, 2 processes
    "fsdp1_run",  # Llama, FSDP1 SHARDED, 2 processes
    "ddp_run",  # Llama, DDP safetensors, 2 processes
    "one_process_run",  # Llama, SHARDED, 1 process
    "gpt2_run",  # tied GPT-2, SHARDED, 2 processes
    "gpt2_full_one_process_run",  # tied GPT-2, FULL, 1 process
]


def export(*args: str | Path) -> subprocess.CompletedProcess:
    """`python -m finetune export ...`: one plain process, no launcher."""
    return subprocess.run(
        [sys.executable, "-m", "finetune", "export", *map(str, args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def max_logits_difference(run_dir: Path, folder: Path, dtype=torch.float32) -> float:
    """Largest |logit difference| between the model at the end of training and `folder` reloaded."""
    reference = load_file(run_dir / FINAL_LOGITS)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
    with torch.no_grad():
        logits = model(input_ids=reference["input_ids"]).logits.float()
    return (logits - reference["logits"]).abs().max().item()


def last_checkpoint(run: LaunchedRun) -> Path:
    return sorted((run.output_dir / "checkpoints").iterdir(), key=lambda p: int(p.name.split("_")[1]))[-1]


@pytest.mark.parametrize("run_name", RUNS)
def test_end_of_training_export_gives_the_trained_models_logits(run_name, request):
    run: LaunchedRun = request.getfixturevalue(run_name)
    final = run.output_dir / "final"
    assert {"config.json", "generation_config.json", "tokenizer.json", "model.safetensors"} <= {
        p.name for p in final.iterdir()
    }
    assert not list(run.output_dir.glob("*.partial"))
    assert max_logits_difference(run.output_dir, final) <= 1e-5


@pytest.mark.parametrize("run_name", ["fsdp2_run", "shard_grad_op_run", "gpt2_full_one_process_run"])
def test_export_command_writes_sharded_bf16_safetensors(run_name, request, tmp_path):
    run: LaunchedRun = request.getfixturevalue(run_name)
    out = tmp_path / "exported"
    result = export(last_checkpoint(run), out, "--dtype", "bf16", "--max-shard-size", "100KB")
    assert result.returncode == 0, result.stderr[-3000:]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and files[0].startswith("model-00001-of-")
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert reloaded.dtype == torch.bfloat16
    trained = load_file(run.output_dir / "final" / "model.safetensors")  # fp32, from the same checkpoint
    state = reloaded.state_dict()
    for name, tensor in trained.items():
        assert torch.equal(state[name], tensor.to(torch.bfloat16)), name
    if "gpt2" in run_name:
        assert "lm_head.weight" not in index["weight_map"]  # tied: stored once, as transformers does
        assert reloaded.lm_head.weight.data_ptr() == reloaded.transformer.wte.weight.data_ptr()


def test_export_of_a_run_dir_takes_its_latest_checkpoint(fsdp2_run, tmp_path):
    out = tmp_path / "exported"
    result = export(fsdp2_run.output_dir, out)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"exported {fsdp2_run.output_dir}" in result.stdout
    with safe_open(out / "model.safetensors", "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.float32  # the training dtype by default
    assert max_logits_difference(fsdp2_run.output_dir, out) <= 1e-5


def test_export_memory_stays_near_one_output_shard(tmp_path, fsdp2_run):
    """A 470 MB (fp32) model exported in 25 MB bf16 shards: the exporter's peak resident memory grows by
    about one shard over exporting the 1 MB demo model, far from the model's size."""
    config = LlamaConfig(
        vocab_size=8000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8
    )
    checkpoint = tmp_path / "big" / "checkpoints" / "step_1"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    # The layout accelerate's save_state writes for a SHARDED FSDP model: {"model": state_dict} through DCP.
    torch.distributed.checkpoint.save(
        {"model": model.state_dict()}, checkpoint_id=checkpoint / "pytorch_model_fsdp_0", no_dist=True
    )
    del model
    shutil.copytree(last_checkpoint(fsdp2_run) / MODEL_FILES, checkpoint / MODEL_FILES)
    config.save_pretrained(checkpoint / MODEL_FILES)
    (checkpoint / MARKER).write_text("step 1\n")

    def peak_rss(source: Path, out: Path) -> int:
        probe = (
            "import resource, sys; from finetune.cli import main; code = main(sys.argv[1:]); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024); sys.exit(code)"
        )
        args = ["export", str(source), str(out), "--dtype", "bf16", "--max-shard-size", "25MB"]
        result = subprocess.run(
            [sys.executable, "-c", probe, *args], cwd=REPO, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr[-3000:]
        return int(result.stdout.split()[-1])

    small = peak_rss(last_checkpoint(fsdp2_run), tmp_path / "small_out")
    big = peak_rss(checkpoint, tmp_path / "big_out")
    assert len(list((tmp_path / "big_out").glob("model-*.safetensors"))) >= 9
    assert big - small < 0.25 * model_bytes, (big - small, model_bytes)


def test_a_tampered_checkpoint_is_refused_not_unpickled(fsdp2_run, tmp_path):
    checkpoint = tmp_path / "step_16"
    shutil.copytree(last_checkpoint(fsdp2_run), checkpoint)
    metadata = checkpoint / "pytorch_model_fsdp_0" / ".metadata"
    witness = tmp_path / "pwned"
    metadata.write_bytes(
        b"cos\nsystem\n(V" + f"touch {witness}".encode() + b"\ntR."  # pickle protocol 0: os.system("touch ...")
    )
    result = export(checkpoint, tmp_path / "out")
    assert result.returncode == 2 and "refusing to load it" in result.stderr
    assert not witness.exists() and not (tmp_path / "out").exists()


def test_checkpoints_carry_the_models_tensor_names_and_export_without_them_alike(gpt2_run, tmp_path):
    """Training saves the model's names (tied ones grouped) with each checkpoint, so the export needs no
    model code; a checkpoint without them is exported from the model its config describes, identically."""
    checkpoint = last_checkpoint(gpt2_run)
    groups = json.loads((checkpoint / TENSOR_NAMES).read_text())
    assert ["transformer.wte.weight", "lm_head.weight"] in groups  # tied: one tensor, saved under wte
    assert all(len(group) == 1 for group in groups if "lm_head.weight" not in group)

    bare = tmp_path / checkpoint.name
    shutil.copytree(checkpoint, bare)
    (bare / TENSOR_NAMES).unlink()
    for source, out in ((checkpoint, tmp_path / "with_names"), (bare, tmp_path / "from_config")):
        result = export(source, out)
        assert result.returncode == 0, result.stderr[-3000:]
    with_names, from_config = (load_file(tmp_path / o / "model.safetensors") for o in ("with_names", "from_config"))
    assert with_names.keys() == from_config.keys() and "lm_head.weight" not in with_names
    assert all(torch.equal(with_names[name], from_config[name]) for name in with_names)


def test_a_checkpoint_that_does_not_hold_its_models_tensors_is_refused(fsdp2_run, tmp_path):
    checkpoint = tmp_path / "step_16"
    shutil.copytree(last_checkpoint(fsdp2_run), checkpoint)
    groups = json.loads((checkpoint / TENSOR_NAMES).read_text())
    (checkpoint / TENSOR_NAMES).write_text(json.dumps([["model.extra.weight"], *groups[1:]]))
    result = export(checkpoint, tmp_path / "out")
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"does not hold the tensors of the model its {TENSOR_NAMES} describes" in result.stderr
    assert "missing: model.extra.weight; unexpected: model.embed_tokens.weight" in result.stderr
    assert not (tmp_path / "out").exists() and "Traceback" not in result.stderr
