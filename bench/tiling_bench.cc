#include "tiling_bench.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <iostream>
#include <nlohmann/json.hpp>
#include <thread>

#include "strata/engine/comm.h"
#include "strata/engine/device.h"
#include "strata/engine/engine.h"
#include "strata/engine/layout/tiles.h"
#include "bench_model.h"
#include "timing.h"

namespace strata::bench {
namespace {

// `block_tiles`: placement.tiling for the attention and the MLP alike (1: whole blocks);
// `vocab_tiles` for the embedding and the LM head (1: whole); `mlp_token_chunk` for
// placement.tiling "mlp_tokens" (0: whole sequences, as every side but (d)'s tiled one runs).
engine::EngineConfig engine_config(const TilingBenchOptions& o, int64_t batch, int64_t seq, uint64_t head_tiles,
                                   unsigned threads, uint64_t block_tiles = 1, uint64_t vocab_tiles = 1,
                                   int64_t mlp_token_chunk = 0) {
  engine::EngineConfig e;
  e.device = o.device;
  if (o.compute == "bf16") e.compute = engine::Precision::kBf16;
  else if (o.compute != "fp32") throw std::invalid_argument("bench tiling: --compute must be fp32 or bf16, not " + o.compute);
  e.micro_batch = batch;
  e.seq_len = seq;
  e.lr = 1e-4;
  e.cpu_threads = threads;
  e.head_tiles = head_tiles;
  e.attention_tiles = e.mlp_tiles = block_tiles;
  e.vocab_tiles = vocab_tiles;
  e.mlp_token_chunk = mlp_token_chunk;
  return e;
}

// One training step of `c` within `budget` bytes on the device: true if the engine is
// constructed (every use fits) and the step runs; the tiles chosen are returned (`config`).
bool trains_in(const models::ModelConfig& c, const engine::EngineConfig& e, uint64_t budget, uint64_t* tiles,
               engine::Communicator& comm, engine::EngineConfig* config = nullptr) {
  try {
    auto dev = engine::Device::create(e.device, 0, budget);
    engine::Engine eng(std::make_unique<models::Decoder>(c, 1, models::Decoder::Init::kDeferred), e, comm, *dev);
    *tiles = eng.config().head_tiles;
    if (config) *config = eng.config();
    const at::Tensor ids = at::randint(0, c.vocab_size, {e.micro_batch, e.seq_len + 1}, at::kLong);
    const engine::StepResult r = eng.train_step(ids);
    return std::isfinite(r.loss) && dev->peak() <= budget;
  } catch (const engine::BudgetExceeded&) {
    return false;
  }
}

}  // namespace

void run_tiling_bench(const TilingBenchOptions& o) {
  const unsigned threads = o.threads ? o.threads : std::max(1u, std::thread::hardware_concurrency());
  at::set_num_threads(int(threads));
  auto comm = engine::Communicator::create(engine::DistEnv{}, std::chrono::seconds(60));

  // (a) Overhead where both fit.
  if (o.parts.find('a') != std::string::npos) {
    const models::ModelConfig c = gpt2_shape("gpt2-tiling-bench", o.layers, o.hidden, o.heads, o.vocab, o.seq);
    auto dev_whole = engine::Device::create(o.device, 0, UINT64_MAX), dev_cut = engine::Device::create(o.device, 0, UINT64_MAX);
    engine::Engine whole(std::make_unique<models::Decoder>(c, 1), engine_config(o, o.batch, o.seq, 1, threads), *comm,
                         *dev_whole);
    engine::EngineConfig cut_cfg = engine_config(o, o.batch, o.seq, o.tiles, threads);
    cut_cfg.head_one_pass = o.head_one_pass;
    engine::Engine cut(std::make_unique<models::Decoder>(c, 1), cut_cfg, *comm, *dev_cut);
    const uint64_t tokens = uint64_t(o.batch * o.seq), vocab = uint64_t(o.vocab);
    const std::string cut_desc = engine::layout::describe(cut.memory_model().sizes().logits, tokens, vocab);
    std::cerr << "bench tiling (a): " << c.parameters() / 1e6 << "M parameters (" << o.layers << " x " << o.hidden
              << ", vocab " << o.vocab << "), batch " << o.batch << " x " << o.seq << ", " << o.compute << " on "
              << dev_whole->description() << ", " << threads << " threads; head logits whole vs " << cut_desc
              << std::endl;
    const at::Tensor ids = at::randint(0, o.vocab, {o.batch, o.seq + 1}, at::kLong);
    const std::vector<double> sec =
        median_seconds(o.steps, {[&] { whole.train_step(ids); }, [&] { cut.train_step(ids); }});
    nlohmann::json line = {{"metric", "train_step_seconds_head_tiled"},
                           {"value", sec[1]},
                           {"baseline", "the same engine step with the head's logits whole"},
                           {"baseline_value", sec[0]},
                           {"ratio", sec[1] / sec[0]},
                           {"overhead", sec[1] / sec[0] - 1},
                           {"target_ratio_at_most", 1.10},
                           {"tiling", cut_desc},
                           {"head_loss_bytes_whole", whole.memory_model().head_loss_bytes()},
                           {"head_loss_bytes_tiled", cut.memory_model().head_loss_bytes()},
                           {"parameters", c.parameters()},
                           {"device", dev_whole->description()},
                           {"compute", o.compute},
                           {"threads", threads}};
    std::cout << line.dump() << std::endl;

    // The same model with each block cut into tiles (the head whole in both).
    engine::EngineConfig tiled_cfg = engine_config(o, o.batch, o.seq, 1, threads);
    tiled_cfg.attention_tiles = uint64_t(std::min<int64_t>(o.heads, o.attention_tiles));
    tiled_cfg.mlp_tiles = uint64_t(o.mlp_tiles);
    auto dev_blocks = engine::Device::create(o.device, 0, UINT64_MAX);
    engine::Engine blocks(std::make_unique<models::Decoder>(c, 1), tiled_cfg, *comm, *dev_blocks);
    const std::string blocks_desc = std::to_string(tiled_cfg.attention_tiles) + " attention x " +
                                    std::to_string(tiled_cfg.mlp_tiles) + " MLP tiles";
    std::cerr << "bench tiling (a): blocks whole vs in " << blocks_desc << std::endl;
    const std::vector<double> bsec =
        median_seconds(o.steps, {[&] { whole.train_step(ids); }, [&] { blocks.train_step(ids); }});
    nlohmann::json bline = {{"metric", "train_step_seconds_blocks_tiled"},
                            {"value", bsec[1]},
                            {"baseline", "the same engine step with whole blocks"},
                            {"baseline_value", bsec[0]},
                            {"ratio", bsec[1] / bsec[0]},
                            {"overhead", bsec[1] / bsec[0] - 1},
                            {"target_ratio_at_most", 1.10},
                            {"tiling", blocks_desc},
                            {"largest_unit_bytes_whole", whole.memory_model().largest_unit()},
                            {"largest_unit_bytes_tiled", blocks.memory_model().largest_unit()},
                            {"parameters", c.parameters()},
                            {"device", dev_whole->description()},
                            {"compute", o.compute},
                            {"threads", threads}};
    std::cout << bline.dump() << std::endl;

    // The same model with the embedding and the LM head cut into vocabulary tiles, each a unit
    // and a stage (the logits in the same tiles as the first line's, within them; two passes, so
    // not beside a head in one pass).
    if (!o.head_one_pass) {
    engine::EngineConfig vocab_cfg = engine_config(o, o.batch, o.seq, o.tiles, threads, 1, o.vocab_tiles);
    auto dev_vocab = engine::Device::create(o.device, 0, UINT64_MAX);
    engine::Engine vocab_cut(std::make_unique<models::Decoder>(c, 1), vocab_cfg, *comm, *dev_vocab);
    const std::string vocab_desc = std::to_string(o.vocab_tiles) + " vocabulary tiles, head logits " +
                                   engine::layout::describe(vocab_cut.memory_model().head_logits(), tokens, vocab);
    std::cerr << "bench tiling (a): embedding and head whole (logits " << cut_desc << ") vs in " << vocab_desc
              << std::endl;
    const std::vector<double> vsec =
        median_seconds(o.steps, {[&] { cut.train_step(ids); }, [&] { vocab_cut.train_step(ids); }});
    nlohmann::json vline = {{"metric", "train_step_seconds_vocab_tiled"},
                            {"value", vsec[1]},
                            {"baseline", "the same engine step with the embedding and the LM head whole (logits tiled alike)"},
                            {"baseline_value", vsec[0]},
                            {"ratio", vsec[1] / vsec[0]},
                            {"overhead", vsec[1] / vsec[0] - 1},
                            {"target_ratio_at_most", 1.10},
                            {"tiling", vocab_desc},
                            {"largest_unit_bytes_whole", cut.memory_model().largest_unit()},
                            {"largest_unit_bytes_tiled",
                             vocab_cut.memory_model().largest_unit()},
                            {"parameters", c.parameters()},
                            {"device", dev_whole->description()},
                            {"compute", o.compute},
                            {"threads", threads}};
    std::cout << vline.dump() << std::endl;
    }
  }

  // (b) Capacity in one budget: the largest vocabulary (doubling from 256, up to
  // --capacity-max-vocab) that trains; untiled, then with the head's logits and the vocabulary
  // "auto".
  if (o.parts.find('b') != std::string::npos) {
    const int64_t T = o.capacity_tokens;
    const auto largest = [&](uint64_t tiling, uint64_t* tiles_used, uint64_t* vocab_tiles_used) {
      int64_t best = 0;
      for (int64_t vocab = 256; vocab <= o.capacity_max_vocab; vocab *= 2) {
        uint64_t tiles = 0;
        engine::EngineConfig used;
        const models::ModelConfig c = gpt2_shape("gpt2-tiling-bench", 1, o.capacity_hidden, 4, vocab, T);
        if (!trains_in(c, engine_config(o, 1, T, tiling, threads, 1, tiling), o.budget, &tiles, *comm, &used)) break;
        best = vocab;
        *tiles_used = tiles;
        *vocab_tiles_used = used.vocab_tiles;
        std::cerr << "bench tiling (b): vocabulary " << vocab << " trains in " << engine::format_bytes(o.budget)
                  << (tiling == 1 ? " untiled"
                                  : " with " + std::to_string(tiles) + " head tiles, " +
                                        std::to_string(used.vocab_tiles) + " vocabulary tiles")
                  << std::endl;
      }
      return best;
    };
    uint64_t whole_tiles = 1, auto_tiles = 1, whole_vocab_tiles = 1, auto_vocab_tiles = 1;
    const int64_t whole = largest(1, &whole_tiles, &whole_vocab_tiles),
                  tiled = largest(engine::EngineConfig::kTilesAuto, &auto_tiles, &auto_vocab_tiles);
    const double whole_logits = double(T) * double(whole), tiled_logits = double(T) * double(tiled);
    nlohmann::json line = {
        {"metric", "largest_logits_elements_in_budget"},
        {"value", tiled_logits},
        {"baseline", "the same engine with the head and the vocabulary untiled (placement.tiling \"off\")"},
        {"baseline_value", whole_logits},
        {"ratio", whole_logits > 0 ? tiled_logits / whole_logits : 0.0},
        {"target_ratio_at_least", 16},
        {"budget_bytes", o.budget},
        {"tokens", T},
        {"hidden", o.capacity_hidden},
        {"largest_vocab_untiled", whole},
        {"largest_vocab_tiled", tiled},
        {"head_tiles_at_largest", auto_tiles},
        {"vocab_tiles_at_largest", auto_vocab_tiles},
        {"largest_vocab_tried", o.capacity_max_vocab},
        {"blocks_tiled", false},
        {"device", o.device},
        {"compute", o.compute},
        {"threads", threads}};
    std::cout << line.dump() << std::endl;
  }

  // (c) Capacity in one budget: the largest hidden size (doubling from 128; one GPT-2 block,
  // heads of 64, intermediate 4 x hidden) that trains with whole blocks vs blocks cut "auto".
  if (o.parts.find('c') != std::string::npos) {
    const int64_t T = o.hidden_tokens;
    const auto largest = [&](uint64_t block_tiles, engine::EngineConfig* used) {
      int64_t best = 0;
      for (int64_t h = 128; h <= o.hidden_max; h *= 2) {
        uint64_t head = 0;
        engine::EngineConfig got;
        const models::ModelConfig c = gpt2_shape("gpt2-tiling-bench", 1, h, std::max<int64_t>(1, h / 64), 256, T);
        if (!trains_in(c, engine_config(o, 1, T, engine::EngineConfig::kTilesAuto, threads, block_tiles), o.hidden_budget,
                       &head, *comm, &got))
          break;
        best = h;
        *used = got;
        std::cerr << "bench tiling (c): hidden " << h << " (" << c.block_parameters() / 1e6 << "M parameters a block) trains in "
                  << engine::format_bytes(o.hidden_budget)
                  << (block_tiles == 1 ? " with whole blocks"
                                       : " in " + std::to_string(got.attention_tiles) + " attention x " +
                                             std::to_string(got.mlp_tiles) + " MLP tiles")
                  << std::endl;
      }
      return best;
    };
    engine::EngineConfig whole_cfg, cut_cfg;
    const int64_t whole = largest(1, &whole_cfg), tiled = largest(engine::EngineConfig::kTilesAuto, &cut_cfg);
    nlohmann::json line = {
        {"metric", "largest_hidden_in_budget"},
        {"value", tiled},
        {"baseline", "the same engine with whole blocks (placement.tiling attention and mlp \"off\")"},
        {"baseline_value", whole},
        {"ratio", whole > 0 ? double(tiled) / double(whole) : 0.0},
        {"target_ratio_at_least", 8},
        {"budget_bytes", o.hidden_budget},
        {"tokens", T},
        {"largest_hidden_tried", o.hidden_max},
        {"attention_tiles_at_largest", cut_cfg.attention_tiles},
        {"mlp_tiles_at_largest", cut_cfg.mlp_tiles},
        {"device", o.device},
        {"compute", o.compute},
        {"threads", threads}};
    std::cout << line.dump() << std::endl;
  }

  // (d) Long sequences in one budget: the largest sequence (doubling from 256; one GPT-2 block of
  // --sequence-hidden, heads of 64, vocabulary 256, one sequence a step) that trains with whole
  // blocks and whole-sequence MLPs vs everything "auto".
  if (o.parts.find('d') != std::string::npos) {
    const int64_t h = o.sequence_hidden;
    const auto largest = [&](bool cut, engine::EngineConfig* used) {
      int64_t best = 0;
      for (int64_t seq = 256; seq <= o.sequence_max; seq *= 2) {
        uint64_t head = 0;
        engine::EngineConfig got;
        const models::ModelConfig c = gpt2_shape("gpt2-tiling-bench", 1, h, std::max<int64_t>(1, h / 64), 256, seq);
        const engine::EngineConfig e =
            cut ? engine_config(o, 1, seq, engine::EngineConfig::kTilesAuto, threads, engine::EngineConfig::kTilesAuto,
                                engine::EngineConfig::kTilesAuto, engine::EngineConfig::kMlpChunkAuto)
                : engine_config(o, 1, seq, engine::EngineConfig::kTilesAuto, threads);
        if (!trains_in(c, e, o.sequence_budget, &head, *comm, &got)) break;
        best = seq;
        *used = got;
        std::cerr << "bench tiling (d): sequence " << seq << " trains in " << engine::format_bytes(o.sequence_budget)
                  << (cut ? " with " + std::to_string(got.attention_tiles) + " attention x " +
                                std::to_string(got.mlp_tiles) + " MLP tiles, MLP chunks of " +
                                std::to_string(got.mlp_token_chunk) + " tokens"
                          : " with whole blocks and whole-sequence MLPs")
                  << std::endl;
      }
      return best;
    };
    engine::EngineConfig whole_cfg, cut_cfg;
    const int64_t whole = largest(false, &whole_cfg), tiled = largest(true, &cut_cfg);
    nlohmann::json line = {
        {"metric", "longest_sequence_in_budget"},
        {"value", tiled},
        {"baseline", "the same engine with whole blocks and whole-sequence MLPs (tiling attention, mlp and "
                     "mlp_tokens \"off\")"},
        {"baseline_value", whole},
        {"ratio", whole > 0 ? double(tiled) / double(whole) : 0.0},
        {"budget_bytes", o.sequence_budget},
        {"hidden", h},
        {"longest_sequence_tried", o.sequence_max},
        {"attention_tiles_at_longest", cut_cfg.attention_tiles},
        {"mlp_tiles_at_longest", cut_cfg.mlp_tiles},
        {"mlp_token_chunk_at_longest", cut_cfg.mlp_token_chunk},
        {"device", o.device},
        {"compute", o.compute},
        {"threads", threads}};
    std::cout << line.dump() << std::endl;
  }
}

}  // namespace strata::bench
