#include "strata/models/model_shapes.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <tuple>

namespace strata::models {

LayerTiles most_tiles(const ModelConfig& c) {
  LayerTiles t;
  t.attention = c.qk_norm || c.sandwich_norms ? 1 : c.kv_heads;
  t.mlp = c.sandwich_norms ? 1 : c.intermediate;
  // A sparse block's MLP tile is a group of experts (a dense block's of the same model a slice of
  // its features: every block has as many tiles).
  if (c.moe.enabled()) t.mlp = c.has_dense_blocks() ? std::min(c.moe.experts, c.intermediate) : c.moe.experts;
  // A 4-bit tensor is quantized whole, in bitsandbytes' blocks over its flattened elements.
  if (c.quantize.enabled()) t.attention = t.mlp = 1;
  t.vocab = c.vocab_size;
  return t;
}

void check_tiles(const ModelConfig& c, const LayerTiles& t) {
  if (t.attention < 1 || t.mlp < 1)
    throw std::invalid_argument("block tiles: " + std::to_string(t.attention) + " attention x " + std::to_string(t.mlp) +
                                " MLP tiles: each count must be at least 1");
  // Over most_tiles, saying which of its reasons: a family's norms (a tile adds its share to the
  // block's running sum, and a norm of a whole output needs the sum first; Qwen3's q/k norms
  // would be one tensor needed by every attention tile), else the model's sizes.
  const LayerTiles most = most_tiles(c);
  if (c.quantize.enabled() && (t.attention > 1 || t.mlp > 1))
    throw std::invalid_argument("block tiles: a 4-bit base (model.quantize) keeps its blocks whole (each weight is "
                                "quantized whole, as bitsandbytes does; vocabulary tiles are allowed)");
  if (c.sandwich_norms && (t.attention > most.attention || t.mlp > most.mlp))
    throw std::invalid_argument("block tiles: model '" + c.name + "' norms its attention's and MLP's whole outputs "
                                "(Gemma 2): its blocks are not cut into tiles (vocabulary tiles are)");
  if (c.qk_norm && t.attention > most.attention)
    throw std::invalid_argument("block tiles: model '" + c.name + "' norms every query and key head with one "
                                "q_norm and k_norm (Qwen3): its attention is not cut into tiles (MLP and vocabulary "
                                "tiles are)");
  if (t.attention > most.attention)
    throw std::invalid_argument("block tiles: " + std::to_string(t.attention) + " attention tiles, but model '" + c.name +
                                "' has " + std::to_string(most.attention) +
                                " key/value heads (an attention tile is a group of them)");
  if (t.mlp > 1 && c.moe.enabled() && c.moe.experts > c.hidden)
    throw std::invalid_argument("block tiles: model '" + c.name + "' has more experts (" +
                                std::to_string(c.moe.experts) + ") than hidden features (" + std::to_string(c.hidden) +
                                "): its router's logits do not fit the expert tiles' activation plane");
  if (t.mlp > most.mlp && c.moe.enabled())
    throw std::invalid_argument("block tiles: " + std::to_string(t.mlp) + " MLP tiles, but model '" + c.name + "' has " +
                                std::to_string(c.moe.experts) + " experts a sparse block (an MLP tile is a group of them)" +
                                (most.mlp < c.moe.experts ? " and " + std::to_string(most.mlp) + " features a dense block"
                                                          : std::string()));
  if (t.mlp > most.mlp)
    throw std::invalid_argument("block tiles: " + std::to_string(t.mlp) + " MLP tiles, but model '" + c.name + "' has " +
                                std::to_string(most.mlp) + " intermediate features");
  if (t.vocab < 1 || t.vocab > most.vocab)
    throw std::invalid_argument("vocabulary tiles: " + std::to_string(t.vocab) + ", but model '" + c.name + "' has " +
                                std::to_string(most.vocab) + " vocabulary rows (a tile is at least one)");
}

StageLayout stage_layout(const ModelConfig& c, const LayerTiles& t) {
  check_tiles(c, t);
  return {size_t(t.vocab), size_t(c.layers * t.block_stages()), size_t(t.vocab)};
}

Range tile_range(int64_t n, int64_t parts, int64_t i) {
  const int64_t base = n / parts, extra = n % parts;
  const int64_t begin = i * base + std::min(i, extra);
  return {begin, begin + base + (i < extra ? 1 : 0)};
}

namespace {

uint64_t adapter_elements(const ModelConfig& c, int64_t block, BlockPart part) {
  uint64_t n = 0;
  for (const AdapterShape& a : block_adapters(c, block, part)) n += uint64_t(a.elements(c.lora.r));
  return n;
}

// Elements of attention tile i (of t.attention) and MLP tile j: the norm (and the output bias)
// belong to the first tile of each.
uint64_t attention_tile_parameters(const ModelConfig& c, const LayerTiles& t, int64_t i) {
  const int64_t d = c.hidden, hd = c.head_dim, rep = c.heads / c.kv_heads;
  const int64_t kv = tile_range(c.kv_heads, t.attention, i).size() * hd, q = kv * rep;
  if (c.arch == Arch::kGpt2) return uint64_t((i == 0 ? 2 * d + d : 0) + 3 * q * d + 3 * q + d * q);
  return uint64_t((i == 0 ? d + (c.attention_out_bias ? d : 0) + (c.qk_norm ? 2 * hd : 0) : 0) + (q + 2 * kv) * d +
                  (c.attention_bias ? q + 2 * kv : 0) + d * q);
}

uint64_t mlp_tile_parameters(const ModelConfig& c, const LayerTiles& t, int64_t block, int64_t j) {
  if (c.sparse(block))  // its experts; the first also the norm and the router
    return uint64_t((j == 0 ? c.hidden + c.moe.experts * c.hidden : 0) +
                    tile_range(c.moe.experts, t.mlp, j).size() * 3 * c.hidden * c.moe.intermediate);
  const int64_t d = c.hidden, f = tile_range(c.intermediate, t.mlp, j).size();
  if (c.arch == Arch::kGpt2) return uint64_t((j == 0 ? 2 * d + d : 0) + 2 * d * f + f);
  return uint64_t((j == 0 ? d + (c.mlp_bias ? d : 0) : 0) + 3 * d * f + (c.mlp_bias ? 2 * f : 0));
}

}  // namespace

std::vector<uint64_t> stage_parameters(const ModelConfig& c, const LayerTiles& t) {
  check_tiles(c, t);
  const uint64_t d = uint64_t(c.hidden);
  std::vector<uint64_t> n;
  for (int64_t j = 0; j < t.vocab; ++j)
    n.push_back(uint64_t(tile_range(c.vocab_size, t.vocab, j).size()) * d +
                (j == 0 && c.arch == Arch::kGpt2 ? uint64_t(c.max_positions) * d : 0));
  for (int64_t i = 0; i < c.layers; ++i) {
    if (t.blocks_whole()) {
      n.push_back(uint64_t(c.block_parameters(i)) + adapter_elements(c, i, BlockPart::kWhole));
      continue;
    }
    for (int64_t a = 0; a < t.attention; ++a)
      n.push_back(attention_tile_parameters(c, t, a) + (a == 0 ? adapter_elements(c, i, BlockPart::kAttention) : 0));
    for (int64_t m = 0; m < t.mlp; ++m)
      n.push_back(mlp_tile_parameters(c, t, i, m) + (m == 0 ? adapter_elements(c, i, BlockPart::kMlp) : 0));
  }
  for (int64_t j = 0; j < t.vocab; ++j)
    n.push_back((j == 0 ? (c.arch == Arch::kGpt2 ? 2 * d : d) : 0) +
                (c.tie_embeddings ? 0 : uint64_t(tile_range(c.vocab_size, t.vocab, j).size()) * d));
  return n;
}

std::vector<uint64_t> stage_input_widths(const ModelConfig& c, const LayerTiles& t) {
  check_tiles(c, t);
  std::vector<uint64_t> w(size_t(t.vocab), 1);
  for (int64_t i = 0; i < c.layers; ++i) {
    if (t.blocks_whole()) {
      w.push_back(1);
      continue;
    }
    for (int64_t a = 0; a < t.attention; ++a) w.push_back(a == 0 ? 1 : 2);
    // A later expert tile's input also carries the router's logits, in a third plane.
    for (int64_t m = 0; m < t.mlp; ++m) w.push_back(m == 0 ? 1 : c.sparse(i) ? 3 : 2);
  }
  w.insert(w.end(), size_t(t.vocab), 1);
  return w;
}

namespace {

// The token embedding's whole name.
std::string token_embedding(const ModelConfig& c) {
  return c.arch == Arch::kGpt2 ? "transformer.wte.weight" : "model.embed_tokens.weight";
}

// A norm's tensors: GPT-2's LayerNorm has a weight and a bias, the Llama family's RMSNorm a weight.
void add_norm(const ModelConfig& c, std::vector<StageTensor>& s, const std::string& name) {
  s.push_back({name + ".weight", uint64_t(c.hidden)});
  if (c.arch == Arch::kGpt2) s.push_back({name + ".bias", uint64_t(c.hidden)});
}

// A block's tensors, whole (a = m = -1) or its attention tile a / MLP tile j: the decoder's order.
std::vector<StageTensor> block_tensors(const ModelConfig& c, const LayerTiles& t, int64_t i, int64_t a, int64_t m) {
  const uint64_t d = uint64_t(c.hidden), hd = uint64_t(c.head_dim), rep = uint64_t(c.heads / c.kv_heads);
  const bool gpt2 = c.arch == Arch::kGpt2, whole = a < 0 && m < 0;
  const std::string p = (gpt2 ? "transformer.h." : "model.layers.") + std::to_string(i) + ".";
  std::vector<StageTensor> s;
  if (whole || a >= 0) {
    const uint64_t kv = whole ? uint64_t(c.kv_heads) * hd : uint64_t(tile_range(c.kv_heads, t.attention, a).size()) * hd;
    const uint64_t q = kv * rep;
    const bool first = whole || a == 0;
    if (gpt2) {
      if (first) add_norm(c, s, p + "ln_1");
      if (whole) {
        s.push_back({p + "attn.c_attn.weight", 3 * q * d});
        s.push_back({p + "attn.c_attn.bias", 3 * q});
      } else {
        for (int k = 0; k < 3; ++k) s.push_back({p + "attn.c_attn.weight", q * d});
        for (int k = 0; k < 3; ++k) s.push_back({p + "attn.c_attn.bias", q});
      }
      s.push_back({p + "attn.c_proj.weight", d * q});
      if (first) s.push_back({p + "attn.c_proj.bias", d});
    } else {
      if (first) add_norm(c, s, p + "input_layernorm");
      s.push_back({p + "self_attn.q_proj.weight", q * d});
      s.push_back({p + "self_attn.k_proj.weight", kv * d});
      s.push_back({p + "self_attn.v_proj.weight", kv * d});
      s.push_back({p + "self_attn.o_proj.weight", d * q});
      if (c.attention_bias) {
        s.push_back({p + "self_attn.q_proj.bias", q});
        s.push_back({p + "self_attn.k_proj.bias", kv});
        s.push_back({p + "self_attn.v_proj.bias", kv});
      }
      if (first && c.attention_out_bias) s.push_back({p + "self_attn.o_proj.bias", d});
      if (c.qk_norm) {
        s.push_back({p + "self_attn.q_norm.weight", hd});
        s.push_back({p + "self_attn.k_norm.weight", hd});
      }
      if (c.sandwich_norms) add_norm(c, s, p + "post_attention_layernorm");
    }
  }
  if (whole || m >= 0) {
    const uint64_t f = whole ? uint64_t(c.intermediate) : uint64_t(tile_range(c.intermediate, t.mlp, m).size());
    const bool first = whole || m == 0;
    if (gpt2) {
      if (first) add_norm(c, s, p + "ln_2");
      s.push_back({p + "mlp.c_fc.weight", f * d});
      s.push_back({p + "mlp.c_fc.bias", f});
      s.push_back({p + "mlp.c_proj.weight", d * f});
      if (first) s.push_back({p + "mlp.c_proj.bias", d});
    } else if (c.sparse(i)) {
      if (first) {
        add_norm(c, s, p + "post_attention_layernorm");
        s.push_back({router_name(c, i), uint64_t(c.moe.experts) * d});
      }
      const uint64_t fe = uint64_t(c.moe.intermediate);
      const Range experts = whole ? Range{0, c.moe.experts} : tile_range(c.moe.experts, t.mlp, m);
      for (int64_t e = experts.begin; e < experts.end; ++e) {
        const ExpertTensors x = expert_tensors(c, i, e);
        s.push_back({x.gate, fe * d});
        s.push_back({x.up, fe * d});
        s.push_back({x.down, d * fe});
      }
    } else {
      if (first) add_norm(c, s, p + (c.sandwich_norms ? "pre_feedforward_layernorm" : "post_attention_layernorm"));
      s.push_back({p + "mlp.gate_proj.weight", f * d});
      s.push_back({p + "mlp.up_proj.weight", f * d});
      s.push_back({p + "mlp.down_proj.weight", d * f});
      if (c.mlp_bias) {
        s.push_back({p + "mlp.gate_proj.bias", f});
        s.push_back({p + "mlp.up_proj.bias", f});
        if (first) s.push_back({p + "mlp.down_proj.bias", d});
      }
      if (c.sandwich_norms) add_norm(c, s, p + "post_feedforward_layernorm");
    }
  }
  return s;
}

void add_adapter_tensors(const ModelConfig& c, int64_t block, BlockPart part, std::vector<StageTensor>& s) {
  for (const AdapterShape& a : block_adapters(c, block, part)) {
    s.push_back({adapter_a_name(a.module), uint64_t(c.lora.r * a.experts * a.in)});
    s.push_back({adapter_b_name(a.module), uint64_t(c.lora.r * a.experts * a.out)});
  }
}

}  // namespace

namespace {

// A sparse block's mixture module within the block: the router is its "gate", the experts its
// "experts.E".
std::string moe_module(const ModelConfig& c) { return c.hf_type == "mixtral" ? "block_sparse_moe" : "mlp"; }

}  // namespace

std::string router_name(const ModelConfig& c, int64_t block) {
  return block_prefix(c, block) + moe_module(c) + ".gate.weight";
}

double active_share(const ModelConfig& c, const std::string& tensor) {
  const bool expert = c.moe.enabled() && tensor.find("." + moe_module(c) + ".experts.") != std::string::npos;
  return expert ? double(c.moe.top_k) / double(c.moe.experts) : 1.0;
}

ExpertTensors expert_tensors(const ModelConfig& c, int64_t block, int64_t expert) {
  const std::string p = block_prefix(c, block) + moe_module(c) + ".experts." + std::to_string(expert) + ".";
  if (c.hf_type == "mixtral") return {p + "w1.weight", p + "w3.weight", p + "w2.weight"};
  return {p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"};
}

std::vector<std::vector<StageTensor>> stage_tensors(const ModelConfig& c, const LayerTiles& t) {
  check_tiles(c, t);
  const uint64_t d = uint64_t(c.hidden);
  const bool gpt2 = c.arch == Arch::kGpt2;
  std::vector<std::vector<StageTensor>> out;
  for (int64_t j = 0; j < t.vocab; ++j) {
    out.push_back({{token_embedding(c), uint64_t(tile_range(c.vocab_size, t.vocab, j).size()) * d}});
    if (gpt2 && j == 0) out.back().push_back({"transformer.wpe.weight", uint64_t(c.max_positions) * d});
  }
  for (int64_t i = 0; i < c.layers; ++i) {
    if (t.blocks_whole()) {
      out.push_back(block_tensors(c, t, i, -1, -1));
      add_adapter_tensors(c, i, BlockPart::kWhole, out.back());
      continue;
    }
    for (int64_t a = 0; a < t.attention; ++a) {
      out.push_back(block_tensors(c, t, i, a, -1));
      if (a == 0) add_adapter_tensors(c, i, BlockPart::kAttention, out.back());
    }
    for (int64_t m = 0; m < t.mlp; ++m) {
      out.push_back(block_tensors(c, t, i, -1, m));
      if (m == 0) add_adapter_tensors(c, i, BlockPart::kMlp, out.back());
    }
  }
  for (int64_t j = 0; j < t.vocab; ++j) {
    out.emplace_back();
    if (j == 0) add_norm(c, out.back(), gpt2 ? "transformer.ln_f" : "model.norm");
    if (!c.tie_embeddings)
      out.back().push_back({"lm_head.weight", uint64_t(tile_range(c.vocab_size, t.vocab, j).size()) * d});
  }
  return out;
}

std::vector<std::string> tensor_names(const ModelConfig& c) {
  std::vector<std::string> names;
  for (const auto& stage : stage_tensors(c))
    for (const StageTensor& x : stage) names.push_back(x.tensor);
  return names;
}

std::string unit_name(const std::string& stage_name, bool frozen) {
  return frozen ? stage_name + ".frozen" : stage_name;
}

UnitShapes unit_shapes(const ModelConfig& c, const LayerTiles& t, const TrainableTensors& trainable,
                       uint64_t elem_bytes) {
  const StageLayout L = stage_layout(c, t);
  UnitShapes out;
  out.stage_units.resize(L.stages());
  // Per stage: its trainable and frozen elements; where the token rows of an embedding stage went.
  std::vector<size_t> embedding_rows_unit(L.embedding);
  const auto add_unit = [&](size_t s, uint64_t numel, bool frozen, uint64_t dequantized) {
    if (numel == 0) return;
    out.stage_units[s].push_back(out.numel.size());
    out.numel.push_back(numel);
    out.dequantized.push_back(dequantized);
    out.frozen.push_back(frozen);
    out.stage.push_back(s);
  };
  if (trainable.all()) {
    const std::vector<uint64_t> owned = stage_parameters(c, t);
    for (size_t s = 0; s < owned.size(); ++s) add_unit(s, owned[s], false, 0);
    for (size_t j = 0; j < L.embedding; ++j) embedding_rows_unit[j] = out.stage_units[j].at(0);
  } else {
    const auto tensors = stage_tensors(c, t);
    const std::string rows = token_embedding(c);
    for (size_t s = 0; s < tensors.size(); ++s) {
      uint64_t live = 0, frozen = 0, dequantized = 0;
      bool rows_frozen = false;
      for (const StageTensor& x : tensors[s]) {
        const bool trains = trainable.trainable(x.tensor);
        if (trains) {
          live += x.numel;
        } else {  // laid out as Partition lays it (a 4-bit record where c.quantize stores one)
          const StoredTensor st = stored_tensor(c, x.tensor, x.numel, true, elem_bytes);
          frozen = stored_start(frozen, st) + st.numel;
          // Its dequantized tensor, and with double quantization the fp32 absmax made on the way.
          if (st.quantized)
            dequantized += x.numel + (c.quantize.double_quant
                                          ? ((x.numel + uint64_t(c.quantize.blocksize) - 1) / uint64_t(c.quantize.blocksize) * 4 +
                                             elem_bytes - 1) / elem_bytes
                                          : 0);
        }
        if (x.tensor == rows) rows_frozen = !trains;
      }
      add_unit(s, live, false, 0);
      add_unit(s, frozen, true, dequantized);
      if (s < L.embedding) embedding_rows_unit[s] = out.stage_units[s].at(rows_frozen && live > 0 ? 1 : 0);
    }
  }
  // A tied head stage j also uses the unit of embedding stage j's token rows.
  if (c.tie_embeddings)
    for (size_t j = 0; j < L.head; ++j) out.stage_units[L.first_head() + j].push_back(embedding_rows_unit[j]);
  // A block tile after the first of its attention (MLP) uses the adapters the first holds: that
  // tile's trainable unit, its first.
  if (!t.blocks_whole())
    for (int64_t i = 0; i < c.layers; ++i) {
      const size_t first = L.first_block() + size_t(i * t.block_stages());
      for (const auto& [part, begin, count] : {std::tuple{BlockPart::kAttention, first, t.attention},
                                               std::tuple{BlockPart::kMlp, first + size_t(t.attention), t.mlp}}) {
        if (adapter_elements(c, i, part) == 0) continue;
        for (int64_t k = 1; k < count; ++k) out.stage_units[begin + size_t(k)].push_back(out.stage_units[begin].at(0));
      }
    }
  return out;
}

std::vector<std::vector<size_t>> stage_units(const ModelConfig& c, const LayerTiles& t) {
  return unit_shapes(c, t, TrainableTensors()).stage_units;
}

std::string stage_name(const ModelConfig& c, const LayerTiles& t, size_t stage) {
  const StageLayout L = stage_layout(c, t);
  if (stage >= L.stages()) throw std::out_of_range("no stage " + std::to_string(stage));
  const auto tile = [&](const std::string& name, size_t j) {
    return t.vocab == 1 ? name : name + "." + std::to_string(j);
  };
  if (stage < L.first_block()) return tile("embedding", stage);
  if (stage >= L.first_head()) return tile("head", stage - L.first_head());
  const size_t per_block = size_t(t.block_stages());
  const size_t block = (stage - L.first_block()) / per_block;
  const int64_t k = int64_t((stage - L.first_block()) % per_block);
  const std::string name = "block." + std::to_string(block);
  if (t.blocks_whole()) return name;
  return k < t.attention ? name + ".attn." + std::to_string(k) : name + ".mlp." + std::to_string(k - t.attention);
}

}  // namespace strata::models
