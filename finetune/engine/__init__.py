"""The distributed engine, driven by accelerate: what runs the model on one or many processes.

The accelerator (`accelerator`) and its CPU FSDP adapter (`cpu_fsdp`), the process group's collectives and signals
(`processes`), the launch's settings (`launch`), wrapping and resharding (`wrap`), sequence parallelism
(`sequence`), attention paths (`attention`, `shared_attention`), activation checkpointing and offload
(`recompute`), memory probes (`memory`), quiet libraries (`quiet`), and the `Batch` every forward takes
(`batch`). Nothing here knows which model, data or objective runs.

May import: `config`, `errors`.
"""
