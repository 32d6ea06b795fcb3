"""Command line: `python -m finetune train RECIPE [section.key=value ...]`.

Launch through accelerate so that the accelerate config picks the hardware and sharding:
    accelerate launch --config_file accelerate_configs/fsdp2_full_shard.yaml \
        -m finetune train recipes/demo/tiny_llama.yaml
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from finetune.errors import FinetuneError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="finetune", description="Fine-tune causal LMs with FSDP via accelerate.")
    commands = parser.add_subparsers(dest="command", required=True)
    train_parser = commands.add_parser("train", help="train with a recipe (run under `accelerate launch`)")
    train_parser.add_argument("recipe", help="recipe YAML, e.g. recipes/demo/tiny_llama.yaml")
    train_parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. optim.lr=1e-5 train.max_steps=10")
    demo_parser = commands.add_parser("demo", help="the offline demo: build its base model and data, or report")
    demo_parser.add_argument("action", choices=["build", "report"])
    demo_parser.add_argument("--dir", default="outputs/demo", help="demo working folder (base model and data)")
    demo_parser.add_argument("--run", default="outputs/demo/run", help="output.dir of the demo training run")
    args = parser.parse_args(argv)

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.command == "train":
            from finetune.config import load_recipe

            recipe = load_recipe(args.recipe, args.overrides)  # before the slow imports: typos fail fast
            from finetune.distributed import shutdown
            from finetune.loop import train

            train(recipe)
            shutdown()  # only after train() returned, so its model and loaders are already freed
        else:
            from finetune import demo

            demo.build(args.dir) if args.action == "build" else demo.report(args.dir, args.run)
    except FinetuneError as exc:
        # Every rank hits the same user error; one copy of the message is enough.
        if os.environ.get("RANK", "0") == "0":
            print(f"finetune: error: {exc}", file=sys.stderr)
        return 2
    return 0
