"""The merge peer: PEFT's `merge_and_unload()` and transformers' `save_pretrained`, as a user would.

    python bench/peft_merge.py BASE_DIR ADAPTER_DIR OUT_DIR MAX_SHARD_SIZE

The base loads in its stored dtype, the adapter is merged into it in place, and the model is saved
as safetensors shards of MAX_SHARD_SIZE: the whole model is in memory at once.
"""

from __future__ import annotations

import sys

from peft import PeftModel
from transformers import AutoModelForCausalLM

base_dir, adapter_dir, out_dir, max_shard_size = sys.argv[1:5]
base = AutoModelForCausalLM.from_pretrained(base_dir, dtype="auto")
merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
merged.save_pretrained(out_dir, max_shard_size=max_shard_size)
