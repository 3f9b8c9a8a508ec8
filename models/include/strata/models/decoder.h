// Decoder-only transformers (GPT-2, Llama family) as a sequence of independently runnable stages:
// an embedding stage, `layers` transformer blocks and a head (final norm + LM head), so that the
// engine can fetch, run, recompute and release one unit at a time.
//
// Each stage is a torch::nn::Module whose forward is a pure function of its input and its own
// parameters (no dropout, no state): running a block again on its saved input (activation
// recompute) gives bitwise the same output. Parameters are named as in Hugging Face checkpoints
// (hf_name()), with Strata's layout: every linear weight is [out, in] (GPT-2's Conv1D weights are
// transposed on load and export, see hf_io.h).
//
// Tied embeddings: the head reuses the embedding stage's token-embedding tensor (the same
// at::Tensor). It is a registered parameter of both modules (so each stage's parameters() is
// complete on its own) but appears once in hf_parameters(), under the embedding's name.
// Thread safety: a Decoder may be used by one thread at a time.
#pragma once

#include <ATen/ATen.h>
#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "strata/models/model_config.h"
#include "strata/models/model_shapes.h"
#include "strata/models/token_layout.h"
#include "strata/tiling/chunked_mlp.h"

#include <map>

namespace strata::models {

// Which part of a Hugging Face tensor a stage's parameter holds: all of it, or [begin, end) along
// `dim` (a block tile's slice).
struct TensorPart {
  std::string tensor;           // the Hugging Face name
  std::vector<int64_t> shape;   // the whole tensor's, in Strata's layout
  int64_t dim = 0, begin = 0, end = 0;
  bool whole() const { return begin == 0 && !shape.empty() && end == shape[size_t(dim)]; }
  // The part's own name: the tensor's name when whole, else "name[b:e]" (dim 0) or
  // "name[:,b:e]" (dim 1); unique within a model.
  std::string name() const;
};

// What a sparse block's router did in the block's last forward (ModelConfig::Moe), for the
// load-balancing loss and the routing statistics, per expert: the sum over the tokens of the
// router's probability (fp32; in the forward's autograd graph when it had one, so that the loss's
// gradient reaches the router and the block's input through it) and how many of the tokens' top-k
// choices it was (fp32 counts, no gradient); and the tokens routed.
struct RouterStats {
  at::Tensor probability_sum;  // [experts]
  at::Tensor selections;       // [experts]
  int64_t tokens = 0;
};

class Stage : public torch::nn::Module {
 public:
  // The stage on `input` (token ids for an embedding, else hidden states [B, T, ...]) whose
  // tokens are laid out as `layout` says (packed examples: positions and attention per example).
  virtual at::Tensor forward(const at::Tensor& input, const TokenLayout& layout) = 0;
  // Every row one sequence.
  at::Tensor forward(const at::Tensor& input) { return forward(input, TokenLayout{}); }
  // Parameters with their Hugging Face names (including tied ones only where this stage owns
  // them); a tile's slices under their part names (TensorPart::name).
  std::vector<std::pair<std::string, at::Tensor>> hf_parameters() const;
  // Beside hf_parameters(), in the same order: which part of which tensor each one is.
  const std::vector<TensorPart>& parts() const { return parts_; }
  // Runs the stage's MLP (if it has one) over chunks of this many tokens (tiling/chunked_mlp.h);
  // 0: the whole sequence at once.
  void set_mlp_token_chunk(int64_t tokens) { mlp_chunk_ = tokens; }
  // A sparse block's router statistics of its last forward (valid until the next forward); null
  // for every other stage.
  virtual const RouterStats* router_stats() const { return nullptr; }

 protected:
  at::Tensor add(const std::string& hf_name, std::vector<int64_t> shape);
  // A slice [begin, end) along `dim` of the tensor `hf_name` of shape `whole`.
  at::Tensor add_part(const std::string& hf_name, std::vector<int64_t> whole, int64_t dim, int64_t begin, int64_t end);
  // A sparse block's experts [experts.begin, experts.end) of block `block`, each its gate, up and
  // down (expert_tensors' names, stage_tensors' order).
  std::vector<tiling::MlpWeights> add_experts(const ModelConfig& c, int64_t block, Range experts);
  // The LM head's weight: its own "lm_head.weight", or the tied embedding registered as a
  // parameter of this module too (visible to parameters()/to(), not to hf_parameters()).
  at::Tensor lm_head_weight(const ModelConfig& c, const at::Tensor& tied_embedding);
  // LoRA (ModelConfig::lora): block `block`'s adapters of `part` (models::block_adapters) as
  // parameters after the stage's others; a module's adapter (relative name, "self_attn.q_proj"),
  // undefined where it has none; and x W^T + b with the module's adapter added as PEFT adds it.
  void add_adapters(const ModelConfig& c, int64_t block, BlockPart part = BlockPart::kWhole);
  tiling::LowRank adapter(const std::string& module) const;
  at::Tensor adapted(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const std::string& module) const;
  static at::Tensor adapted(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const tiling::LowRank& l);
  // Block tiles: a later tile uses the adapters its part's first tile holds, registered as
  // parameters of this module too (as a tied head's embedding: not in hf_parameters()); and the
  // share of a module's adapter in a tile holding [begin, end) of the weight along `dim`: rows of
  // B for an output split (dim 0), columns of A for an input split (dim 1). Undefined where none.
  void share_adapters(const Stage& first);
  tiling::LowRank adapter_part(const std::string& module, int64_t dim, int64_t begin, int64_t end) const;
  // `experts` (experts [first, first + size) of block `block`) with their adapters of the fused
  // expert tensors (ModelConfig::Lora::target_parameters) this stage holds or shares, each
  // expert's rows and columns (models::expert_adapter). Taken at each forward: views of the
  // adapters as they are then.
  std::vector<tiling::MlpWeights> adapted_experts(const ModelConfig& c, const std::vector<tiling::MlpWeights>& experts,
                                                  int64_t first) const;
  std::map<std::string, tiling::LowRank> adapters_;
  std::vector<std::pair<std::string, at::Tensor>> params_;
  std::vector<TensorPart> parts_;
  int64_t mlp_chunk_ = 0;
};

// The head: the final norm, then the LM head. The engine's tiled loss uses the two parts apart
// (the logits are never formed whole); forward() is lm_head(normed(x)). A head tile (the
// vocabulary cut, LayerTiles::vocab) holds rows [vocab_begin(), vocab_begin() + rows) of the LM
// head; only the first holds the norm, and a later tile's forward() takes the normed input.
class HeadStage : public Stage {
 public:
  // The final norm's output [..., hidden], in the parameters' dtype. Throws std::logic_error on
  // a head tile after the first.
  virtual at::Tensor normed(const at::Tensor& x) = 0;
  // The LM head's weight [vocab, hidden] (the tied embedding when tied), or the tile's rows.
  virtual const at::Tensor& lm_weight() const = 0;
  virtual int64_t vocab_begin() const { return 0; }
  virtual bool has_norm() const { return true; }
  // The logits' soft cap (Gemma 2's final_logit_softcapping): logits are cap * tanh(l / cap), an
  // elementwise map, so vocabulary and logits tiles apply it exactly (tiling::soft_cap). 0: none.
  double logit_softcap() const { return softcap_; }
  using Stage::forward;
  at::Tensor forward(const at::Tensor& x, const TokenLayout& layout) override;

 protected:
  double softcap_ = 0;
};

class Decoder {
 public:
  // Random initialization from `seed`, in fp32 on the CPU: weights normal(0, 0.02), norm weights
  // 1, biases 0 (GPT-2's scaled residual-projection init is not applied); LoRA adapters as PEFT
  // initializes them, from a stream of their own. kDeferred allocates
  // the weights without touching them (untouched pages take no resident memory) and leaves each
  // stage to initialize_through(), so that a consumer that moves the weights away stage by
  // stage (the engine) never holds the whole model; the values are the same either way.
  enum class Init { kNow, kDeferred };
  explicit Decoder(const ModelConfig& config, uint64_t seed = 0, Init init = Init::kNow);

  // Initializes every stage up to and including `stage` that is not yet initialized, in
  // schedule order (the random stream is one sequence over the stages). A no-op for stages done.
  void initialize_through(size_t stage);

  // Where initial values come from instead of the random initialization, tensor by tensor: called
  // with each whole tensor's Hugging Face name and an fp32 CPU tensor of its shape (Strata's
  // layout) to fill, it returns false for a tensor it does not hold, which then gets the random
  // initialization (the random stream draws only those). Applies to the stages initialized after
  // it is set: with Init::kDeferred, a consumer that initializes stage by stage (the engine) loads
  // the model one block at a time. Its exceptions propagate from initialize_through.
  using TensorSource = std::function<bool(const std::string& name, at::Tensor& whole)>;
  void set_source(TensorSource source) { source_ = std::move(source); }

  // A base saved in 4 bits (quant4_checkpoint.h): the weights it holds as 4-bit records, whole
  // tensors by name. Initialization leaves such a tensor's fp32 storage untouched (it is never
  // read: the consumer, the engine, stores the record); `read` fills the record (quant4_record's
  // layout, bytes() bytes) from the files. Cleared by set_record_source({}) once read.
  struct RecordSource {
    std::function<bool(const std::string& name)> holds;
    std::function<void(const std::string& name, std::span<std::byte> record)> read;
  };
  void set_record_source(RecordSource records) { records_ = std::move(records); }
  bool reads_record(const std::string& name) const { return records_.holds && records_.holds(name); }
  void read_record(const std::string& name, std::span<std::byte> record) const { records_.read(name, record); }

  const ModelConfig& config() const { return config_; }
  // The embedding whole (throws std::logic_error when the vocabulary is tiled).
  Stage& embedding();
  // Block i whole (throws std::logic_error when blocks are tiled).
  Stage& block(size_t i);
  size_t num_blocks() const { return blocks_.size(); }
  // The head whole (throws std::logic_error when the vocabulary is tiled: head_tile()).
  HeadStage& head();
  // Head tile j of tiles().vocab (the whole head when the vocabulary is not tiled).
  HeadStage& head_tile(size_t j) { return *heads_.at(j); }
  // All stages in schedule order: the embedding (or its vocabulary tiles), blocks (each whole,
  // or its attention tiles then its MLP tiles)..., the head (or its vocabulary tiles).
  // An embedding tile's forward(ids) is the lookup of the ids in its rows (zero elsewhere; the
  // first tile adds the positions): the embedding is their sum.
  std::vector<Stage*> stages();
  // "embedding", "embedding.1", "block.3", "block.3.attn.1", "block.3.mlp.0", "head", "head.1".
  std::string stage_name(size_t stage) const;

  // Cuts every block into tile stages and the vocabulary into row ranges (LayerTiles; 1 x 1 x 1
  // joins them whole again). Weights already initialized or loaded are copied into the tiles'
  // slices (one block's, or the embedding's and head's, extra memory at a time); stages not yet
  // initialized stay so and get the values the untiled model would have (the random stream is
  // drawn per whole tensor, then sliced). Invalidates earlier stages().
  // Throws std::invalid_argument for a tiling that does not cut the model (check_tiles).
  void set_tiles(const LayerTiles& tiles);
  const LayerTiles& tiles() const { return tiles_; }
  // Every block's (or MLP tile's) MLP over chunks of `tokens` tokens, so that its intermediate
  // activations exist one chunk at a time (tiling::chunked_mlp; the backward recomputes them);
  // 0 (the default): the whole sequence at once. Throws std::invalid_argument below 0.
  void set_mlp_token_chunk(int64_t tokens);

  // Bytes one block's forward with autograd keeps for its backward (its input included), per
  // token, with compute copies of `elem_bytes` bytes: an upper estimate counted from the block's
  // operations (attention as the flash kernels save it, no T x T scores), within ~15% of what a
  // counting allocator measures (tests/models/block_graph_test.cc). A whole block's share of
  // models::stage_graph_bytes_per_token, which the engine budgets graphs with (per stage, by tile
  // and MLP chunk).
  uint64_t block_graph_bytes_per_token(size_t elem_bytes) const;

  // token ids [batch, seq] (int64) -> logits [batch, seq, vocab], every row one sequence or as
  // `layout` packs examples in it.
  at::Tensor forward(const at::Tensor& ids, const TokenLayout& layout = {});
  // Every parameter once, with its Hugging Face name, in schedule order. A tiled decoder holds
  // no whole tensor of what is tiled: this throws std::logic_error then (read stages()' parts()).
  std::vector<std::pair<std::string, at::Tensor>> hf_parameters();
  void to(at::ScalarType dtype);

 private:
  // The stage groups the random initialization walks in order: 0 the embedding (whole or all its
  // tiles), 1 + i block i (whole or all its tiles), layers + 1 the head (whole or all its tiles).
  size_t group_of(size_t stage) const;
  std::vector<Stage*> group(size_t g) const;
  void initialize_group(size_t group);
  std::vector<std::shared_ptr<Stage>> make_tiles(int64_t block) const;
  // Replaces a group's stages by `next`, copying the values it holds part by part when `holds`.
  static void recut(std::vector<Stage*> old, const std::vector<Stage*>& next, bool holds);

  ModelConfig config_;
  LayerTiles tiles_;
  int64_t mlp_chunk_ = 0;
  std::vector<std::shared_ptr<Stage>> embeds_;               // the embedding, or its vocabulary tiles
  std::vector<std::vector<std::shared_ptr<Stage>>> blocks_;  // per block: its stages (one when whole)
  std::vector<std::shared_ptr<HeadStage>> heads_;            // the head, or its vocabulary tiles
  // The random streams: the base's, and the adapters' apart, so that a random base is the same
  // with adapters loaded (adapter_from) or drawn, and drawn adapters the same over a loaded base.
  at::Generator init_gen_, adapter_gen_;
  TensorSource source_;
  RecordSource records_;
  size_t initialized_ = 0;  // stage groups [0, initialized_) hold their initial values
};

}  // namespace strata::models
