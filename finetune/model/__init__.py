"""The model: loading it and its tokenizer with the checks that need no weights (`loading`), whether two names
are one model (`identity`), what a family varies (`family`), expert routing (`routing`), fused kernels
(`kernels`), and the weights seam (`weights`, `adapters`): full weights or LoRA, DoRA and QLoRA adapters, one
object chosen once that answers every question the build, the objectives, checkpoints and exports would
otherwise ask of adapters.

May import: `storage`, `data`, `engine`, `config`, `errors`.
"""
