// What a test of the engine's state parts needs on the host device: a temporary swap directory
// with its I/O engine, host memory, a profiler, and a state store over a given partition and
// plan, with put/get of whole shards through the store (any tier).
#pragma once

#include <ATen/ATen.h>

#include <memory>

#include "profiler.h"
#include "state/host_memory.h"
#include "state/state_store.h"
#include "strata/engine/device.h"
#include "strata/offload/io_engine.h"
#include "strata/offload/swap_space.h"
#include "test_util.h"

namespace strata::engine::runtime {}  // (the runtime parts' headers fill it)

namespace strata::test {

using engine::Device;
using engine::Partition;
using engine::StatePlacement;
namespace state = engine::state;
namespace runtime = engine::runtime;
using engine::Profiler;

struct StateFixture {
  TempDir dir;
  std::unique_ptr<Device> device;
  state::HostMemory host;
  std::unique_ptr<offload::IoEngine> io = offload::IoEngine::create({});
  std::unique_ptr<offload::SwapSpace> swap;
  Profiler prof;
  Partition partition;
  std::unique_ptr<state::StateStore> store;

  StateFixture(Partition p, const StatePlacement& plan, uint64_t device_budget = UINT64_MAX)
      : device(Device::create_host(device_budget)), host(*device), partition(std::move(p)) {
    offload::SwapConfig sc;
    sc.dirs = {dir.path()};
    swap = std::make_unique<offload::SwapSpace>(*io, sc);
    store = std::make_unique<state::StateStore>(partition, at::kBFloat16, plan, *device, host, swap.get(), prof);
  }
  void put(size_t u, int k, const at::Tensor& values) {
    at::Tensor h = state::HostMemory::unpinned(uint64_t(values.numel()), store->dtype(k));
    h.copy_(values);
    store->write(u, k, 0, h).get();
  }
  at::Tensor get(size_t u, int k) {
    at::Tensor out = state::HostMemory::unpinned(partition.unit(u).shard_numel, store->dtype(k));
    store->read(u, k, 0, out).get();
    return out;
  }
};

}  // namespace strata::test
