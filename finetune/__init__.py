"""Fine-tune Hugging Face causal language models with FSDP, driven by Accelerate."""

__version__ = "0.1.0"
