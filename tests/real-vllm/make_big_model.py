"""Make a random-weight Llama model of several GB, locally (no hub), for the
read-ahead and load-speed scenario (tests/real_vllm/prefetch.rs).

Usage: make_big_model.py TINY DIR   writes DIR/ (config.json, the weights in
                                    several safetensors shards and their
                                    index, TINY's tokenizer)

The architecture is tiny (two narrow layers) so that vLLM's start-up,
profiling and completions cost what the tiny model's do; the bytes are in
the input embedding and the untied output matrix (512 000 x 2048 in bf16,
2 GiB each), which vLLM reads from disk like any other weights but which
cost almost nothing to compute: an embedding is a lookup and the output
matrix is applied to one position per sequence. The vocabulary is far
larger than the tokenizer's; vLLM only checks the prompt's ids against it,
and ids the tokenizer does not know decode to nothing.

The shards are cut at 1 GB, as a published model's are at a few GB: each
large matrix is a file of its own, the layers another.
"""
import shutil
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

tiny, out = sys.argv[1], sys.argv[2]
start = time.monotonic()
torch.manual_seed(0)
# Made in bf16 from the start: an fp32 model of this size would take twice
# the memory while it is made.
torch.set_default_dtype(torch.bfloat16)
config = LlamaConfig(
    hidden_size=2048,
    intermediate_size=1024,
    num_hidden_layers=2,
    # head size 128 (vLLM's CPU attention backend rejects 16).
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=512,
    vocab_size=512000,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)
model = LlamaForCausalLM(config)
model.save_pretrained(out, safe_serialization=True, max_shard_size="1GB")
for name in ("tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f"{tiny}/{name}", f"{out}/{name}")
print(f"{out}: made in {time.monotonic() - start:.1f} s")
