"""A tiny Llama checkpoint made on the spot: config, random weights from a seed, a word-level tokenizer.

Real engines load a model directory; no hub is reachable from CI, so this writes one
(``config.json``, ``model.safetensors``, ``tokenizer.json`` and its config) that vLLM and
transformers load like any other. Sizes fit vLLM's CPU attention (head size 32, KV blocks of 32).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

# A handful of sentences: the tokenizer's vocabulary is their words, so prompts made of them
# tokenize to known ids and prompts of any length can be built by repeating words.
CORPUS = (
    "the quick brown fox jumps over the lazy dog while a cat sleeps in the warm sun",
    "prefill engines compute the cache and decode engines continue from it one token at a time",
    "a daemon on every node moves the bytes so that engines never wait on one another",
    "rivers run to the sea and clouds carry the rain back over hills and fields",
)

PROMPTS = (
    "the quick brown fox",
    "prefill engines compute the cache and decode engines continue from it one token at a time "
    "while a daemon on every node moves the bytes",
    "rivers run to the sea " * 8,
    "a cat sleeps in the warm sun and the lazy dog jumps over the quick brown fox " * 5,
    # The second prompt's words in reverse: as many tokens, other KV (the swap check needs both).
    "bytes the moves node every on daemon a while time a at token one it from continue engines "
    "decode and cache the compute engines prefill",
)


def build(path: Path, seed: int = 0, layers: int = 2, vocab: int = 384) -> Path:
    """Writes the model directory at `path` (created) and returns it."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    words = sorted({w for line in CORPUS for w in line.split()})
    specials = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(specials + words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))

    config = LlamaConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    # Wider weights than the default init: logits far apart, so greedy picks are not near-ties
    # that a different (but correct) kernel order could flip.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(path), safe_serialization=True)
    # The engine must never try to reach a hub for a generation config.
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    logger.info("tiny llama written to %s", path)
    return path


if __name__ == "__main__":
    import sys

    print(build(Path(sys.argv[1])))
