"""Model folders out of a run: consolidated safetensors in bounded memory (`consolidate`), adapters merged into
their base (`merge`), reading a checkpoint's or a folder's weights (`weight_files`) and the base's files beside
them (`model_files`).

May import: `objectives`, `rollouts`, `model`, `storage`, `data`, `engine`, `config`, `errors`.
"""
