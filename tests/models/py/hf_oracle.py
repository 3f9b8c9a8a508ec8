"""Test oracle for Strata's model interop, using Hugging Face transformers.

  hf_oracle.py make DIR
      Saves tiny randomly initialised models with transformers (save_pretrained, safetensors) in
      DIR/gpt2, DIR/llama (grouped-query attention, untied) and DIR/llama_tied (tied embeddings,
      attention and MLP biases), DIR/llama3_rope (Llama 3 RoPE scaling, head_dim != hidden /
      heads), DIR/qwen2, DIR/mistral (sliding window 16 > the 13 tokens) and DIR/gemma, each with expected.safetensors holding input ids and the logits
      transformers computes for them (fp32).
  hf_oracle.py check MODEL_DIR EXPECTED
      Loads MODEL_DIR with transformers, computes logits for EXPECTED's ids and compares them with
      EXPECTED's logits; exits 1 if the relative error (max |diff| / max |logits|) exceeds 1e-5.
"""
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, GemmaConfig, GemmaForCausalLM, GPT2Config, GPT2LMHeadModel,
                          LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM)

TOLERANCE = 1e-5


def perturb(model, seed):
    # Initialise every parameter (norm weights and biases included) away from its default, so
    # that a mapping mistake anywhere changes the logits.
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.add_(0.1 * torch.randn(p.shape, generator=g))


def make(out):
    torch.manual_seed(0)
    models = {
        "gpt2": GPT2LMHeadModel(GPT2Config(vocab_size=101, n_positions=32, n_embd=48, n_layer=2,
                                           n_head=4, initializer_range=0.2, resid_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                           embd_pdrop=0.0, attn_pdrop=0.0)),
        "llama": LlamaForCausalLM(LlamaConfig(vocab_size=101, hidden_size=64, intermediate_size=160,
                                              num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=2, max_position_embeddings=64,
                                              rope_theta=5000.0, rms_norm_eps=1e-6,
                                              initializer_range=0.2, tie_word_embeddings=False)),
        "llama_tied": LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=72,
                                                   num_hidden_layers=3, num_attention_heads=4,
                                                   num_key_value_heads=1, max_position_embeddings=64,
                                                   initializer_range=0.2, tie_word_embeddings=True,
                                                   attention_bias=True, mlp_bias=True)),
        # Llama 3 RoPE scaling with an original context of 64: wavelengths run from 2*pi up, so
        # the high (< 16), medium (16..64) and low (> 64) frequency bands all occur; and
        # head_dim != hidden / heads.
        "llama3_rope": LlamaForCausalLM(LlamaConfig(vocab_size=89, hidden_size=48, intermediate_size=96,
                                                    num_hidden_layers=2, num_attention_heads=4,
                                                    num_key_value_heads=2, head_dim=16,
                                                    max_position_embeddings=64, initializer_range=0.2,
                                                    rope_scaling={"rope_type": "llama3", "rope_theta": 500000.0,
                                                                  "factor": 8.0, "low_freq_factor": 1.0,
                                                                  "high_freq_factor": 4.0,
                                                                  "original_max_position_embeddings": 64})),
        # The other Llama-family types users bring: Qwen2 (q/k/v biases, no o_proj bias), Mistral
        # with a sliding window longer than the test's sequences, Gemma (scaled embeddings,
        # (1 + w) RMSNorm, GELU-tanh MLP, tied head, head_dim != hidden / heads).
        "qwen2": Qwen2ForCausalLM(Qwen2Config(vocab_size=83, hidden_size=48, intermediate_size=80,
                                              num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=2, max_position_embeddings=64,
                                              initializer_range=0.2, tie_word_embeddings=False)),
        "mistral": MistralForCausalLM(MistralConfig(vocab_size=79, hidden_size=48, intermediate_size=80,
                                                    num_hidden_layers=2, num_attention_heads=4,
                                                    num_key_value_heads=2, max_position_embeddings=64,
                                                    sliding_window=16, initializer_range=0.2)),
        "gemma": GemmaForCausalLM(GemmaConfig(vocab_size=71, hidden_size=48, intermediate_size=80,
                                              num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=1, head_dim=16,
                                              max_position_embeddings=64, initializer_range=0.2,
                                              hidden_act="gelu_pytorch_tanh")),
    }
    for i, (name, model) in enumerate(models.items()):
        perturb(model, 100 + i)
        model.eval()
        d = f"{out}/{name}"
        model.save_pretrained(d, safe_serialization=True)
        g = torch.Generator().manual_seed(7 + i)
        ids = torch.randint(0, model.config.vocab_size, (2, 13), generator=g)
        with torch.no_grad():
            logits = model(ids).logits.float().contiguous()
        save_file({"ids": ids, "logits": logits}, f"{d}/expected.safetensors")


def check(model_dir, expected_file):
    exp = load_file(expected_file)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(exp["ids"]).logits.float()
    err = ((logits - exp["logits"]).abs().max() / exp["logits"].abs().max()).item()
    print(f"{model_dir}: relative error {err:.3e} against {expected_file}")
    return 0 if err <= TOLERANCE else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "check":
        sys.exit(check(sys.argv[2], sys.argv[3]))
    else:
        print(__doc__)
        sys.exit(2)
