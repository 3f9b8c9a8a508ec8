// The ZeRO-3 partition map (Partition): units' tensors laid out and sharded with the documented
// alignment and padding at world sizes 1 to 4, located by name, and invalid unit lists refused.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "strata/engine/comm.h"
#include "strata/engine/config.h"
#include "strata/engine/config_parse.h"
#include "strata/engine/cpu_share.h"
#include "strata/engine/device.h"
#include "strata/engine/partition.h"
#include "strata/models/model_config.h"
#include "test_util.h"
#include "thrown_message.h"

namespace strata::engine {
namespace {

using test::contains;
using test::thrown_message;

using UnitSpecs = std::vector<std::pair<std::string, std::vector<TensorSpec>>>;

// ---------------------------------------------------------------------------------------------
// Partition

uint64_t product(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= uint64_t(d);
  return n;
}

// Units whose tensors have awkward element counts, including a prime above one million.
UnitSpecs awkward_units() {
  return {
      {"embed", {{"wte", {7}}, {"wpe", {1}}}},
      {"block.0", {{"block.0.w", {1000003}}, {"block.0.b", {1}}, {"block.0.x", {3, 5, 7}}}},
      {"one", {{"one.scalar", {1}}}},
      {"seven", {{"seven.v", {7}}}},
      {"prime", {{"prime.v", {1000003}}}},
  };
}

// Every property the header promises, checked against the tensor lists the partition was built
// from.
void expect_valid_layout(const Partition& p, const UnitSpecs& units, int world, uint64_t align) {
  ASSERT_EQ(p.world_size(), world);
  ASSERT_EQ(p.num_units(), units.size());
  uint64_t total = 0, total_shard = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    SCOPED_TRACE("unit " + units[u].first + ", world " + std::to_string(world) + ", align " +
                 std::to_string(align));
    const UnitLayout& layout = p.unit(u);
    EXPECT_EQ(layout.name, units[u].first);
    EXPECT_EQ(layout.world_size, uint64_t(world));
    ASSERT_EQ(layout.tensors.size(), units[u].second.size());
    uint64_t next_offset = 0;
    for (size_t t = 0; t < layout.tensors.size(); ++t) {
      const TensorSpec& spec = units[u].second[t];
      const TensorSlot& slot = layout.tensors[t];
      EXPECT_EQ(slot.name, spec.name);
      EXPECT_EQ(slot.shape, spec.shape);
      EXPECT_EQ(slot.numel, product(spec.shape));
      EXPECT_EQ(slot.offset, next_offset) << spec.name << " is not right after its predecessor";
      next_offset += slot.numel;
      const TensorLocation loc = p.locate(spec.name);
      EXPECT_EQ(loc.unit, u);
      EXPECT_EQ(loc.slot, &layout.tensors[t]);
    }
    EXPECT_EQ(layout.numel, next_offset);
    EXPECT_GT(layout.shard_numel, 0u);
    EXPECT_EQ(layout.shard_numel % align, 0u);
    EXPECT_EQ(layout.padded_numel(), layout.shard_numel * uint64_t(world));
    EXPECT_GE(layout.padded_numel(), layout.numel);
    // No more padding than alignment requires: under one alignment block per rank.
    EXPECT_LT(layout.padded_numel() - layout.numel, uint64_t(world) * align);
    uint64_t valid_sum = 0;
    for (int r = 0; r < world; ++r) {
      const uint64_t begin = layout.shard_begin(r);
      EXPECT_EQ(begin, uint64_t(r) * layout.shard_numel);
      const uint64_t expected_valid =
          begin >= layout.numel ? 0 : std::min(layout.shard_numel, layout.numel - begin);
      EXPECT_EQ(layout.shard_valid_numel(r), expected_valid) << "rank " << r;
      valid_sum += layout.shard_valid_numel(r);
    }
    EXPECT_EQ(valid_sum, layout.numel);
    total += layout.numel;
    total_shard += layout.shard_numel;
  }
  EXPECT_EQ(p.total_numel(), total);
  EXPECT_EQ(p.total_shard_numel(), total_shard);
}

TEST(Partition, LayoutHoldsForAwkwardSizesAtWorldSizesOneToFour) {
  const UnitSpecs units = awkward_units();
  for (uint64_t align : {Partition::kDefaultAlignNumel, uint64_t(1), uint64_t(3)}) {
    for (int world = 1; world <= 4; ++world) {
      const Partition p(units, world, align);
      expect_valid_layout(p, units, world, align);
    }
  }
  // The default alignment is 1024 elements (4 KiB of fp32).
  const Partition p(units, 2);
  expect_valid_layout(p, units, 2, 1024);
}

TEST(Partition, ShardSizesMatchHandComputedValues) {
  // 1000003 elements over 3 ranks: ceil(1000003 / 3) = 333335, rounded up to 1024s = 333824.
  const Partition p({{"u", {{"w", {1000003}}}}}, 3);
  const UnitLayout& u = p.unit(0);
  EXPECT_EQ(u.shard_numel, 333824u);
  EXPECT_EQ(u.padded_numel(), 1001472u);
  EXPECT_EQ(u.shard_valid_numel(0), 333824u);
  EXPECT_EQ(u.shard_valid_numel(1), 333824u);
  EXPECT_EQ(u.shard_valid_numel(2), 1000003u - 2 * 333824u);

  // One element over four ranks: one aligned block each, only rank 0 holds real data.
  const Partition q({{"u", {{"x", {1}}}}}, 4);
  EXPECT_EQ(q.unit(0).shard_numel, 1024u);
  EXPECT_EQ(q.unit(0).shard_valid_numel(0), 1u);
  for (int r = 1; r < 4; ++r) EXPECT_EQ(q.unit(0).shard_valid_numel(r), 0u);
}

TEST(Partition, SameTensorListsGiveTheSameMap) {
  const UnitSpecs units = awkward_units();
  const Partition a(units, 3), b(units, 3);
  for (const auto& [unit_name, specs] : units) {
    for (const TensorSpec& spec : specs) {
      const TensorLocation la = a.locate(spec.name), lb = b.locate(spec.name);
      EXPECT_EQ(la.unit, lb.unit);
      EXPECT_EQ(la.slot->offset, lb.slot->offset);
      EXPECT_EQ(a.unit(la.unit).shard_numel, b.unit(lb.unit).shard_numel);
    }
  }
}

TEST(Partition, UnknownNameThrowsOutOfRangeNamingIt) {
  const Partition p(awkward_units(), 2);
  const std::string msg =
      thrown_message<std::out_of_range>([&] { p.locate("block.0.missing_weight"); });
  EXPECT_TRUE(contains(msg, "block.0.missing_weight")) << msg;
  EXPECT_THROW(p.locate(""), std::out_of_range);
}

TEST(Partition, InvalidUnitListsAreRejected) {
  // The same name twice in one unit, and in two units.
  EXPECT_THROW(Partition({{"u", {{"w", {4}}, {"w", {4}}}}}, 1), std::invalid_argument);
  const std::string msg = thrown_message<std::invalid_argument>(
      [] { Partition({{"a", {{"shared", {4}}}}, {"b", {{"shared", {4}}}}}, 2); });
  EXPECT_TRUE(contains(msg, "shared")) << msg;
  // A unit without tensors.
  EXPECT_THROW(Partition({{"a", {{"w", {4}}}}, {"empty", {}}}, 2), std::invalid_argument);
  // World size and alignment below one; a negative dimension.
  EXPECT_THROW(Partition({{"a", {{"w", {4}}}}}, 0), std::invalid_argument);
  EXPECT_THROW(Partition({{"a", {{"w", {4}}}}}, 1, 0), std::invalid_argument);
  EXPECT_THROW(Partition({{"a", {{"w", {4, -1}}}}}, 1), std::invalid_argument);
}

}  // namespace
}  // namespace strata::engine
