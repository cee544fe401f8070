"""The model and the requests of ``kvxferd bench engines``: a Llama checkpoint with random weights
written on the spot (no hub is reachable), a word-level tokenizer, and a seeded mix of prompts
given to the servers as token ids (so every engine sees exactly the same tokens).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# Ids below this are the tokenizer's specials (<unk>, <s>, </s>): prompts never use them.
FIRST_WORD_ID = 3


@dataclass(frozen=True)
class ModelSpec:
    """Llama geometry. The defaults: 8 layers, GQA (8 query / 2 KV heads), head dim 64, fp32, so
    8 KiB of KV per token (a long prompt's KV is tens of MiB, as in a real deployment per KV head)."""

    layers: int = 8
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 1024
    vocab: int = 2048
    max_len: int = 4096
    dtype: str = "float32"
    seed: int = 0

    @property
    def dtype_bytes(self) -> int:
        return {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


def build_model(path: Path, spec: ModelSpec) -> Path:
    """Writes a loadable checkpoint (config, safetensors, tokenizer) at `path` and returns it."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    words = [f"w{i}" for i in range(spec.vocab - len(specials))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(specials + words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))
    config = LlamaConfig(
        vocab_size=spec.vocab, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim, max_position_embeddings=spec.max_len, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, dtype=spec.dtype,
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    # Wider weights than the default init put the logits far apart: greedy picks are not near-ties
    # that a batch of another size (same KV, another kernel order) could flip.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.05)
    model.to(getattr(torch, spec.dtype)).save_pretrained(str(path), safe_serialization=True)
    # The servers must never look for a generation config on a hub.
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    return path


@dataclass(frozen=True)
class Request:
    index: int
    prompt: tuple[int, ...]
    max_tokens: int


def request_mix(n: int, min_len: int, max_len: int, block_size: int, vocab: int, max_tokens: int,
                seed: int) -> list[Request]:
    """`n` prompts of seeded random lengths in [min_len, max_len], log-uniform (many short, a few
    long, as chat traffic is), none a multiple of the block size (the last block is partial)."""
    if not 0 < min_len <= max_len:
        raise ValueError(f"bad prompt lengths [{min_len}, {max_len}]")
    rng = random.Random(seed)
    out = []
    lo, hi = float(min_len), float(max_len)
    for i in range(n):
        # The ends of the range are always in: the shortest and the longest prompt are measured.
        length = min_len if i == 0 else max_len if i == 1 else round(lo * (hi / lo) ** rng.random())
        if length % block_size == 0:
            length = length - 1 if length - 1 >= min_len else length + 1
        prompt = tuple(rng.randrange(FIRST_WORD_ID, vocab) for _ in range(length))
        out.append(Request(i, prompt, max_tokens))
    rng.shuffle(out)
    return out
