// The Decoder: its stages (decoder_stages.h: whole, or cut into tiles), their parameters and
// adapters, the cut, and the initialization or load of their values, group by group.
#include "strata/models/decoder.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <map>
#include <stdexcept>

#include "decoder_stages.h"
#include "strata/models/model_shapes.h"
#include "strata/models/moe.h"

namespace strata::models {

using namespace detail;

namespace {

bool is_norm_weight(const std::string& n) {
  return n.find("ln_") != std::string::npos || n.find("norm") != std::string::npos;
}

}  // namespace

at::Tensor HeadStage::forward(const at::Tensor& x, const TokenLayout&) {
  return tiling::soft_cap(dense(normed(x), lm_weight()), softcap_);
}

std::string TensorPart::name() const {
  if (whole()) return tensor;
  return tensor + (dim == 0 ? "[" : "[:,") + std::to_string(begin) + ":" + std::to_string(end) + "]";
}

at::Tensor Stage::add(const std::string& hf_name, std::vector<int64_t> shape) {
  parts_.push_back({hf_name, shape, 0, 0, shape.empty() ? 0 : shape[0]});
  at::Tensor t = register_parameter(module_name(hf_name), at::empty(shape, at::kFloat));
  params_.emplace_back(hf_name, t);
  return t;
}

at::Tensor Stage::add_part(const std::string& hf_name, std::vector<int64_t> whole, int64_t dim, int64_t begin,
                           int64_t end) {
  TensorPart part{hf_name, whole, dim, begin, end};
  std::vector<int64_t> shape = whole;
  shape[size_t(dim)] = end - begin;
  const std::string name = part.name();
  parts_.push_back(std::move(part));
  at::Tensor t = register_parameter(module_name(name), at::empty(shape, at::kFloat));
  params_.emplace_back(name, t);
  return t;
}

std::vector<tiling::MlpWeights> Stage::add_experts(const ModelConfig& c, int64_t block, Range experts) {
  const int64_t d = c.hidden, f = c.moe.intermediate;
  std::vector<tiling::MlpWeights> out;
  for (int64_t e = experts.begin; e < experts.end; ++e) {
    const ExpertTensors x = expert_tensors(c, block, e);
    tiling::MlpWeights w;
    w.gate = add(x.gate, {f, d});
    w.up = add(x.up, {f, d});
    w.down = add(x.down, {d, f});
    out.push_back(w);
  }
  return out;
}

at::Tensor Stage::lm_head_weight(const ModelConfig& c, const at::Tensor& tied_embedding) {
  if (!c.tie_embeddings) return add("lm_head.weight", {c.vocab_size, c.hidden});
  return register_parameter("tied_embedding", tied_embedding);
}

std::vector<std::pair<std::string, at::Tensor>> Stage::hf_parameters() const { return params_; }

void Stage::add_adapters(const ModelConfig& c, int64_t block, BlockPart part) {
  const std::string prefix = block_prefix(c, block);
  for (const AdapterShape& a : block_adapters(c, block, part)) {
    tiling::LowRank l;
    l.a = add(adapter_a_name(a.module), {c.lora.r * a.experts, a.in});
    l.b = add(adapter_b_name(a.module), {a.out, c.lora.r * a.experts});
    l.scaling = c.lora.scaling();
    adapters_[a.module.substr(prefix.size())] = l;
  }
}

tiling::LowRank Stage::adapter(const std::string& module) const {
  const auto it = adapters_.find(module);
  return it == adapters_.end() ? tiling::LowRank{} : it->second;
}

at::Tensor Stage::adapted(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const std::string& module) const {
  return adapted(x, w, b, adapter(module));
}

at::Tensor Stage::adapted(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const tiling::LowRank& l) {
  at::Tensor y = dense(x, w, b);
  if (!l.defined()) return y;
  return y + at::linear(at::linear(x, l.a), l.b) * l.scaling;
}

void Stage::share_adapters(const Stage& first) {
  for (const auto& [module, l] : first.adapters_) {
    tiling::LowRank mine = l;
    mine.a = register_parameter("shared_" + module_name(module) + "_lora_A", l.a);
    mine.b = register_parameter("shared_" + module_name(module) + "_lora_B", l.b);
    adapters_[module] = mine;
  }
}

tiling::LowRank Stage::adapter_part(const std::string& module, int64_t dim, int64_t begin, int64_t end) const {
  tiling::LowRank l = adapter(module);
  if (!l.defined()) return l;
  if (dim == 0) l.b = l.b.narrow(0, begin, end - begin);
  else l.a = l.a.narrow(1, begin, end - begin);
  return l;
}

std::vector<tiling::MlpWeights> Stage::adapted_experts(const ModelConfig& c,
                                                       const std::vector<tiling::MlpWeights>& experts,
                                                       int64_t first) const {
  const tiling::LowRank gate_up = adapter(std::string("mlp.experts.") + kExpertGateUp),
                        down = adapter(std::string("mlp.experts.") + kExpertDown);
  if (!gate_up.defined() && !down.defined()) return experts;
  const int64_t E = c.moe.experts, f = c.moe.intermediate;
  std::vector<tiling::MlpWeights> out = experts;
  for (size_t i = 0; i < out.size(); ++i) {
    const int64_t e = first + int64_t(i);
    if (gate_up.defined()) {  // gate and up: one A, the two halves of B
      out[i].gate_lora = expert_adapter(gate_up, E, e, 0, f);
      out[i].up_lora = expert_adapter(gate_up, E, e, f, f);
    }
    if (down.defined()) out[i].down_lora = expert_adapter(down, E, e, 0, c.hidden);
  }
  return out;
}

Decoder::Decoder(const ModelConfig& config, uint64_t seed, Init init) : config_(config) {
  config_.validate();
  embeds_ = {make_embedding(config_)};
  heads_ = {make_head(config_, token_weight(*embeds_[0]))};
  for (int64_t i = 0; i < config_.layers; ++i) blocks_.push_back({make_block(config_, i)});
  init_gen_ = at::make_generator<at::CPUGeneratorImpl>(seed);
  adapter_gen_ = at::make_generator<at::CPUGeneratorImpl>(seed ^ 0x9e3779b97f4a7c15ull);
  if (init == Init::kNow) initialize_through(stages().size() - 1);
}

Stage& Decoder::embedding() {
  if (tiles_.vocab != 1) throw std::logic_error("Decoder::embedding: the vocabulary is tiled (read stages())");
  return *embeds_.at(0);
}

HeadStage& Decoder::head() {
  if (tiles_.vocab != 1) throw std::logic_error("Decoder::head: the vocabulary is tiled (head_tile())");
  return *heads_.at(0);
}

Stage& Decoder::block(size_t i) {
  if (!tiles_.blocks_whole()) throw std::logic_error("Decoder::block: the blocks are tiled (read stages())");
  return *blocks_.at(i).at(0);
}

std::vector<std::shared_ptr<Stage>> Decoder::make_tiles(int64_t block) const {
  return make_block_tiles(config_, block, tiles_);
}

void Decoder::recut(std::vector<Stage*> old, const std::vector<Stage*>& next, bool holds) {
  at::NoGradGuard no_grad;
  // The new stages' tensors take the old ones' dtype and device (a model already converted).
  const at::TensorOptions opts = old.at(0)->hf_parameters().at(0).second.options();
  if (opts.dtype() != at::kFloat || !opts.device().is_cpu())
    for (Stage* st : next)
      for (auto& [name, t] : st->hf_parameters()) t.set_data(at::empty(t.sizes(), opts));
  if (!holds) return;
  std::map<std::string, at::Tensor> whole;  // the group's tensors, assembled from their parts
  for (Stage* st : old)
    for (size_t k = 0; k < st->parts().size(); ++k) {
      const TensorPart& p = st->parts()[k];
      at::Tensor& w = whole[p.tensor];
      if (!w.defined()) w = at::empty(p.shape, at::kFloat);
      w.narrow(p.dim, p.begin, p.end - p.begin).copy_(st->hf_parameters()[k].second);
    }
  for (Stage* st : next)
    for (size_t k = 0; k < st->parts().size(); ++k) {
      const TensorPart& p = st->parts()[k];
      st->hf_parameters()[k].second.copy_(whole.at(p.tensor).narrow(p.dim, p.begin, p.end - p.begin));
    }
}

void Decoder::set_tiles(const LayerTiles& tiles) {
  check_tiles(config_, tiles);
  if (tiles == tiles_) return;
  const LayerTiles was = tiles_;
  tiles_ = tiles;
  if (tiles_.vocab != was.vocab) {
    const auto raw = [](const auto& v) {
      std::vector<Stage*> out;
      for (const auto& st : v) out.push_back(st.get());
      return out;
    };
    std::vector<std::shared_ptr<Stage>> embeds;
    std::vector<std::shared_ptr<HeadStage>> heads;
    if (tiles_.vocab == 1) {
      embeds = {make_embedding(config_)};
      heads = {make_head(config_, token_weight(*embeds[0]))};
    } else {
      for (int64_t j = 0; j < tiles_.vocab; ++j) embeds.push_back(make_embedding_tile(config_, j, tiles_.vocab));
      for (int64_t j = 0; j < tiles_.vocab; ++j)
        heads.push_back(make_head_tile(config_, j, tiles_.vocab, token_weight(*embeds[size_t(j)])));
    }
    // The embedding first: a tied head's tiles use its new tensors, converted there.
    recut(raw(embeds_), raw(embeds), initialized_ > 0);
    embeds_ = std::move(embeds);
    recut(raw(heads_), raw(heads), initialized_ > blocks_.size() + 1);
    heads_ = std::move(heads);
  }
  if (tiles_.attention == was.attention && tiles_.mlp == was.mlp) return;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    std::vector<std::shared_ptr<Stage>> next =
        tiles_.blocks_whole() ? std::vector<std::shared_ptr<Stage>>{make_block(config_, int64_t(i))}
                               : make_tiles(int64_t(i));
    std::vector<Stage*> old, fresh;
    for (auto& st : blocks_[i]) old.push_back(st.get());
    for (auto& st : next) fresh.push_back(st.get());
    recut(old, fresh, 1 + i < initialized_);
    for (auto& st : next) st->set_mlp_token_chunk(mlp_chunk_);
    blocks_[i] = std::move(next);
  }
}

uint64_t Decoder::block_graph_bytes_per_token(size_t e) const { return models::block_graph_bytes_per_token(config_, e); }

size_t Decoder::group_of(size_t stage) const {
  if (stage < embeds_.size()) return 0;
  size_t s = embeds_.size();
  for (size_t i = 0; i < blocks_.size(); ++i) {
    if (stage < s + blocks_[i].size()) return 1 + i;
    s += blocks_[i].size();
  }
  if (stage < s + heads_.size()) return blocks_.size() + 1;
  throw std::out_of_range("Decoder: no stage " + std::to_string(stage));
}

std::vector<Stage*> Decoder::group(size_t g) const {
  std::vector<Stage*> members;
  if (g == 0)
    for (auto& st : embeds_) members.push_back(st.get());
  else if (g == blocks_.size() + 1)
    for (auto& st : heads_) members.push_back(st.get());
  else
    for (auto& st : blocks_.at(g - 1)) members.push_back(st.get());
  return members;
}

std::string Decoder::stage_name(size_t stage) const { return models::stage_name(config_, tiles_, stage); }

// Initial values: the source's where it holds the tensor; else a 1-D tensor a constant by its
// name, any other normal(0, 0.02) from the one stream; each whole in the untiled block's order
// and then cut into the parts that hold it, so that every tiling starts from the same weights.
void Decoder::initialize_group(size_t g) {
  const std::vector<Stage*> members = group(g);
  std::vector<std::pair<std::string, std::vector<int64_t>>> order;  // whole tensors, untiled order
  if (members.size() > 1) {
    // The untiled stage lists them (its untouched pages take no memory).
    const std::shared_ptr<Stage> untiled =
        g == 0 ? make_embedding(config_)
        : g == blocks_.size() + 1
            ? make_head(config_, at::empty({config_.vocab_size, config_.hidden}, at::kFloat))
            : make_block(config_, int64_t(g - 1));
    for (const TensorPart& p : untiled->parts()) order.emplace_back(p.tensor, p.shape);
  } else {
    for (const TensorPart& p : members[0]->parts()) order.emplace_back(p.tensor, p.shape);
  }
  for (const auto& [name, shape] : order) {
    at::Tensor whole;  // the member holding the tensor whole, if any
    for (Stage* st : members)
      for (size_t k = 0; k < st->parts().size(); ++k)
        if (st->parts()[k].tensor == name && st->parts()[k].whole()) whole = st->hf_parameters()[k].second;
    if (reads_record(name)) continue;  // a 4-bit record: its fp32 storage stays untouched
    // A tensor held in parts is loaded or drawn whole, then cut.
    at::Tensor drawn;
    bool loaded = false;
    if (source_) {
      drawn = whole.defined() ? whole : at::empty(shape, at::kFloat);
      loaded = source_(name, drawn);
    }
    if (!loaded && shape.size() != 1) {
      if (!drawn.defined()) drawn = whole.defined() ? whole : at::empty(shape, at::kFloat);
      // LoRA as PEFT initializes it: A as nn.Linear's default (kaiming_uniform_ with a = sqrt(5):
      // uniform within 1 / sqrt(in)), B zero, so that the adapted model starts as the base.
      if (name.ends_with(".lora_A.weight")) drawn.uniform_(-1.0 / std::sqrt(double(shape[1])), 1.0 / std::sqrt(double(shape[1])), adapter_gen_);
      else if (name.ends_with(".lora_B.weight")) drawn.zero_();
      else drawn.normal_(0.0, 0.02, init_gen_);
    }
    for (Stage* st : members)
      for (size_t k = 0; k < st->parts().size(); ++k) {
        const TensorPart& p = st->parts()[k];
        if (p.tensor != name) continue;
        at::Tensor t = st->hf_parameters()[k].second;
        const bool filled = loaded || shape.size() != 1;
        if (p.whole() && filled) continue;  // loaded or drawn in place
        if (filled) t.copy_(drawn.narrow(p.dim, p.begin, p.end - p.begin));
        else if (is_norm_weight(name) && name.ends_with("weight")) t.fill_(config_.gemma ? 0.0 : 1.0);  // Gemma: (1 + weight)
        else t.zero_();
      }
  }
}

void Decoder::initialize_through(size_t stage) {
  const size_t last = group_of(stage);
  at::NoGradGuard no_grad;
  for (; initialized_ <= last; ++initialized_) initialize_group(initialized_);
  if (initialized_ == blocks_.size() + 2) source_ = nullptr;  // every group done: its files unmapped
}

void Decoder::set_mlp_token_chunk(int64_t tokens) {
  if (tokens < 0) throw std::invalid_argument("Decoder: the MLP's token chunk must be >= 0, not " + std::to_string(tokens));
  mlp_chunk_ = tokens;
  for (auto& b : blocks_)
    for (auto& st : b) st->set_mlp_token_chunk(tokens);
}

std::vector<Stage*> Decoder::stages() {
  std::vector<Stage*> s;
  for (auto& st : embeds_) s.push_back(st.get());
  for (auto& b : blocks_)
    for (auto& st : b) s.push_back(st.get());
  for (auto& st : heads_) s.push_back(st.get());
  return s;
}

at::Tensor Decoder::forward(const at::Tensor& ids, const TokenLayout& layout) {
  at::Tensor h = embeds_[0]->forward(ids, layout);
  for (size_t j = 1; j < embeds_.size(); ++j) h = h + embeds_[j]->forward(ids, layout);
  for (auto& b : blocks_)
    for (auto& st : b) h = st->forward(h, layout);
  if (heads_.size() == 1) return heads_[0]->forward(h);
  const at::Tensor n = heads_[0]->normed(h);
  std::vector<at::Tensor> logits;
  for (auto& t : heads_) logits.push_back(at::linear(n, t->lm_weight()));
  return tiling::soft_cap(at::cat(logits, -1), heads_[0]->logit_softcap());
}

std::vector<std::pair<std::string, at::Tensor>> Decoder::hf_parameters() {
  if (!tiles_.blocks_whole() || tiles_.vocab != 1)
    throw std::logic_error("Decoder::hf_parameters: the model is tiled and holds no whole tensor of what is tiled (read "
                           "stages()' parts())");
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (Stage* s : stages()) {
    for (auto& p : s->hf_parameters()) out.push_back(p);
  }
  return out;
}

void Decoder::to(at::ScalarType dtype) {
  at::NoGradGuard no_grad;
  for (Stage* s : stages())
    for (auto& [name, t] : s->hf_parameters()) t.set_data(t.to(dtype));
}

}  // namespace strata::models
