// The layout's steps of the resolution (layout/resolve.h, phase one): the state's bytes, the tiles,
// the MLP token chunk, the head's cut, the placement, and the effective configuration.
#include "strata/engine/layout/resolve.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <stdexcept>
#include <utility>

#include "strata/engine/bytes.h"
#include "strata/engine/partition.h"

namespace strata::engine {

StateBytes state_bytes(const std::vector<uint64_t>& shard_numel, uint64_t compute_bytes, size_t transient_buffers,
                       const std::vector<char>& frozen) {
  StateBytes need;
  for (size_t u = 0; u < shard_numel.size(); ++u) {
    const uint64_t c = shard_numel[u], n = !frozen.empty() && frozen[u] ? 0 : c;
    need.params += c * compute_bytes;
    need.grads += n * 4;
    need.master += n * 4;
    need.moments += n * 8;
    need.unit_numel.push_back(n);
    need.compute_numel.push_back(c);
  }
  need.grad_buffers = uint64_t(transient_buffers) * need.largest_trainable_shard() * 4;
  return need;
}

uint64_t explicit_device_bytes(const EngineConfig& cfg, const StateBytes& need) {
  return (cfg.params == Placement::kDevice ? need.params : 0) + (cfg.grads == Placement::kDevice ? need.grads : 0) +
         (cfg.master == Placement::kDevice ? need.master + need.moments : 0);
}

TierBytes bytes_by_tier(const StatePlacement& p, const StateBytes& need, uint64_t compute_bytes) {
  TierBytes b;
  b.host = p.grads_transient ? need.grad_buffers : 0;
  for (size_t u = 0; u < need.unit_numel.size(); ++u)
    for (int k = 0; k < state::kKinds; ++k) {
      const Placement kind = state::unit_kind_tier(p, u, k);
      if (k == state::kGrad && p.grads_transient && kind != Placement::kDevice) continue;  // counted as the buffers
      const uint64_t bytes = k == state::kCompute
                                 ? (need.compute_numel.empty() ? need.unit_numel[u] : need.compute_numel[u]) * compute_bytes
                                 : need.unit_numel[u] * 4;
      (kind == Placement::kDevice ? b.device : kind == Placement::kHost ? b.host : b.nvme) += bytes;
    }
  return b;
}

models::LayerTiles resolve_tiles(const EngineConfig& cfg, const models::ModelConfig& mc,
                                  const std::function<bool(const models::LayerTiles&, bool efficient_logits)>& fits,
                                  const Agree& agree) {
  const bool auto_attention = cfg.attention_tiles == EngineConfig::kTilesAuto,
             auto_mlp = cfg.mlp_tiles == EngineConfig::kTilesAuto, auto_vocab = cfg.vocab_tiles == EngineConfig::kTilesAuto;
  models::LayerTiles chosen{auto_attention ? 1 : int64_t(cfg.attention_tiles), auto_mlp ? 1 : int64_t(cfg.mlp_tiles),
                             auto_vocab ? 1 : int64_t(cfg.vocab_tiles)};
  models::check_tiles(mc, chosen);
  if (!auto_attention && !auto_mlp && !auto_vocab) return chosen;
  // Each kind's share of a block's parameters (its norm included).
  models::ModelConfig base = mc;  // the proportions of the base's block (the adapters are a few MB)
  base.lora = {};
  // (A model whose MLP is never cut, models::most_tiles, is never tiled by "auto" either: its
  // share is then the whole block's, and the cut below stays 1 x 1.)
  const std::vector<uint64_t> split =
      models::stage_parameters(base, {1, 1 + int64_t(models::most_tiles(base).mlp > 1)});
  const double attention = double(split.at(1)), block = double(mc.block_parameters());
  const models::LayerTiles leanest = leanest_tiling(cfg, mc);
  const int64_t most_attention = leanest.attention, most_mlp = leanest.mlp, most_vocab = leanest.vocab;
  const auto cut = [&](int64_t k) {
    models::LayerTiles t = chosen;
    if (auto_attention) t.attention = std::clamp<int64_t>(int64_t(std::ceil(double(k) * attention / block)), 1, most_attention);
    if (auto_mlp) t.mlp = std::clamp<int64_t>(int64_t(std::ceil(double(k) * (block - attention) / block)), 1, most_mlp);
    return t;
  };
  // k = 1, 2, ... (every k to 64, then doubling) until one fits with the vocabulary in the most
  // tiles "auto" cuts, or no count can grow; at that k, the fewest vocabulary tiles that fit
  // (whole, then 2, 4, ...). One test a k while nothing fits: a large model's search stays short.
  // With the smallest logits tiles first; then, where the vocabulary can be cut and the head's
  // tiles are "auto", again with efficient logits tiles at no larger block cut: the same blocks,
  // more vocabulary tiles rather than tiny logits tiles (never more block tiles for it).
  struct Found {
    models::LayerTiles tiles;
    int64_t k;
  };
  const auto search = [&](bool efficient_logits, int64_t most_k) -> std::optional<Found> {
    for (int64_t k = 1; k <= most_k; k = k < 64 ? k + 1 : k * 2) {
      models::LayerTiles t = cut(k);
      t.vocab = most_vocab;
      if (fits(t, efficient_logits)) {
        for (int64_t v = chosen.vocab; v < most_vocab; v = std::min(most_vocab, v * 2)) {
          models::LayerTiles fewer = t;
          fewer.vocab = v;
          if (fits(fewer, efficient_logits)) {
            t = fewer;
            break;
          }
        }
        return Found{t, k};
      }
      if (t.attention == most_attention && t.mlp == most_mlp) break;
    }
    return std::nullopt;
  };
  std::optional<Found> smallest = search(false, std::numeric_limits<int64_t>::max());
  if (smallest && auto_vocab && most_vocab > 1 && cfg.head_tiles == EngineConfig::kTilesAuto)
    if (std::optional<Found> efficient = search(true, smallest->k)) smallest = efficient;
  const std::optional<models::LayerTiles> found =
      smallest ? std::optional<models::LayerTiles>(smallest->tiles) : std::nullopt;
  // None fits: whole blocks and vocabulary (as configured), whose budget check then names what
  // is left.
  const models::LayerTiles pick = found ? *found : cut(1);
  const std::vector<int64_t> agreed = agree({pick.attention, pick.mlp, pick.vocab});
  return {agreed[0], agreed[1], agreed[2]};
}

models::LayerTiles leanest_tiling(const EngineConfig& cfg, const models::ModelConfig& mc) {
  const auto most = [](uint64_t configured, int64_t most_auto) {
    return configured == EngineConfig::kTilesAuto ? std::max<int64_t>(1, most_auto) : int64_t(configured);
  };
  // "auto" cuts no further than the model allows (models::most_tiles), nor MLP tiles narrower than
  // 64 features (a dense MLP's) or vocabulary tiles smaller than kMinTileVocab rows.
  // A mixture's sparse blocks cut into as many groups as they have experts (each of any width);
  // its dense blocks, if any, no narrower than 64 features either.
  const models::LayerTiles allowed = models::most_tiles(mc);
  const int64_t mlp = mc.has_dense_blocks() ? std::min(allowed.mlp, mc.intermediate / 64) : allowed.mlp;
  return {most(cfg.attention_tiles, allowed.attention), most(cfg.mlp_tiles, mlp),
          most(cfg.vocab_tiles, mc.vocab_size / int64_t(layout::kMinTileVocab))};
}

int64_t resolve_mlp_token_chunk(const EngineConfig& cfg, const models::ModelConfig& mc,
                                const std::function<bool(const models::LayerTiles&, int64_t chunk)>& fits,
                                const Agree& agree) {
  if (mc.lora.enabled()) {  // the adapted MLP runs plain (tiling::plain_mlp)
    if (cfg.mlp_token_chunk > 0)
      throw std::invalid_argument("placement.tiling mlp_tokens: LoRA adapters (model.lora) run whole MLPs; "
                                  "leave it \"auto\" or 0");
    return 0;
  }
  if (cfg.mlp_token_chunk != EngineConfig::kMlpChunkAuto) return cfg.mlp_token_chunk;
  const models::LayerTiles leanest = leanest_tiling(cfg, mc);
  models::check_tiles(mc, leanest);
  const int64_t chunk =
      fits(leanest, 0) ? 0 : int64_t(layout::auto_mlp_token_chunk(uint64_t(cfg.micro_batch * cfg.seq_len)));
  return agree({chunk})[0];
}

std::string describe_tiles(const models::LayerTiles& t, int64_t mlp_token_chunk, const layout::MemoryModel& mm) {
  std::string out;
  if (!t.blocks_whole())
    out += "; blocks in " + std::to_string(t.attention) + " attention x " + std::to_string(t.mlp) + " MLP tiles";
  if (t.vocab > 1) out += "; embedding and LM head in " + std::to_string(t.vocab) + " vocabulary tiles";
  if (!out.empty()) out += " (largest unit " + format_bytes(mm.largest_unit()) + ")";
  if (mlp_token_chunk > 0) out += "; MLP over chunks of " + std::to_string(mlp_token_chunk) + " tokens";
  return out;
}

HeadCut resolve_head_tiles(const EngineConfig& cfg, const layout::Schedule& schedule, const layout::ModelSizes& sizes,
                           const layout::Choices& choice, uint64_t base, uint64_t usable, const Agree& agree) {
  // The cut enters the working set only through the head's loss bytes, which it never shrinks
  // with (layout::head_loss_bytes): a cut whose loss is no larger than one that fit fits, one
  // whose loss is no smaller than one that did not does not, and only the others build a model
  // (thousands of counts are weighed, each model O(stages)).
  uint64_t fit_loss = 0, miss_loss = UINT64_MAX;
  bool any_fit = false;
  layout::ModelSizes trial = sizes;
  const auto fits = [&](const layout::LogitsTiles& t) {
    if (usable == UINT64_MAX) return true;
    trial.logits = t;
    const uint64_t loss = layout::head_loss_bytes(trial);
    if (any_fit && loss <= fit_loss) return true;
    if (loss >= miss_loss) return false;
    const bool fit = base + layout::MemoryModel(schedule, trial).working_set(choice) <= usable;
    if (fit) any_fit = true, fit_loss = std::max(fit_loss, loss);
    else miss_loss = std::min(miss_loss, loss);
    return fit;
  };
  const auto one_pass_cut = [&](uint64_t count) {
    const layout::LogitsTiles t = layout::one_pass_tiles(sizes.tokens, sizes.vocab, count);
    return t.tiled(sizes.tokens, sizes.vocab) ? std::optional<layout::LogitsTiles>(t) : std::nullopt;
  };
  const auto two_pass_cut = [&](uint64_t count) { return layout::logits_tiles(sizes.tokens, sizes.vocab, count); };
  // A count's cut: with `one_pass`, one pass where it fits (fewer products), else two passes.
  const auto cut_that_fits = [&](uint64_t count, bool one_pass) -> std::optional<layout::LogitsTiles> {
    if (const auto one = one_pass ? one_pass_cut(count) : std::nullopt; one && fits(*one)) return one;
    if (const layout::LogitsTiles two = two_pass_cut(count); fits(two)) return two;
    return std::nullopt;
  };
  // The count: the configured one, or the fewest that fits (see the header).
  const auto count_for = [&](bool one_pass) -> uint64_t {
    if (cfg.head_tiles != EngineConfig::kTilesAuto) return cfg.head_tiles;
    // The cut's bytes are not monotone in the count (a count that adds a token chunk can leave
    // wider tiles than one fewer), so every count is tried in order up to kScanned; beyond,
    // doubling and a binary search give about the fewest.
    constexpr uint64_t kScanned = 4096;
    const uint64_t most = std::max<uint64_t>(1, layout::max_auto_logits_tiles(sizes.tokens, sizes.vocab));
    const auto fits_count = [&](uint64_t c) { return cut_that_fits(c, one_pass).has_value(); };
    for (uint64_t c = 1; c <= std::min(most, kScanned); ++c)
      if (fits_count(c)) return c;
    if (most > kScanned) {
      uint64_t hi = kScanned;
      while (hi < most && !fits_count(hi)) hi = std::min(most, hi * 2);
      if (fits_count(hi)) {
        uint64_t lo = hi / 2;  // did not fit
        while (hi - lo > 1) (fits_count(lo + (hi - lo) / 2) ? hi : lo) = lo + (hi - lo) / 2;
        return hi;
      }
    }
    // Nothing fits: the smallest tiles "auto" cuts; construction's budget check names what is left.
    return most;
  };
  // First the passes, every rank alike: one only if every rank's cut is one pass (two are the
  // safe choice, code 1, the larger). Then the count under the agreed passes, the most any rank
  // needs: a rank that wanted one pass looks again with two before it says its count.
  const bool may_one_pass = cfg.head_one_pass && sizes.vocab_tiles <= 1;
  bool one_pass = false;
  if (may_one_pass) {
    const std::optional<layout::LogitsTiles> mine = cut_that_fits(count_for(true), true);
    one_pass = agree({mine && mine->one_pass ? 0 : 1})[0] == 0;
  }
  HeadCut cut;
  cut.count = uint64_t(agree({int64_t(count_for(one_pass))})[0]);
  const std::optional<layout::LogitsTiles> one = one_pass ? one_pass_cut(cut.count) : std::nullopt;
  cut.logits = one ? *one : two_pass_cut(cut.count);
  return cut;
}

StatePlacement resolve_placement(const EngineConfig& cfg, const layout::MemoryModel& mm, const layout::Choices& choice,
                                const StateBytes& need, uint64_t usable_device,
                                const std::function<TierBudgets(uint64_t)>& budgets_for, const Agree& agree,
                                std::string& report) {
  // Transient gradients wait for their update in host buffers: the plan says kHost for them.
  const auto finish = [&](StatePlacement p) {
    if (p.grads_transient) p.grads = Placement::kHost;
    return p;
  };
  const bool any_auto = cfg.params == Placement::kAuto || cfg.grads == Placement::kAuto ||
                        cfg.master == Placement::kAuto || cfg.moments == Placement::kAuto;
  if (!any_auto) {
    StatePlacement plan{cfg.params, cfg.grads, cfg.master, cfg.moments};
    plan.grads_transient = gradients_transient(cfg, cfg.master);
    report = "placement: " + describe_placement(plan, need);
    return finish(plan);
  }
  // The device keeps room for the working set (prefetch "auto": its starting depth; blocks kept
  // without recompute: an explicit count; checkpoints: where placed explicitly).
  const uint64_t working = mm.working_set(choice);
  const uint64_t device_state =
      usable_device == UINT64_MAX ? usable_device : usable_device > working ? usable_device - working : 0;
  TierBudgets budgets = budgets_for(device_state);
  // Checkpoints placed on the host explicitly need their room beside the state.
  if (cfg.activations == Placement::kHost) budgets.host -= std::min(budgets.host, mm.checkpoint_bytes(choice));
  StatePlacement plan = place_state(cfg, need, budgets);
  // This rank's bytes in host RAM and in swap under a plan (as StateStore::placement will say).
  const uint64_t compute_bytes = mm.sizes().compute_bytes;
  const auto host_and_nvme = [&](const StatePlacement& p) {
    const TierBytes b = bytes_by_tier(p, need, compute_bytes);
    return std::pair<uint64_t, uint64_t>{b.host, b.nvme};
  };
  const auto [planned_host, planned_nvme] = host_and_nvme(plan);
  // Every rank takes the slowest tier any rank chose for each kind, and of a split optimizer
  // group the fewest units on the device and in host RAM (a group wholly in a tier counts as
  // all units there), so that all agree.
  const int64_t n_units = int64_t(need.unit_numel.size());
  const int64_t on_device = plan.master == Placement::kDevice ? n_units : int64_t(plan.device_units);
  const int64_t on_host =
      plan.master == Placement::kNvme ? int64_t(std::max(plan.host_units, plan.device_units)) : n_units;
  const std::vector<int64_t> codes = agree({int64_t(plan.params), int64_t(plan.grads), int64_t(plan.master),
                                            int64_t(plan.moments), n_units - on_host, n_units - on_device});
  plan = {Placement(codes[0]), Placement(codes[1]), Placement(codes[2]), Placement(codes[3])};
  plan.grads_transient = gradients_transient(cfg, plan.master);
  if (plan.master != Placement::kDevice) plan.device_units = size_t(n_units - codes[5]);
  if (plan.master == Placement::kNvme) plan.host_units = size_t(n_units - codes[4]);
  // A rank may now hold more in host RAM or swap than it planned (another rank chose a slower
  // tier, or fewer units on the device or in host RAM): check those budgets again, so that it
  // fails here, clearly, not on a full disk or out of memory.
  const auto [hosted, swapped] = host_and_nvme(plan);
  if ((swapped > planned_nvme && swapped > budgets.nvme) || (hosted > planned_host && hosted > budgets.host))
    throw std::runtime_error("automatic placement: the ranks agreed on placing " + format_bytes(hosted) +
                             " of this rank's state in host RAM and " + format_bytes(swapped) +
                             " in swap, over its budgets of " + format_bytes(budgets.host) + " and " +
                             format_bytes(budgets.nvme) + " (another rank had less room elsewhere); "
                             "raise offload.host_budget or offload.nvme_budget, or place kinds explicitly");
  EngineConfig resolved = cfg;  // the agreed tiers must be a valid configuration
  resolved.params = plan.params;
  resolved.grads = plan.grads;
  resolved.master = plan.master;
  resolved.moments = plan.moments;
  resolved.validate();
  const auto budget = [](uint64_t b) { return b == UINT64_MAX ? std::string("unlimited") : format_bytes(b); };
  report = "placement (auto): " + describe_placement(plan, need) + "; budgets for state: device " + budget(budgets.device) +
           " (after a " + format_bytes(working) + " working set), host " + budget(budgets.host) + ", NVMe " +
           budget(budgets.nvme);
  return finish(plan);
}

EngineConfig effective_config(const EngineConfig& cfg, const Layout& layout, const layout::Choices& choice) {
  EngineConfig e = cfg;
  e.params = layout.placement.params;
  e.grads = layout.placement.grads;
  e.master = layout.placement.master;
  e.moments = layout.placement.moments;
  e.activations = choice.activations;
  e.recompute_blocks = int(layout.tiles.whole_blocks(choice.recomputed));
  e.head_tiles = layout.head.count;
  e.head_one_pass = layout.head.logits.one_pass;
  e.attention_tiles = uint64_t(layout.tiles.attention);
  e.mlp_tiles = uint64_t(layout.tiles.mlp);
  e.vocab_tiles = uint64_t(layout.tiles.vocab);
  e.mlp_token_chunk = layout.mlp_token_chunk;
  return e;
}

}  // namespace strata::engine
