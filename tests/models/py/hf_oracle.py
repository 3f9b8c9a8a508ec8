"""Test oracle for Strata's model interop, using Hugging Face transformers.

  hf_oracle.py make DIR
      Saves tiny randomly initialised models with transformers (save_pretrained, safetensors) in
      DIR/gpt2, DIR/llama (grouped-query attention, untied) and DIR/llama_tied (tied embeddings,
      attention and MLP biases), DIR/llama3_rope (Llama 3 RoPE scaling, head_dim != hidden /
      heads), DIR/qwen2 (a sliding window of 4 on layer 1), DIR/mistral (a sliding window of 5,
      shorter than the 13 tokens), DIR/gemma, DIR/qwen3, DIR/gemma2 and the mixtures of experts
      DIR/mixtral and DIR/qwen3_moe, each with expected.safetensors holding input ids
      and the logits transformers computes for them (fp32); and packed examples: rows of token
      ids holding several examples (packed_ids, packed_segments), which targets are within an
      example (packed_counted), their losses (packed_losses) and the gradients of the losses'
      sum (grad/<name>, in Strata's layout) as transformers gives them running each example
      alone, unpadded.
  hf_oracle.py make4bit DIR
      Saves models in 4 bits as transformers + bitsandbytes do (save_pretrained of a model loaded
      with BitsAndBytesConfig(load_in_4bit=True), fp32 compute): DIR/llama_nf4_double (NF4, double
      quantization, odd widths: partial last blocks) and DIR/qwen3_fp4 (FP4, q/k norms), each with
      expected.safetensors holding input ids and the logits the 4-bit model computes for them
      (bitsandbytes' Linear4bit on the CPU; in training mode, where it dequantizes: in eval mode
      without gradients it may repack the weights for a bf16 kernel).
  hf_oracle.py check MODEL_DIR EXPECTED
      Loads MODEL_DIR with transformers, computes logits for EXPECTED's ids and compares them with
      EXPECTED's logits; exits 1 if the relative error (max |diff| / max |logits|) exceeds 1e-5.
"""
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM, GemmaConfig, GemmaForCausalLM,
                          GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, MixtralConfig, MixtralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM)

from moe_names import hub_tensors

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
                                              initializer_range=0.2, tie_word_embeddings=False,
                                              use_sliding_window=True, sliding_window=4, max_window_layers=1)),
        "mistral": MistralForCausalLM(MistralConfig(vocab_size=79, hidden_size=48, intermediate_size=80,
                                                    num_hidden_layers=2, num_attention_heads=4,
                                                    num_key_value_heads=2, max_position_embeddings=64,
                                                    sliding_window=5, initializer_range=0.2)),
        "gemma": GemmaForCausalLM(GemmaConfig(vocab_size=71, hidden_size=48, intermediate_size=80,
                                              num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=1, head_dim=16,
                                              max_position_embeddings=64, initializer_range=0.2,
                                              hidden_act="gelu_pytorch_tanh")),
        # Qwen3: q_norm/k_norm per head, GQA, an odd intermediate size, untied; Gemma 2: soft caps
        # (scaled up by the perturbation's 0.1 weights: tight caps that bend), query_pre_attn_scalar
        # not head_dim, a sliding window of 4 on layers 0 and 2 (of 3), the sandwich norms, GQA,
        # tied.
        "qwen3": Qwen3ForCausalLM(Qwen3Config(vocab_size=67, hidden_size=48, intermediate_size=77,
                                              num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                                              initializer_range=0.2, tie_word_embeddings=False)),
        "gemma2": Gemma2ForCausalLM(Gemma2Config(vocab_size=73, hidden_size=48, intermediate_size=77,
                                                 num_hidden_layers=3, num_attention_heads=4,
                                                 num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                                                 initializer_range=0.2, query_pre_attn_scalar=24,
                                                 attn_logit_softcapping=3.0, final_logit_softcapping=5.0,
                                                 sliding_window=4, hidden_activation="gelu_pytorch_tanh")),
        # Mixtures of experts: Mixtral with 5 experts, top-2, GQA and an odd expert width; Qwen3-MoE
        # with 5 experts, top-3 without renormalizing (norm_topk_prob false), a dense layer (1) among
        # sparse ones with its own odd width, q/k norms.
        "mixtral": MixtralForCausalLM(MixtralConfig(vocab_size=61, hidden_size=48, intermediate_size=37,
                                                    num_hidden_layers=2, num_attention_heads=4,
                                                    num_key_value_heads=2, num_local_experts=5,
                                                    num_experts_per_tok=2, max_position_embeddings=64,
                                                    initializer_range=0.2, tie_word_embeddings=False,
                                                    experts_implementation="eager")),
        "qwen3_moe": Qwen3MoeForCausalLM(Qwen3MoeConfig(vocab_size=59, hidden_size=48, intermediate_size=45,
                                                        moe_intermediate_size=19, num_hidden_layers=3,
                                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                        num_experts=5, num_experts_per_tok=3, norm_topk_prob=False,
                                                        mlp_only_layers=[1], max_position_embeddings=64,
                                                        initializer_range=0.2, tie_word_embeddings=False,
                                                        experts_implementation="eager")),
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
        save_file({"ids": ids, "logits": logits, **packed(model, name, g)}, f"{d}/expected.safetensors")


def make4bit(out):
    import tempfile
    from transformers import BitsAndBytesConfig
    made = {
        "llama_nf4_double": (LlamaForCausalLM(LlamaConfig(vocab_size=61, hidden_size=56, intermediate_size=83,
                                                          num_hidden_layers=2, num_attention_heads=4,
                                                          num_key_value_heads=2, max_position_embeddings=64,
                                                          initializer_range=0.2, tie_word_embeddings=False)),
                             "nf4", True),
        "qwen3_fp4": (Qwen3ForCausalLM(Qwen3Config(vocab_size=59, hidden_size=45, intermediate_size=70, head_dim=16,
                                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                   max_position_embeddings=64, initializer_range=0.2,
                                                   tie_word_embeddings=False)),
                      "fp4", False),
    }
    for i, (name, (model, qt, double)) in enumerate(made.items()):
        perturb(model, 200 + i)
        with tempfile.TemporaryDirectory() as base:
            model.save_pretrained(base, safe_serialization=True)
            q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=qt, bnb_4bit_use_double_quant=double,
                                   bnb_4bit_compute_dtype=torch.float32)
            m4 = AutoModelForCausalLM.from_pretrained(base, quantization_config=q, dtype=torch.float32, device_map="cpu")
        d = f"{out}/{name}"
        m4.save_pretrained(d, safe_serialization=True)
        g = torch.Generator().manual_seed(30 + i)
        ids = torch.randint(0, m4.config.vocab_size, (2, 13), generator=g)
        m4.train()  # no dropout in these models; see the usage above
        with torch.no_grad():
            logits = m4(ids).logits.float().contiguous()
        save_file({"ids": ids, "logits": logits}, f"{d}/expected.safetensors")


# GPT-2's Conv1D weights are [in, out]; Strata's layout (and its gradients) [out, in].
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def packed(model, name, g, rows=((5, 6, 3), (9, 2)), tokens=13):
    """Rows of tokens + 1 ids, each holding examples of the given lengths one after another, then
    padding (id 0, a segment of its own); each example's per-target losses and the gradients of
    their sum, from transformers running every example alone."""
    ids = torch.zeros(len(rows), tokens + 1, dtype=torch.long)
    segments = torch.zeros(len(rows), tokens, dtype=torch.long)
    counted = torch.zeros(len(rows), tokens)
    losses = torch.zeros(len(rows), tokens)
    model.zero_grad()
    for r, lengths in enumerate(rows):
        j = 0
        for k, n in enumerate(lengths):
            ex = torch.randint(0, model.config.vocab_size, (n,), generator=g)
            ids[r, j:j + n] = ex
            segments[r, j:min(j + n, tokens)] = k
            logits = model(ex[None]).logits[0].float()
            loss = torch.nn.functional.cross_entropy(logits[:-1], ex[1:], reduction="none")
            loss.sum().backward()
            losses[r, j:j + n - 1] = loss.detach()
            counted[r, j:j + n - 1] = 1
            j += n
        segments[r, j:] = len(lengths)
    out = {"packed_ids": ids, "packed_segments": segments, "packed_counted": counted, "packed_losses": losses}
    for n, p in model.named_parameters():
        grad = p.grad.detach().float()
        if name == "gpt2" and n.endswith(CONV1D):
            grad = grad.t()
        for hub, g in hub_tensors(model.config.model_type, n, grad):  # experts one tensor each
            out["grad/" + hub] = g.contiguous()
    model.zero_grad()
    return out


def check(model_dir, expected_file):
    exp = load_file(expected_file)
    # transformers' experts as a loop over them (its grouped_mm default needs 16-byte strides on a CPU)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, experts_implementation="eager")
    model.eval()
    with torch.no_grad():
        logits = model(exp["ids"]).logits.float()
    err = ((logits - exp["logits"]).abs().max() / exp["logits"].abs().max()).item()
    print(f"{model_dir}: relative error {err:.3e} against {expected_file}")
    return 0 if err <= TOLERANCE else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    elif len(sys.argv) == 3 and sys.argv[1] == "make4bit":
        make4bit(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "check":
        sys.exit(check(sys.argv[2], sys.argv[3]))
    else:
        print(__doc__)
        sys.exit(2)
