#!/usr/bin/env python3
"""Makes a tiny Hugging Face Llama model directory for the README's quick start and its test: a
byte-level BPE tokenizer trained on configs/finetune-chats with a ChatML chat template, and
a randomly initialized 2-layer LlamaForCausalLM (about 0.3M parameters), saved with
save_pretrained as a downloaded model would be (config.json, model.safetensors,
generation_config.json, tokenizer files). It stands in for a real model: with one, skip this.

    make-tiny-model.py OUT_DIR [--chats FILE.jsonl] [--seed N]

Deterministic for a given seed (the tokenizer trainer and torch's initialization are seeded).
"""
import argparse
import json
import os
import sys

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def texts(path):
    for line in open(path, encoding="utf-8"):
        if not line.strip():
            continue
        ex = json.loads(line)
        if "messages" in ex:
            for m in ex["messages"]:
                yield m["content"]
        else:
            yield ex["prompt"]
            yield ex["response"]


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--chats", default=os.path.join(here, "..", "configs", "finetune-chats", "data", "train-00000-of-00001.jsonl"))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    try:
        import torch
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
        from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    except ImportError as e:
        sys.exit(f"make-tiny-model: {e}: run with the setup's Python (~/.cache/strata/venv/bin/python)")

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts(a.chats)) + ["user", "assistant", "system"], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHATML

    torch.manual_seed(a.seed)
    config = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rms_norm_eps=1e-6, tie_word_embeddings=False,
                         bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                         pad_token_id=fast.pad_token_id)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
                                               pad_token_id=fast.pad_token_id, max_new_tokens=32)
    os.makedirs(a.out, exist_ok=True)
    model.save_pretrained(a.out, safe_serialization=True)
    fast.save_pretrained(a.out)
    n = sum(p.numel() for p in model.parameters())
    print(f"make-tiny-model: wrote {a.out} (Llama, {n} parameters, vocabulary {len(fast)})")


if __name__ == "__main__":
    main()
