// Block tiles (a block's attention in groups of key/value heads, its MLP in slices of the
// intermediate dimension or, a sparse block's, in groups of experts) and vocabulary tiles (the embedding's and the LM head's rows), each a
// stage of its own (decoder_stages.h; LayerTiles).
#include "decoder_stages.h"

#include <cmath>

#include "strata/models/model_shapes.h"
#include "strata/models/moe.h"

namespace strata::models::detail {

namespace {

// ---------------------------------------------------------------- block tiles
// A block's attention cut into groups of key/value heads, its MLP into slices of the
// intermediate dimension (LayerTiles). A tile's input is the block's input (its first tile) or
// the previous tile's output stacked [2, ...]: the normed input and the running sum. It adds its
// contribution to the sum and passes both on, the last tile only the sum. The first tile of each
// holds the norm and the output projection's bias, so every parameter has one owner.
class Tile : public Stage {
 protected:
  Tile(const ModelConfig& c, int64_t index, int64_t count) : c_(c), first_(index == 0), last_(index + 1 == count) {}
  // (normed input, running sum) from the tile's input. unbind, not two selects: its backward
  // stacks the two gradients in one pass, where each select's would fill a zero tensor of the
  // stacked size, copy its half in, and the two would then be added (five kernels and about ten
  // activation passes more at every tile boundary of the backward).
  std::pair<at::Tensor, at::Tensor> split_input(const at::Tensor& z) {
    if (!first_) {
      const std::vector<at::Tensor> parts = z.unbind(0);
      return {parts[0], parts[1]};
    }
    return {norm(z), z};
  }
  at::Tensor join(const at::Tensor& normed, const at::Tensor& sum) const {
    return last_ ? sum : at::stack({normed, sum});
  }
  at::Tensor norm(const at::Tensor& x) const {
    if (c_.arch == Arch::kGpt2) return at::layer_norm(x, {c_.hidden}, norm_w, norm_b, c_.norm_eps);
    return rms_norm(x, norm_w, c_.norm_eps, c_.gemma);
  }
  void add_norm(const std::string& name) {
    norm_w = add(name + ".weight", {c_.hidden});
    if (c_.arch == Arch::kGpt2) norm_b = add(name + ".bias", {c_.hidden});
  }
  ModelConfig c_;
  bool first_, last_;
  at::Tensor norm_w, norm_b;
};

// LoRA: the attention's adapters are whole tensors of the first tile; each tile takes its rows of
// the q/k/v adapters' B and its columns of the output projection's A (Stage::adapter_part), so the
// tiles' outputs and their sum are the adapted block's.
class AttentionTile final : public Tile {
  at::Tensor inv_freq_;

 public:
  // `first`: the block's first attention tile (null for it).
  AttentionTile(const ModelConfig& c, int64_t block, int64_t index, int64_t count, const Stage* first)
      : Tile(c, index, count), window_(c.attention_window(block)) {
    const int64_t d = c.hidden, hd = c.head_dim, rep = c.heads / c.kv_heads;
    const Range kv = tile_range(c.kv_heads, count, index);
    kv_heads_ = kv.size();
    const int64_t k0 = kv.begin * hd, k1 = kv.end * hd, q0 = k0 * rep, q1 = k1 * rep;
    k0_ = k0, k1_ = k1, q0_ = q0, q1_ = q1;
    add_base(c, block, d, k0, k1, q0, q1);
    if (first) share_adapters(*first);
    else add_adapters(c, block, BlockPart::kAttention);
  }

  at::Tensor forward(const at::Tensor& z, const TokenLayout& layout) override {
    auto [n, sum] = split_input(z);
    const int64_t hd = c_.head_dim, rep = c_.heads / c_.kv_heads, d = c_.hidden;
    const bool gpt2 = c_.arch == Arch::kGpt2;
    // GPT-2's fused c_attn: q, k and v are rows [0, d), [d, 2d) and [2d, 3d) of its output.
    const auto rows = [&](const std::string& module, int64_t offset, int64_t b, int64_t e) {
      return adapter_part(module, 0, offset + b, offset + e);
    };
    const std::string qm = gpt2 ? "attn.c_attn" : "self_attn.q_proj", km = gpt2 ? qm : "self_attn.k_proj",
                      vm = gpt2 ? qm : "self_attn.v_proj", om = gpt2 ? "attn.c_proj" : "self_attn.o_proj";
    at::Tensor q = split_heads(adapted(n, wq, bq, rows(qm, 0, q0_, q1_)), kv_heads_ * rep, hd);
    at::Tensor k = split_heads(adapted(n, wk, bk, gpt2 ? rows(km, d, q0_, q1_) : rows(km, 0, k0_, k1_)), kv_heads_, hd);
    at::Tensor v = split_heads(adapted(n, wv, bv, gpt2 ? rows(vm, 2 * d, q0_, q1_) : rows(vm, 0, k0_, k1_)), kv_heads_, hd);
    at::Tensor a = gpt2 ? attention(q, k, v, layout, 0)
                        : llama_attention(c_, q, k, v, layout, window_, inv_freq_, q_norm, k_norm);
    return join(n, sum + adapted(merge_heads(a), wo, bo, adapter_part(om, 1, q0_, q1_)));
  }

 private:
  void add_base(const ModelConfig& c, int64_t block, int64_t d, int64_t k0, int64_t k1, int64_t q0, int64_t q1) {
    if (c.arch == Arch::kGpt2) {
      const std::string p = "transformer.h." + std::to_string(block) + ".";
      if (first_) add_norm(p + "ln_1");
      const std::string w = p + "attn.c_attn.weight", b = p + "attn.c_attn.bias";
      wq = add_part(w, {3 * d, d}, 0, q0, q1);
      wk = add_part(w, {3 * d, d}, 0, d + q0, d + q1);
      wv = add_part(w, {3 * d, d}, 0, 2 * d + q0, 2 * d + q1);
      bq = add_part(b, {3 * d}, 0, q0, q1);
      bk = add_part(b, {3 * d}, 0, d + q0, d + q1);
      bv = add_part(b, {3 * d}, 0, 2 * d + q0, 2 * d + q1);
      wo = add_part(p + "attn.c_proj.weight", {d, d}, 1, q0, q1);
      if (first_) bo = add(p + "attn.c_proj.bias", {d});
      return;
    }
    const std::string p = "model.layers." + std::to_string(block) + ".";
    const int64_t q = c.heads * c.head_dim, kvd = c.kv_heads * c.head_dim;
    if (first_) add_norm(p + "input_layernorm");
    wq = add_part(p + "self_attn.q_proj.weight", {q, d}, 0, q0, q1);
    wk = add_part(p + "self_attn.k_proj.weight", {kvd, d}, 0, k0, k1);
    wv = add_part(p + "self_attn.v_proj.weight", {kvd, d}, 0, k0, k1);
    wo = add_part(p + "self_attn.o_proj.weight", {d, q}, 1, q0, q1);
    if (c.attention_bias) {
      bq = add_part(p + "self_attn.q_proj.bias", {q}, 0, q0, q1);
      bk = add_part(p + "self_attn.k_proj.bias", {kvd}, 0, k0, k1);
      bv = add_part(p + "self_attn.v_proj.bias", {kvd}, 0, k0, k1);
    }
    if (first_ && c.attention_out_bias) bo = add(p + "self_attn.o_proj.bias", {d});
    if (c.qk_norm) {  // Qwen3 (one attention tile: check_tiles)
      q_norm = add(p + "self_attn.q_norm.weight", {c.head_dim});
      k_norm = add(p + "self_attn.k_norm.weight", {c.head_dim});
    }
  }

  int64_t window_, kv_heads_ = 0, k0_ = 0, k1_ = 0, q0_ = 0, q1_ = 0;
  at::Tensor wq, wk, wv, wo, bq, bk, bv, bo, q_norm, k_norm;
};

// LoRA: the MLP's adapters are whole tensors of the first tile; each tile takes its rows of the
// up/gate adapters' B and its columns of the down projection's A.
class MlpTile final : public Tile {
 public:
  // `first`: the block's first MLP tile (null for it).
  MlpTile(const ModelConfig& c, int64_t block, int64_t index, int64_t count, const Stage* first)
      : Tile(c, index, count), features_(tile_range(c.intermediate, count, index)) {
    add_base(c, block);
    if (first) share_adapters(*first);
    else add_adapters(c, block, BlockPart::kMlp);
  }

  at::Tensor forward(const at::Tensor& z, const TokenLayout&) override {
    auto [n, sum] = split_input(z);
    const bool gpt2 = c_.arch == Arch::kGpt2;
    const int64_t b = features_.begin, e = features_.end;
    const tiling::LowRank up = adapter_part(gpt2 ? "mlp.c_fc" : "mlp.up_proj", 0, b, e),
                          gate = gpt2 ? tiling::LowRank{} : adapter_part("mlp.gate_proj", 0, b, e),
                          down = adapter_part(gpt2 ? "mlp.c_proj" : "mlp.down_proj", 1, b, e);
    return join(n, sum + mlp(c_, n, {wu, bu, wg, bg, wd, bd, up, gate, down}, mlp_chunk_));
  }

 private:
  void add_base(const ModelConfig& c, int64_t block) {
    const int64_t d = c.hidden, f = c.intermediate;
    const Range r = features_;
    if (c.arch == Arch::kGpt2) {
      const std::string p = "transformer.h." + std::to_string(block) + ".";
      if (first_) add_norm(p + "ln_2");
      wu = add_part(p + "mlp.c_fc.weight", {f, d}, 0, r.begin, r.end);
      bu = add_part(p + "mlp.c_fc.bias", {f}, 0, r.begin, r.end);
      wd = add_part(p + "mlp.c_proj.weight", {d, f}, 1, r.begin, r.end);
      if (first_) bd = add(p + "mlp.c_proj.bias", {d});
      return;
    }
    const std::string p = "model.layers." + std::to_string(block) + ".";
    if (first_) add_norm(p + "post_attention_layernorm");
    wg = add_part(p + "mlp.gate_proj.weight", {f, d}, 0, r.begin, r.end);
    wu = add_part(p + "mlp.up_proj.weight", {f, d}, 0, r.begin, r.end);
    wd = add_part(p + "mlp.down_proj.weight", {d, f}, 1, r.begin, r.end);
    if (c.mlp_bias) {
      bg = add_part(p + "mlp.gate_proj.bias", {f}, 0, r.begin, r.end);
      bu = add_part(p + "mlp.up_proj.bias", {f}, 0, r.begin, r.end);
      if (first_) bd = add(p + "mlp.down_proj.bias", {d});
    }
  }

  Range features_;
  at::Tensor wg, wu, wd, bg, bu, bd;
};

// A sparse block's MLP cut into groups of consecutive experts (ModelConfig::Moe; LayerTiles::mlp).
// The first tile holds the norm and the router: it norms the block's running sum and computes the
// router's logits once; every tile routes from those logits (the same choices and weights) and
// adds its experts' share. Between tiles the activation is [3, ...]: the normed input, the running
// sum and the router's logits (in the weights' dtype, as transformers computes them) in the first
// `experts` features of a third plane (check_tiles: experts <= hidden), so a later tile's routing
// gradient reaches the router through the first tile's backward and no tile shares another's
// unit; the last tile passes only the sum. LoRA on the experts (target_parameters): the fused
// adapters are whole tensors of the first tile; each tile takes its experts' rows and columns.
class ExpertTile final : public Stage {
 public:
  // `first`: the block's first expert tile (null for it), which holds the experts' adapters.
  ExpertTile(const ModelConfig& c, int64_t block, int64_t index, int64_t count, const Stage* first)
      : c_(c), first_(index == 0), last_(index + 1 == count), experts_(tile_range(c.moe.experts, count, index)) {
    const int64_t d = c.hidden;
    if (first_) {
      norm_w = add(block_prefix(c, block) + "post_attention_layernorm.weight", {d});
      router = add(router_name(c, block), {c.moe.experts, d});
    }
    weights_ = add_experts(c, block, experts_);
    if (first) share_adapters(*first);
    else add_adapters(c, block, BlockPart::kMlp);
  }

  at::Tensor forward(const at::Tensor& z, const TokenLayout& layout) override {
    const int64_t d = c_.hidden, E = c_.moe.experts;
    at::Tensor n, sum, logits;
    if (first_) {
      sum = z;
      n = rms_norm(z, norm_w, c_.norm_eps, c_.gemma);
      logits = dense(n, router);
    } else {
      const std::vector<at::Tensor> parts = z.unbind(0);
      n = parts[0];
      sum = parts[1];
      logits = parts[2].narrow(-1, 0, E);
    }
    const Routing r = route(c_, logits.reshape({-1, E}));
    if (first_) routing_stats(c_, r, stats_, layout.padding());
    sum = sum + experts_mlp(c_, n.reshape({-1, d}), r, adapted_experts(c_, weights_, experts_.begin), experts_.begin)
                    .view(n.sizes());
    if (last_) return sum;
    return at::stack({n, sum, E == d ? logits : at::constant_pad_nd(logits, {0, d - E})});
  }
  const RouterStats* router_stats() const override { return first_ ? &stats_ : nullptr; }

 private:
  ModelConfig c_;
  bool first_, last_;
  Range experts_;
  at::Tensor norm_w, router;
  std::vector<tiling::MlpWeights> weights_;
  RouterStats stats_;
};

// ---------------------------------------------------------------- vocabulary tiles
// The embedding cut into row ranges (LayerTiles::vocab): a tile's forward is the lookup of the
// token ids in its rows and zero for the others, so that the tiles' sum is the whole lookup
// exactly (every token gets its row from one tile and zeros from the rest); the first tile also
// adds GPT-2's positions.
class EmbeddingTile final : public Stage {
 public:
  EmbeddingTile(const ModelConfig& c, int64_t index, int64_t count) : c_(c) {
    const Range r = tile_range(c.vocab_size, count, index);
    begin_ = r.begin;
    end_ = r.end;
    const bool gpt2 = c.arch == Arch::kGpt2;
    wte = add_part(gpt2 ? "transformer.wte.weight" : "model.embed_tokens.weight", {c.vocab_size, c.hidden}, 0, r.begin,
                   r.end);
    if (gpt2 && index == 0) wpe = add("transformer.wpe.weight", {c.max_positions, c.hidden});
  }
  at::Tensor forward(const at::Tensor& ids, const TokenLayout& layout) override {
    const at::Tensor here = ids.ge(begin_).logical_and(ids.lt(end_));
    at::Tensor h = at::where(here.unsqueeze(-1), at::embedding(wte, (ids - begin_).clamp(0, end_ - begin_ - 1)), 0.0);
    if (c_.gemma) h = h * at::scalar_tensor(std::sqrt(double(c_.hidden)), h.options()).to(h.scalar_type());
    if (wpe.defined()) h = h + learned_positions(wpe, layout, ids.size(1));
    return h;
  }
  at::Tensor wte, wpe;

 private:
  ModelConfig c_;
  int64_t begin_ = 0, end_ = 0;
};

// The LM head cut into row ranges: the first tile holds the final norm; a tied tile uses its
// embedding tile's rows.
class HeadTile final : public HeadStage {
 public:
  HeadTile(const ModelConfig& c, int64_t index, int64_t count, const at::Tensor& tied_rows) : c_(c) {
    softcap_ = c.final_softcap;
    const Range r = tile_range(c.vocab_size, count, index);
    begin_ = r.begin;
    if (index == 0) {
      const std::string n = c.arch == Arch::kGpt2 ? "transformer.ln_f" : "model.norm";
      norm_w = add(n + ".weight", {c.hidden});
      if (c.arch == Arch::kGpt2) norm_b = add(n + ".bias", {c.hidden});
    }
    w_ = c.tie_embeddings ? register_parameter("tied_embedding", tied_rows)
                          : add_part("lm_head.weight", {c.vocab_size, c.hidden}, 0, r.begin, r.end);
  }
  at::Tensor normed(const at::Tensor& x) override {
    if (!norm_w.defined()) throw std::logic_error("HeadTile: only the first head tile holds the final norm");
    if (c_.arch == Arch::kGpt2) return at::layer_norm(x, {c_.hidden}, norm_w, norm_b, c_.norm_eps);
    return rms_norm(x, norm_w, c_.norm_eps, c_.gemma);
  }
  const at::Tensor& lm_weight() const override { return w_; }
  int64_t vocab_begin() const override { return begin_; }
  bool has_norm() const override { return norm_w.defined(); }

 private:
  ModelConfig c_;
  int64_t begin_ = 0;
  at::Tensor w_, norm_w, norm_b;
};

}  // namespace

std::vector<std::shared_ptr<Stage>> make_block_tiles(const ModelConfig& c, int64_t block, const LayerTiles& t) {
  std::vector<std::shared_ptr<Stage>> tiles;
  for (int64_t a = 0; a < t.attention; ++a)
    tiles.push_back(std::make_shared<AttentionTile>(c, block, a, t.attention, a ? tiles[0].get() : nullptr));
  const size_t first_mlp = tiles.size();
  for (int64_t m = 0; m < t.mlp; ++m)
    if (c.sparse(block))
      tiles.push_back(std::make_shared<ExpertTile>(c, block, m, t.mlp, m ? tiles[first_mlp].get() : nullptr));
    else tiles.push_back(std::make_shared<MlpTile>(c, block, m, t.mlp, m ? tiles[first_mlp].get() : nullptr));
  return tiles;
}

std::shared_ptr<Stage> make_embedding_tile(const ModelConfig& c, int64_t j, int64_t count) {
  return std::make_shared<EmbeddingTile>(c, j, count);
}

std::shared_ptr<HeadStage> make_head_tile(const ModelConfig& c, int64_t j, int64_t count, const at::Tensor& tied_rows) {
  return std::make_shared<HeadTile>(c, j, count, tied_rows);
}

}  // namespace strata::models::detail
