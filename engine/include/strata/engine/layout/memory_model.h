// The one memory model of the device working set. Every decision that depends on how much device
// memory a step needs calls it: automatic placement (the room left for state), recompute "auto"
// (how many blocks keep their graphs), activation checkpoints "auto" (whether they fit on the
// device), prefetch "auto" (how deep the gather window may go), the construction-time budget
// check of every use, and the parameter coordinator's room test before each gather. `strata
// train --plan` prints what it decides. The formula lives here and nowhere else.
//
// What the engine holds on the device besides its device-placed state ("base"), while it runs
// use u of the schedule:
//   use_bytes(u)        the gathered units of u's stage (full compute-dtype buffers; a shard off
//                       the device is uploaded straight into its slice, so nothing is staged)
//   scratch             the largest use's boundary activations (input, output and their
//                       gradients; a block tile's input and output may stack two activations),
//                       plus the fp32 gradient buffers of the units a backward use touches (plus
//                       a bf16 copy when reducing in bf16, plus the reduced shard with other
//                       ranks: alone, the buffer is the shard); the head's
//                       use holds its loss (head_scratch_bytes: the fp32 logits and their
//                       gradients, or one tile of them when tiled) or its gradient buffers, the
//                       larger (the loss is freed before the reduce); with vocabulary tiles every
//                       head stage's use holds both (the loss's running state lives from the
//                       first head stage's forward to its backward); plus one activation
//                       checkpoint coming back when checkpoints live off the device
//   device checkpoints  every recomputed block's input, when checkpoints live on the device
//   held_at(u)          blocks kept without recompute whose forward ran before u and whose
//                       backward comes after: each one's autograd graph and its gathered units
//   running_graph(u)    u's own block stage's autograd graph where u holds it: a kept stage's
//                       forward builds it, any block stage's backward holds it (a recomputed
//                       one builds it there)
// need(u) = use_bytes(u) + max(scratch, running scratch of u) + device checkpoints + held_at(u),
// where u's running scratch is its boundary activations plus the larger of its graph (freed before
// the reduce) and its own gradient buffers (scratch, the largest over uses, bounds what another use
// may leave behind; the graph lives only within its use); the working set is the largest over
// uses of need(u) plus the units of the next `prefetch` uses gathered ahead that u does not use.
//
// No libtorch, no device, no communicator: pure arithmetic on sizes, the same on every rank.
// Thread safety: immutable after construction.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "strata/engine/config.h"
#include "strata/engine/layout/schedule.h"
#include "strata/engine/layout/tiles.h"

namespace strata::engine::layout {

// The sizes the working set depends on.
struct ModelSizes {
  std::vector<uint64_t> padded_numel;  // by unit: the gathered buffer's elements
  std::vector<uint64_t> shard_numel;   // by unit: one rank's slice
  std::vector<char> frozen;            // by unit: no gradient buffers (model.trainable); empty: none
  // By unit: elements of its 4-bit tensors (model.quantize), dequantized beside the gathered
  // records while it is gathered (counted with them: an upper bound). Empty: none.
  std::vector<uint64_t> dequantized;
  uint64_t compute_bytes = 4;          // bytes of an element of the compute copies
  bool reduce_bf16 = false;            // gradients reduce-scattered in bf16
  uint64_t tokens = 0;                 // micro_batch * seq_len
  uint64_t hidden = 0, vocab = 0;
  // By stage: the autograd graph its forward with autograd keeps at `tokens` (0 off the blocks;
  // models::stage_graph_bytes_per_token). Empty: none.
  std::vector<uint64_t> graph_bytes;
  uint64_t graph(size_t stage) const { return graph_bytes.empty() ? 0 : graph_bytes.at(stage); }
  // By stage: its input in multiples of [tokens, hidden] (models::stage_input_widths: 2 for a
  // block tile whose input stacks the normed input and the running sum). Empty: 1 everywhere.
  std::vector<uint64_t> input_widths;
  // The MLPs run over token chunks (tiling::chunked_mlp): in a lower-precision compute dtype each
  // block stage's backward also holds fp32 sums of its MLP weights' gradients (counted as its
  // units' padded size, an upper bound).
  bool mlp_chunked = false;
  LogitsTiles logits;                 // the head's loss: its tiles of the logits (default: untiled)
  // The embedding and the LM head cut into this many row ranges (models::LayerTiles::vocab):
  // the loss then runs tile by tile within each range (within_vocab_tiles), and every use of a
  // head stage holds it (the running log-sum-exp and the input's gradient live from the first
  // head stage's forward to its backward).
  uint64_t vocab_tiles = 1;
};

// The head's loss bytes for `sizes` (its logits within its vocabulary tiles): the only term of the
// working set the logits' cut enters, and the working set never shrinks as it grows.
uint64_t head_loss_bytes(const ModelSizes& sizes);

// The decisions the working set depends on.
struct Choices {
  Placement activations = Placement::kHost;   // kAuto: not decided (no checkpoints counted)
  size_t recomputed = 0;                      // the first `recomputed` block stages recompute; later ones keep graphs
  int prefetch = 1;                           // units gathered ahead
};

class MemoryModel {
 public:
  // `schedule` must outlive the model.
  MemoryModel(const Schedule& schedule, ModelSizes sizes);

  const Schedule& schedule() const { return schedule_; }
  const ModelSizes& sizes() const { return sizes_; }

  // Stage s runs with autograd and keeps its graph until its backward / is recomputed from its
  // input (an activation checkpoint). Blocks count from the schedule's first block stage; a block
  // stage without a backward (a frozen prefix) does neither: it runs without autograd, keeps
  // nothing (the memory model still counts its checkpoint: an overestimate).
  bool keeps_graph(size_t stage, const Choices& c) const {
    return schedule_.is_block(stage) && schedule_.has_backward(stage) && stage >= schedule_.first_block() + c.recomputed;
  }
  bool checkpointed(size_t stage, const Choices& c) const {
    return schedule_.is_block(stage) && schedule_.has_backward(stage) && stage < schedule_.first_block() + c.recomputed;
  }

  uint64_t unit_bytes(size_t unit) const;
  uint64_t use_bytes(const Use& use) const;
  uint64_t largest_unit() const;
  uint64_t activation_bytes() const;  // one [tokens, hidden] activation of a micro-batch
  // Stage s's input (a boundary activation, an activation checkpoint), and the largest one.
  uint64_t input_bytes(size_t stage) const;
  uint64_t largest_input_bytes() const { return largest_input_; }
  // The recomputed blocks' inputs.
  uint64_t checkpoint_bytes(const Choices& c) const;
  uint64_t device_checkpoints(const Choices& c) const {
    return c.activations == Placement::kDevice ? checkpoint_bytes(c) : 0;
  }
  // O(1): the engine's room test calls it before every gather.
  uint64_t scratch(const Choices& c) const { return largest_use_scratch_ + checkpoint_back(c); }
  // The use whose boundary activations, gradient buffers and head loss make scratch()'s largest
  // part (the first such in schedule order): what an error names as the scratch's source, which
  // may be another use than the one that does not fit.
  const Use& largest_scratch_use() const { return largest_scratch_use_; }
  // The head's loss: its part of the head use's scratch (layout/tiles.h), for the tiles it runs
  // over (head_logits()).
  uint64_t head_loss_bytes() const;
  // The head use's gradient buffers (its units' fp32, bf16 and shard bytes at its reduce): without
  // vocabulary tiles the head's scratch holds the larger of these and the loss, so cutting the
  // logits shrinks it only while the loss is the larger.
  uint64_t head_gradient_bytes() const { return head_gradients_; }
  // The logits' tiles the loss runs over: sizes().logits within the vocabulary tiles.
  LogitsTiles head_logits() const {
    return within_vocab_tiles(sizes_.logits, sizes_.tokens, sizes_.vocab, sizes_.vocab_tiles);
  }
  // One block's autograd graph, its `stages_per_block` stages' together (the first block's; every
  // block is alike).
  uint64_t block_graph_bytes(size_t stages_per_block) const;
  uint64_t held_at(const Use& use, const Choices& c) const;
  uint64_t peak_held(const Choices& c) const;
  uint64_t running_graph(const Use& use, const Choices& c) const {
    return schedule_.is_block(use.stage) && (use.kind == Use::kBackward || keeps_graph(use.stage, c))
               ? sizes_.graph(use.stage)
               : 0;
  }
  // What `use` holds beside its parameters while it runs: its boundary activations with its graph
  // (during the compute) or with its gradient buffers (at the reduce, the graph freed), the
  // larger, and its checkpoint coming back.
  uint64_t running_scratch(const Use& use, const Choices& c) const {
    return std::max(use_scratch_.at(use.stage)[use.kind], boundary_.at(use.stage) + running_graph(use, c)) +
           checkpoint_back(c);
  }
  // The room test of the parameter coordinator (O(1)), for whichever use runs while units are
  // gathered ahead: scratch, or the largest running scratch with a graph, the larger.
  uint64_t room_scratch(const Choices& c) const {
    return std::max(scratch(c), largest_graph_scratch_ + checkpoint_back(c));
  }
  // What running `use` needs beside the device-placed state, no unit gathered ahead.
  uint64_t need(const Use& use, const Choices& c) const {
    return use_bytes(use) + std::max(scratch(c), running_scratch(use, c)) + device_checkpoints(c) + held_at(use, c);
  }
  // The largest need; and the largest need with the units gathered ahead of its use: those of
  // the next `prefetch` uses that it does not use itself (the schedule taken as a cycle: the
  // next micro-batch's first uses follow the last), as the parameter coordinator gathers them.
  uint64_t largest_need(const Choices& c) const;
  uint64_t working_set(const Choices& c) const;
  // How many of the largest unit fit ahead within `usable` bytes (usable_device) beside `base`
  // bytes of device-placed state and the largest need; 0 if not even the need fits.
  uint64_t prefetch_room(const Choices& c, uint64_t base, uint64_t usable) const;

  // The device bytes decisions may count on: the budget, or less when the device has less free
  // (`physical_free`, measured with `base` bytes of state already allocated; UINT64_MAX: no
  // limit beyond the budget).
  static uint64_t usable_device(uint64_t budget, uint64_t base, uint64_t physical_free);

 private:
  const Schedule& schedule_;
  ModelSizes sizes_;
  uint64_t largest_use_scratch_ = 0;  // scratch's part that no choice changes
  Use largest_scratch_use_{0, Use::kForward};
  uint64_t largest_input_ = 0;
  uint64_t head_gradients_ = 0;
  std::vector<std::array<uint64_t, 3>> use_scratch_;  // [stage][Use::Kind]: each use's own scratch
  std::vector<uint64_t> boundary_;                    // [stage]: its boundary activations
  uint64_t largest_graph_scratch_ = 0;                // the largest boundary plus graph of a block stage
  // One checkpoint on its way back when checkpoints live off the device.
  uint64_t checkpoint_back(const Choices& c) const { return c.activations != Placement::kDevice ? largest_input_ : 0; }
  std::vector<uint64_t> inputs_before_;  // [s]: the inputs of the blocks before stage s (checkpoint_bytes in O(1))
  std::vector<uint64_t> stage_bytes_;    // [s]: its units' compute copies (use_bytes in O(1))
  std::vector<uint64_t> held_before_;    // [s]: the graphs and compute copies of the stages before s (held_at in O(1))
};

}  // namespace strata::engine::layout
