"""Command line: `python -m finetune train|export|plan|check|demo ...`.

Launch training through accelerate so that the accelerate config picks the hardware and sharding:
    accelerate launch --config_file accelerate_configs/fsdp2_full_shard.yaml \
        -m finetune train recipes/demo/tiny_llama.yaml
Export runs as one plain process, from any checkpoint:
    python -m finetune export outputs/demo/run/checkpoints/step_300 exported/ --dtype bf16
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import time
from pathlib import Path

from finetune.engine import quiet
from finetune.errors import FinetuneError

EXPORT_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # Dotted overrides may also come after the options (argparse gives a positional list only its first run).
    misplaced = [arg for arg in extra if arg.startswith("-") or "=" not in arg or not hasattr(args, "overrides")]
    if misplaced:
        parser.error(f"unrecognized arguments: {' '.join(misplaced)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if getattr(args, "verbose", False):
        os.environ[quiet.VERBOSE] = "1"
    quiet.quiet_libraries()
    try:
        if args.command == "train":
            _train(args.recipe, args.overrides)
        elif args.command in ("plan", "check"):
            from finetune.config import load_recipe
            from finetune.engine.launch import read_launch
            from finetune.plan.verdict import check, parse_memory, plan

            recipe = load_recipe(args.recipe, args.overrides)
            launch = read_launch(
                Path(args.config), args.num_processes, args.num_machines, machine_rank=args.machine_rank,
                main_process_ip=args.main_process_ip, wrap_classes=args.wrap, for_launch=args.command == "check",
            )  # fmt: skip
            report = plan if args.command == "plan" else check
            print(report(recipe, launch, parse_memory(args.gpu_memory)))
        elif args.command == "export":
            import torch

            # Not finetune.model.loading: importing the transformers model classes would add a second to every export.
            from finetune.export.consolidate import export_checkpoint

            dtype = getattr(torch, EXPORT_DTYPES[args.dtype]) if args.dtype else None
            out = export_checkpoint(
                Path(args.checkpoint), Path(args.out), dtype=dtype, max_shard_size=args.max_shard_size,
                overwrite=args.overwrite, merge=args.merge, merge_onto=args.merge_onto,
            )  # fmt: skip
            print(f"exported {args.checkpoint} to {out}")
        else:
            from finetune.run import demo

            _check_demo_options(args)
            if args.action == "build-rm":
                from finetune.run import demo_reward

                demo_reward.build(args.dir, args.policy or f"{args.dir}/run-partial/final")
            elif args.action in ("build-agent", "report-agent"):
                from finetune.run import demo_agent

                if args.action == "build-agent":
                    demo_agent.build(args.dir)
                else:
                    demo_agent.report(args.dir, args.run, args.before)
            elif args.action == "report-distill":
                demo.report_distill(args.dir, args.before, args.sft, args.distilled, args.case or "clean data")
            elif args.action == "build":
                demo.build(args.dir, args.noise)
            else:
                demo.report(args.dir, args.run, args.before)
    except FinetuneError as exc:
        # Every rank hits the same user error; one copy of the message is enough, and rank 0 prints it.
        # torch's launcher stops all workers as soon as one exits with an error, so the others give rank 0
        # time to print first; one still running after that hit an error of its own, and says so.
        if _rank() == 0:
            print(f"finetune: error: {exc}", file=sys.stderr)
        else:
            time.sleep(_PEER_GRACE_SECONDS)
            print(f"finetune: error on rank {_rank()}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        from finetune.engine.processes import lost_peer

        if _rank() == 0 or not lost_peer(exc):
            raise
        # Another process stopped (with its own message) while this one waited for it in a collective.
        print(f"finetune: rank {_rank()} stopped: another process ended first (see its message)", file=sys.stderr)
        return 1
    return 0


_PEER_GRACE_SECONDS = 10


def _check_demo_options(args: argparse.Namespace) -> None:
    """`finetune demo`'s options that only some actions read: refused with another (they would be ignored), and
    report-distill's runs required."""
    for option, actions in (("noise", ("build",)), ("sft", ("report-distill",)), ("distilled", ("report-distill",)),
                            ("case", ("report-distill",)), ("policy", ("build-rm",))):  # fmt: skip
        if getattr(args, option) is not None and args.action not in actions:
            raise FinetuneError(f"--{option} is read by `finetune demo {' or '.join(actions)}` only, not "
                                f"{args.action}; remove it")  # fmt: skip
    missing = [f"--{name}" for name in ("before", "sft", "distilled") if getattr(args, name) is None]
    if args.action == "report-distill" and missing:
        raise FinetuneError(
            f"finetune demo report-distill compares runs from one warm student: give {', '.join(missing)} (--before "
            "the warm student's folder, --sft the continued SFT run's output.dir, --distilled each distilled run's)"
        )


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def use_expandable_segments(environ: dict[str, str] | os._Environ) -> None:
    """Let the CUDA caching allocator grow segments instead of carving fixed blocks, which leaves less
    memory stranded in fragments by the changing shapes of packed batches; read when CUDA first
    allocates, so it is set before anything is imported that could. An allocator setting the user gave
    (either variable name) is left alone; CPU runs never read it."""
    if "PYTORCH_CUDA_ALLOC_CONF" not in environ and "PYTORCH_ALLOC_CONF" not in environ:
        environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


def _train(recipe_path: str, overrides: list[str]) -> None:
    from finetune.config import load_recipe

    recipe = load_recipe(recipe_path, overrides)  # before the slow imports: typos fail fast
    use_expandable_segments(os.environ)
    from finetune.engine.processes import shutdown
    from finetune.export.consolidate import export_checkpoint
    from finetune.model.loading import DTYPES
    from finetune.run.train import preflight, train
    from finetune.storage.outputs import run_lock

    resume_from = preflight(recipe)
    # The main process owns output.dir until its export is written: a second run into it is refused.
    with run_lock(Path(recipe.output.dir)) if _rank() == 0 else contextlib.nullcontext():
        result = train(recipe, resume_from)
        shutdown()  # only after train() returned, so its model and loaders are already freed
        # The export runs on one process after the process group is gone: however long it takes,
        # no other rank waits on a collective that could time out.
        if recipe.output.export and result.final_checkpoint is not None and _rank() == 0:
            dtype = DTYPES[recipe.output.export_dtype] if recipe.output.export_dtype else None
            out = export_checkpoint(result.final_checkpoint, result.output_dir / "final", dtype=dtype, overwrite=True)
            print(f"exported {result.final_checkpoint} to {out}")
            if recipe.output.export_merged:
                merged = result.output_dir / "final_merged"
                export_checkpoint(result.final_checkpoint, merged, dtype=dtype, overwrite=True, merge=True)
                print(f"exported {result.final_checkpoint} with the adapter merged to {merged}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="finetune", description="Fine-tune causal LMs with FSDP via accelerate.")
    commands = parser.add_subparsers(dest="command", required=True)
    train_parser = commands.add_parser("train", help="train with a recipe (run under `accelerate launch`)")
    train_parser.add_argument("recipe", help="recipe YAML, e.g. recipes/demo/tiny_llama.yaml")
    train_parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=1e-5 train.max_steps=10")
    train_parser.add_argument(
        "--verbose",
        action="store_true",
        help=f"the libraries' own progress bars and info lines too (or {quiet.VERBOSE}=1)",
    )
    export_parser = commands.add_parser(
        "export", help="write a checkpoint as a Hugging Face model folder (one process, no launcher)"
    )
    export_parser.add_argument("checkpoint", help="a checkpoints/step_<N> folder, or a run's output dir (its latest)")
    export_parser.add_argument("out", help="folder to write: config, tokenizer, safetensors weights")
    export_parser.add_argument(
        "--dtype", choices=sorted(EXPORT_DTYPES), help="weights dtype (default: the dtype the parameters trained in)"
    )
    export_parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB")
    export_parser.add_argument("--overwrite", action="store_true", help="replace a model already in OUT")
    export_parser.add_argument(
        "--merge", action="store_true", help="adapter checkpoints: write the base model with the adapter folded in"
    )
    export_parser.add_argument(
        "--merge-onto", choices=("dequantized", "original"), default="dequantized",
        help="QLoRA: merge onto the 4-bit base as training saw it (default) or onto the original weights",
    )  # fmt: skip
    plan_parser = commands.add_parser(
        "plan", help="estimate memory per device for a recipe and an accelerate config (no GPU, no weights)"
    )
    check_parser = commands.add_parser(
        "check", help="validate a recipe and a launch before starting it: sizes, model architecture, wrap classes"
    )
    for sub in (plan_parser, check_parser):
        sub.add_argument("recipe", help="recipe YAML")
        sub.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.micro_batch_size=2")
        sub.add_argument("--config", required=True, help="accelerate config, e.g. accelerate_configs/X.yaml")
        sub.add_argument("--num-processes", type=int, help="processes (GPUs) in all (default: the config's)")
        sub.add_argument("--num-machines", type=int, help="machines (nodes) (default: the config's)")
        sub.add_argument("--machine-rank", type=int, help="this machine's rank, 0..num-machines-1")
        sub.add_argument("--main-process-ip", help="address of the machine of rank 0 (multi-node)")
        sub.add_argument("--wrap", help="fsdp_transformer_layer_cls_to_wrap, overriding the config's")
        sub.add_argument("--gpu-memory", default="80GB", help="memory of one device, e.g. 80GB, 24GiB")
    demo_parser = commands.add_parser("demo", help="the offline demo: build its base model and data, or report")
    demo_parser.add_argument(
        "action", choices=["build", "report", "report-distill", "build-agent", "report-agent", "build-rm"]
    )
    demo_parser.add_argument("--dir", default="outputs/demo", help="demo working folder (base model and data)")
    demo_parser.add_argument("--run", default="outputs/demo/run", help="output.dir of the demo training run")
    demo_parser.add_argument(
        "--before",
        help="report, report-distill: the model the runs started from (default: the demo's base), e.g. the SFT export",
    )
    demo_parser.add_argument("--sft", help="report-distill: output.dir of the continued SFT run")
    demo_parser.add_argument("--distilled", nargs="+", help="report-distill: output.dir of each distillation run")
    demo_parser.add_argument("--case", help="report-distill: the case's name, printed (default: clean data)")
    demo_parser.add_argument(
        "--policy", help="build-rm: the model whose sampled replies the pairs hold (default: DIR/run-partial/final)"
    )
    demo_parser.add_argument(
        "--noise", type=float, help="build: also write data/train_noisy.jsonl, this share of its replies wrong (0-1)"
    )
    return parser
