// What a model configuration implies for memory and compute, without building the model: the
// parameters each stage owns, the bytes a block's autograd graph keeps, and the floating-point
// work of a training step. The engine sizes its units with the real modules; the planner
// (planner/) sizes them here, and tests/models/model_shapes_test.cc checks that both agree.
//
// No libtorch. Pure functions; thread-safe.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "strata/models/model_config.h"
#include "strata/models/trainable.h"

namespace strata::models {

// How the model's layers are cut into tile stages (tiling/ and docs/ARCHITECTURE.md "Tiling").
// A pre-norm block is a residual plus sums of independent contributions, so its attention is cut
// into groups of key/value heads (each with its query heads: q/k/v rows and o_proj columns) and
// its MLP into slices of the intermediate dimension (gate/up rows, down columns), a sparse
// block's (ModelConfig::Moe) into groups of consecutive experts (its first also the router); 1 x 1 is the
// block whole, one stage; otherwise `attention` + `mlp` stages (every block alike). The
// vocabulary is cut into `vocab` row ranges: the embedding into as many stages (each adds the
// lookup of the tokens in its rows), the LM head into as many (each its rows' logits); a tied
// head tile uses its embedding tile's rows.
struct LayerTiles {
  int64_t attention = 1;  // groups of key/value heads, 1..kv_heads
  int64_t mlp = 1;        // slices of the intermediate dimension, 1..intermediate
  int64_t vocab = 1;      // row ranges of the embedding and the LM head, 1..vocab_size
  bool blocks_whole() const { return attention == 1 && mlp == 1; }
  int64_t block_stages() const { return blocks_whole() ? 1 : attention + mlp; }
  // Whole blocks in `stages` block stages (placement.recompute and the reports count blocks; the
  // engine's schedule and memory model count stages).
  size_t whole_blocks(size_t stages) const { return stages / size_t(std::max<int64_t>(1, block_stages())); }
  bool operator==(const LayerTiles&) const = default;
};
// The most tiles `c` cuts into: attention tiles up to its key/value heads, MLP tiles up to its
// intermediate features (a mixture of experts: its experts, and its dense blocks' features),
// vocabulary tiles up to its rows; but blocks whose norms take a whole
// output (Gemma 2's sandwich norms) are not cut, nor an attention whose heads share q/k norms
// (Qwen3's): a tile adds its share to a running sum, and those would need the sum first.
LayerTiles most_tiles(const ModelConfig& c);
// Throws std::invalid_argument when `t` does not cut `c` (a count below 1, or above most_tiles,
// saying why).
void check_tiles(const ModelConfig& c, const LayerTiles& t);
// Part i of [0, n) cut into `parts` near-equal parts (the first n % parts one longer): the one
// rule for where tiles begin and end.
struct Range {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
};
Range tile_range(int64_t n, int64_t parts, int64_t i);

// Stages in schedule order: t.vocab embedding stages, the blocks' stages, t.vocab head stages.
struct StageLayout {
  size_t embedding = 1, blocks = 0, head = 1;
  size_t first_block() const { return embedding; }
  size_t first_head() const { return embedding + blocks; }
  size_t stages() const { return embedding + blocks + head; }
};
StageLayout stage_layout(const ModelConfig& c, const LayerTiles& t);

// Elements of the parameters each stage owns, in schedule order: the embedding (GPT-2: token
// and position embeddings; tiled: each tile its rows, the first also the positions), each block
// (or each of its tiles), the head (its final norm, and the LM head when the embeddings are not
// tied; tiled: the first tile the norm, each its LM head rows, so that a tied head tile after the
// first owns nothing). The sum is ModelConfig::parameters().
std::vector<uint64_t> stage_parameters(const ModelConfig& c, const LayerTiles& t = {});
// A block's linear layers in the decoder's order: the module name within the block
// ("self_attn.q_proj", GPT-2's "attn.c_attn"), its input and output features, and whether it is
// the attention's (else the MLP's). LoRA adapts those ModelConfig::lora targets.
struct BlockLinear {
  std::string module;
  int64_t in = 0, out = 0;
  bool attention = false;
};
std::vector<BlockLinear> block_linears(const ModelConfig& c);
// The block prefix of block i ("model.layers.3.", "transformer.h.3.").
std::string block_prefix(const ModelConfig& c, int64_t i);
// A sparse block's router and experts (ModelConfig::Moe) by their Hugging Face names, one tensor
// per expert and projection as published checkpoints hold them: Mixtral's
// "model.layers.3.block_sparse_moe.gate.weight" [experts, hidden] and
// "...block_sparse_moe.experts.5.w1.weight" (gate), w3 (up), w2 (down); Qwen3-MoE's
// "model.layers.3.mlp.gate.weight" and "...mlp.experts.5.gate_proj.weight", up_proj, down_proj.
// The gate and up projections are [intermediate, hidden], the down projection [hidden,
// intermediate]. The decoder registers, and stage_tensors counts, a sparse block's MLP as the
// router, then each expert's gate, up and down in expert order.
std::string router_name(const ModelConfig& c, int64_t block);
// The share of a tensor's elements one token's forward uses: top_k / experts for an expert's
// tensor (a name expert_tensors gives), 1 for every other (the router's included).
double active_share(const ModelConfig& c, const std::string& tensor);
struct ExpertTensors {
  std::string gate, up, down;
};
ExpertTensors expert_tensors(const ModelConfig& c, int64_t block, int64_t expert);
// The adapter tensors of block i, after its other tensors in the stage: for each targeted linear
// in order, "<module>.lora_A.weight" [r, in] and "<module>.lora_B.weight" [out, r] (full names).
// With block tiles, the attention's adapters are whole tensors of its first attention tile and the
// MLP's of its first MLP tile, after the tile's other tensors; every other tile of that part uses
// them (the first tile's trainable unit, as a tied head uses the embedding's), each its rows of B
// where it splits the output (q, k, v, gate, up; GPT-2's c_attn, c_fc) and its columns of A where
// it splits the input (o, down; GPT-2's c_proj).
//
// A sparse block's experts (ModelConfig::Lora::target_parameters) are adapted as PEFT adapts a
// fused expert tensor [experts, out, in]: module "model.layers.3.mlp.experts.gate_up_proj"
// (gate and up stacked, out = 2 x expert intermediate) or "...mlp.experts.down_proj", A
// [experts x r, in] (expert e's rows e r .. e r + r - 1) and B [out, r x experts] (expert e's
// column j at j x experts + e), PEFT's layout, so that expert e's update is B_e A_e. The adapters
// belong to the block's MLP part: a whole sparse block's, or its first expert tile's, every other
// expert tile using its experts' rows and columns (expert_adapter).
struct AdapterShape {
  std::string module;   // full name, "model.layers.3.self_attn.q_proj"
  int64_t in = 0, out = 0;
  bool attention = false;  // the attention's (else the MLP's)
  int64_t experts = 1;     // a fused expert tensor's experts (each its own rank-r adapter)
  int64_t elements(int64_t r) const { return r * experts * (in + out); }
};
inline constexpr const char* kExpertGateUp = "gate_up_proj";
inline constexpr const char* kExpertDown = "down_proj";
// The fused expert tensor `tensor` (kExpertGateUp or kExpertDown) of sparse block i as PEFT's
// target_parameters name it: "model.layers.3.mlp.experts.gate_up_proj" (Mixtral's too).
std::string expert_parameter(const ModelConfig& c, int64_t i, const char* tensor);
// Which of a block's adapters: all (a whole block's), the attention's or the MLP's (the first
// tile of each holds them).
enum class BlockPart { kWhole, kAttention, kMlp };
std::vector<AdapterShape> block_adapters(const ModelConfig& c, int64_t i, BlockPart part = BlockPart::kWhole);
// Elements of every adapter of the model (0 without LoRA): r (in + out) for each adapted linear,
// r (in + out) for each expert of an adapted expert tensor.
int64_t adapter_parameters(const ModelConfig& c);
// Whether a tensor name is a LoRA adapter's ("...lora_A.weight", "...lora_B.weight").
bool is_adapter_tensor(const std::string& name);
// The one naming rule of adapters: module `module`'s A ("<module>.lora_A.weight") and B, the
// module an adapter tensor adapts (the inverse), and model.trainable's patterns for a LoRA run
// (the adapters alone).
std::string adapter_a_name(const std::string& module);
std::string adapter_b_name(const std::string& module);
std::string adapted_module(const std::string& adapter_name);
std::vector<std::string> adapter_patterns();
// model.lora's modules_to_save, by PEFT's rule: a module whose name ends with an entry (a plain
// suffix: "norm" also selects "input_layernorm") trains whole beside the adapters, with every
// tensor under it. Whether `tensor` (a whole Hugging Face name) is one of those; the tensors of
// `c` they select (throws std::invalid_argument naming an entry that selects nothing, one that
// selects an adapted linear or a module holding one, or the tied embedding); and whether a tensor
// belongs in the PEFT adapter directory (an adapter or a module to save).
bool saved_whole(const ModelConfig& c, const std::string& tensor);
// What LoRA adds to weight `weight` (a whole Hugging Face name, Strata's [out, in] layout): the
// adapted module (adapter_a_name, adapter_b_name), and for an expert's weight its expert and its
// rows of the fused output (gate: the first expert-intermediate rows of gate_up_proj, up the
// next); nothing for a weight without an adapter. And how many weights one module's adapters
// update (1; an expert tensor's: 2 x experts for gate_up_proj, experts for down_proj).
struct AdaptedWeight {
  std::string module;
  int64_t expert = -1;  // -1: a linear layer's weight (B A whole)
  int64_t row_begin = 0, rows = 0;
};
std::optional<AdaptedWeight> adapted_weight(const ModelConfig& c, const std::string& weight);
int64_t adapted_weight_count(const ModelConfig& c, const std::string& module);
std::vector<std::string> saved_whole_tensors(const ModelConfig& c);
bool in_adapter_export(const ModelConfig& c, const std::string& tensor);

// The tensors each stage owns, in schedule order and in each stage's own order (the decoder's
// hf_parameters()): each by its whole Hugging Face name and the elements of the stage's part of
// it. Their sums are stage_parameters(); tests/models/model_shapes_test.cc checks the names and
// sizes against the decoder. (Strings for every tensor: stage_parameters() is the fast count.)
struct StageTensor {
  std::string tensor;  // whole name
  uint64_t numel = 0;  // the part's elements
};
std::vector<std::vector<StageTensor>> stage_tensors(const ModelConfig& c, const LayerTiles& t = {});
// Every tensor's whole name once, in schedule order (what model.trainable's patterns match).
std::vector<std::string> tensor_names(const ModelConfig& c);

// The units the engine makes of the stages (construct.cc builds them from the modules; the
// resolution plans with these; construction checks they agree). Each stage owning parameters
// makes a unit of its trainable tensors, then one of its frozen tensors (model.trainable), each
// only where it has any; every stage uses its own units (trainable first), then for a tied head
// (tile) the unit holding its embedding (tile)'s token rows, and for a block tile after the first
// of its attention (MLP) whose part has adapters, the first tile's trainable unit that holds them.
// A frozen unit's 4-bit tensors (model.quantize) are records in a flat buffer of `elem_bytes`-byte
// elements (quantized_base.h), their dequantized elements counted apart.
struct UnitShapes {
  std::vector<uint64_t> numel;                    // by unit: its flat buffer's elements
  std::vector<uint64_t> dequantized;              // by unit: elements of its 4-bit tensors, dequantized
  std::vector<char> frozen;                       // by unit
  std::vector<size_t> stage;                      // by unit: the stage owning it
  std::vector<std::vector<size_t>> stage_units;   // by stage
};
UnitShapes unit_shapes(const ModelConfig& c, const LayerTiles& t, const TrainableTensors& trainable,
                       uint64_t elem_bytes = 4);
// A unit's name: its stage's (stage_name), with ".frozen" for a frozen unit.
std::string unit_name(const std::string& stage_name, bool frozen);

// By stage: its input activation in multiples of [tokens, hidden] (1, or 2 for a tile after the
// first of a block's attention or MLP: its input stacks the normed input and the running sum; 3
// for an expert tile after the first, whose input also stacks the router's logits, padded to hidden).
// The embedding's input (token ids) counts as 1, as every output that is not another stage's
// input (the head's).
std::vector<uint64_t> stage_input_widths(const ModelConfig& c, const LayerTiles& t = {});
// The units each stage uses with every tensor trainable (unit_shapes' stage_units): a unit for
// each stage that owns parameters (numbered in stage order), then a tied head's (tile's)
// embedding (tile) unit and a later block tile's first tile's adapter unit.
std::vector<std::vector<size_t>> stage_units(const ModelConfig& c, const LayerTiles& t = {});
// Stage s's name, which is also its unit's: "embedding", "embedding.2", "block.3",
// "block.3.attn.1", "block.3.mlp.0", "head", "head.2". Throws std::out_of_range past the head.
std::string stage_name(const ModelConfig& c, const LayerTiles& t, size_t stage);

// By stage, in schedule order: the bytes per token a stage's forward with autograd keeps for its
// backward (its input included) with compute copies of `elem_bytes` bytes; 0 off the blocks. A
// whole block, or each of its tiles (an attention tile its heads' part, an MLP tile its features'
// part, the first of each its norm). With `mlp_chunked` (tiling::chunked_mlp) an MLP keeps only
// its input. An upper estimate counted from the stages' operations (attention as the flash kernels
// save it, no T x T scores), at most 1.25x what a counting allocator measures
// (tests/models/block_graph_test.cc). The engine budgets a kept stage's graph from its forward to
// its backward, and a recomputed one's during its backward, with it.
std::vector<uint64_t> stage_graph_bytes_per_token(const ModelConfig& c, const LayerTiles& t, size_t elem_bytes,
                                                  bool mlp_chunked = false);
// A whole block's, its MLP not chunked (Decoder::block_graph_bytes_per_token).
uint64_t block_graph_bytes_per_token(const ModelConfig& c, size_t elem_bytes);

// Multiply-add work (2 FLOPs each) of one token's forward through the model with a sequence of
// `seq_len` tokens: every linear layer (a sparse block's router and its top_k experts), the
// attention's two products (causal attention computed in full, as the kernels do), and the LM
// head. The embedding lookup counts nothing.
struct ForwardFlops {
  double blocks = 0;  // per token, all blocks together
  double head = 0;    // per token, the LM head
  double total() const { return blocks + head; }
};
ForwardFlops forward_flops_per_token(const ModelConfig& c, int64_t seq_len);

// Model FLOPs a token of a training step (what model TFLOPS counts; no recompute): 6 per trainable
// parameter the token uses (ModelConfig::active_parameters: a sparse block's top_k experts) for
// forward, input and weight gradients, 4 per frozen one (no weight gradient), plus the
// attention's 12 x layers x hidden x seq_len. `frozen`: the frozen parameters (a LoRA run's base:
// c.parameters(); its adapters, adapter_parameters(c), train). Full fine-tuning: 6 N + attention.
double model_flops_per_token(const ModelConfig& c, int64_t seq_len, int64_t frozen = 0);

}  // namespace strata::models
