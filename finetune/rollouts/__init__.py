"""Answering prompts by generation, for evaluation and online RL: seeded sampling in lock-step or gathered once
(`generation`), the static-cache decoding loop (`static_decode`), the rewards that score completions
(`rewards`), and agents' episodes (`episodes`: turns that call tools, read with the template's own format by
`tool_calls` and run by `tools`).

May import: `model`, `storage`, `data`, `engine`, `config`, `errors`.
"""
