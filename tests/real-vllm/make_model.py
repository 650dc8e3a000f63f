"""Make a tiny random-weight Llama model and its tokenizer, locally (no hub).

Usage: make_model.py DIR        writes DIR/ (config.json, model.safetensors, tokenizer)
                                 and DIR-fp4/ (the same, with a compressed-tensors
                                 kv_cache_scheme of num_bits 4 that vLLM 0.32 refuses)
"""
import json
import shutil
import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

out = sys.argv[1]
torch.manual_seed(0)
# head size 32: vLLM's CPU attention backend rejects 16.
config = LlamaConfig(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=512,
    vocab_size=2048,
)
model = LlamaForCausalLM(config).to(torch.bfloat16)
model.save_pretrained(out, safe_serialization=True)

words = "the quick brown fox jumps over a lazy dog while vllm serves tokens on cpus".split()
text = [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 50
tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(
    vocab_size=2048,
    special_tokens=["<unk>", "<s>", "</s>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
)
tok.train_from_iterator(text, trainer)
fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
fast.save_pretrained(out)

fp4 = out.rstrip("/") + "-fp4"
shutil.rmtree(fp4, ignore_errors=True)
shutil.copytree(out, fp4)
with open(f"{fp4}/config.json") as f:
    cfg = json.load(f)
cfg["quantization_config"] = {
    "quant_method": "compressed-tensors",
    "format": "dense",
    "config_groups": {},
    "kv_cache_scheme": {"num_bits": 4, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True},
}
with open(f"{fp4}/config.json", "w") as f:
    json.dump(cfg, f, indent=2)
    f.write("\n")
print(out, fp4)
