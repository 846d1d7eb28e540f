"""Build a tiny Llama with a locally trained tokenizer and random *real* weights (no hub).

    python -m tests.helpers.tiny_model OUT_DIR [--seed 0]

Weights are seeded normal draws with a large init scale (saved as safetensors), so
the output depends on every KV value: a wrong KV block changes the tokens.  With
vLLM's ``--load-format dummy`` it did not (measured; see VLLM_NOTES), which is why
the end-to-end tests never use dummy weights.
"""

from __future__ import annotations

import argparse
import json
import os
import random

CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0,
              tie_word_embeddings=False, torch_dtype="float32")
VOCAB = 1024
INIT_STD = 0.4

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu red green blue cyan magenta yellow "
         "black white north south east west spring summer autumn winter river mountain valley forest desert "
         "ocean island city village road bridge tower castle garden market school library kitchen window "
         "door table chair lamp paper pencil engine wheel signal packet socket memory buffer kernel thread").split()


def corpus(seed: int, lines: int = 4000) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) + (str(rng.randrange(100)) if rng.random() < 0.2 else "")
                     for _ in range(rng.randrange(5, 40))) for _ in range(lines)]


def build(out: str, seed: int = 0, max_position_embeddings: int = CONFIG["max_position_embeddings"]) -> str:
    """``max_position_embeddings``: the longest prompt the model takes (the long-prompt e2e needs ~52k)."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(out, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(seed), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(out)

    cfg = LlamaConfig(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
                      **{**CONFIG, "max_position_embeddings": max_position_embeddings})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                continue  # keep RMSNorm weights at 1
            p.normal_(0.0, INIT_STD)
    cfg.save_pretrained(out)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    return out


def prompt(n_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(build(a.out, a.seed))
