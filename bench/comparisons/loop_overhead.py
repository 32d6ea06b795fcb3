"""loop_overhead: finetune's loop vs a hand-written FSDP2 loop (bench/handwritten_fsdp2.py): steps/s"""

from __future__ import annotations

import json
import sys

from common import REPO, Bench, _free_port, _ratio, _row, _run, _steady_median


def measure(bench: Bench) -> dict:
    """finetune vs the hand-written FSDP2 loop on the same packed rows: median steps/s, interleaved."""
    from finetune.config import DataConfig
    from finetune.data import load_split, prepare_split

    size = bench.train_size
    model = bench.model(size)
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    cfg = DataConfig(train_path=str(bench.data), max_length=128, format="chat", packing=True)
    rows, _ = prepare_split(load_split(cfg.train_path, "train"), tokenizer, cfg, seed=42)
    rows_path = bench.work / "packed_rows.pt"
    torch.save({key: torch.tensor(rows[key]) for key in ("input_ids", "position_ids", "target_ids")}, rows_path)
    ours, theirs = [], []
    for repeat in range(bench.repeats):
        metrics = bench.finetune_run(f"loop-{repeat}", size, "fsdp2_full_shard.yaml")
        ours.append(1 / _steady_median(metrics["step_seconds"]))
        bench.curves.setdefault("finetune (FSDP2)", metrics["loss"])
        out = bench.work / "runs" / f"handwritten-{repeat}.json"
        _run([
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
            str(_free_port()), str(REPO / "bench" / "handwritten_fsdp2.py"), str(model), str(rows_path),
            str(bench.steps), "8", str(out),
        ])  # fmt: skip
        handwritten = json.loads(out.read_text())
        theirs.append(1 / _steady_median(handwritten["step_seconds"]))
        bench.curves.setdefault("hand-written FSDP2", handwritten["loss"])
    return _ratio("steps_per_second", "finetune", ours, "handwritten_fsdp2", theirs, target=0.97, size=size)


def rows(loop: dict) -> list[str]:
    median = loop["median"]
    return [
        _row(
            f"loop overhead, steps/s ({loop['size']})", f"{median['finetune']:.2f}",
            f"{median['handwritten_fsdp2']:.2f} (hand-written FSDP2)", f"{loop['ratio']:.3f}", f">= {loop['target']}",
        )
    ]  # fmt: skip
