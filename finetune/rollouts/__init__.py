"""Answering prompts by generation, for evaluation and online RL: seeded sampling in lock-step or gathered once
(`generation`), the static-cache decoding loop (`static_decode`), and the rewards that score completions
(`rewards`).

May import: `model`, `storage`, `data`, `engine`, `config`, `errors`.
"""
