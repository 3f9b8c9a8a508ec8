// Automatic placement of the training state (place_state, describe_placement): the device, host
// RAM and swap filled in turn, the optimizer group split by unit between tiers, and gradients
// that are not stored (the update during backward).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <signal.h>
#include <sys/wait.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <future>
#include <limits>
#include <map>
#include <optional>
#include <sstream>
#include <string>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "strata/engine/comm.h"
#include "strata/engine/config.h"
#include "strata/engine/config_parse.h"
#include "strata/engine/placement.h"
#include "strata/engine/device.h"
#include "strata/engine/engine.h"
#include "strata/models/hf_io.h"
#include "strata/models/token_data.h"
#include "strata/offload/fault_injection.h"
#include "equivalence.h"
#include "launched.h"
#include "test_util.h"

namespace se = strata::engine;
namespace sm = strata::models;
using nlohmann::json;
using strata::test::TempDir;
using namespace strata::test;

namespace {

// --- automatic placement --------------------------------------------------------------------

TEST(StatePlacement, FillsTheDeviceThenHostThenNvme) {
  using P = se::Placement;
  se::EngineConfig c;
  c.params = c.grads = c.master = c.moments = P::kAuto;
  const se::StateBytes need{200, 400, 400, 800};  // bf16 compute copies, fp32 the rest
  auto plan = [&](uint64_t device, uint64_t host, uint64_t nvme) {
    const se::StatePlacement p = se::place_state(c, need, {device, host, nvme});
    return std::string(se::to_string(p.params)) + " " + se::to_string(p.grads) + " " +
           se::to_string(p.master) + " " + se::to_string(p.moments);
  };
  EXPECT_EQ(plan(1800, 0, 0), "device device device device");  // everything fits
  EXPECT_EQ(plan(1799, 1600, 0), "device host host host");     // the compute copies first
  EXPECT_EQ(plan(199, 1800, 0), "host host host host");
  EXPECT_EQ(plan(200, 1599, 1200), "device host nvme nvme");   // gradients stay on the host
  EXPECT_EQ(plan(0, 399, 1800), "host nvme nvme nvme");        // ... unless they do not fit
  EXPECT_EQ(plan(0, 0, 1800), "nvme nvme nvme nvme");
  try {
    plan(100, 100, 1199);
    FAIL() << "placed state that fits nowhere";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("fit in no tier"), std::string::npos) << e.what();
  }
  // Explicit kinds keep their tier and use its room; master fixes the moments.
  c.master = P::kHost;
  EXPECT_EQ(plan(10000, 1200, 0), "device host host host");
  c.master = P::kAuto;
  c.params = P::kNvme;
  EXPECT_EQ(plan(1600, 0, 200), "nvme device device device");
}

// Master and moments that fit no single tier are split by unit: the gradients (and compute
// copies the device cannot hold) take host RAM first, then the first units' master and moments,
// the rest go to swap; gradients that do not fit on the host follow their unit's master.
TEST(StatePlacement, SplitsTheOptimizerGroupByUnitBetweenHostAndSwap) {
  using P = se::Placement;
  se::EngineConfig c;
  c.params = c.grads = c.master = c.moments = P::kAuto;
  se::StateBytes need{800, 1600, 1600, 3200, {100, 100, 100, 100}};  // bf16 compute copies
  auto plan = [&](uint64_t device, uint64_t host, uint64_t nvme) {
    const se::StatePlacement p = se::place_state(c, need, {device, host, nvme});
    return std::string(se::to_string(p.params)) + " " + se::to_string(p.grads) + " " + se::to_string(p.master) +
           " " + se::to_string(p.moments) + " " + std::to_string(p.host_units);
  };
  // Host: gradients 1600 + compute copies 800 + two units' master and moments (2 x 1200).
  EXPECT_EQ(plan(0, 4800, 2400), "host host nvme nvme 2");
  EXPECT_EQ(plan(0, 4799, 3600), "host host nvme nvme 1");
  EXPECT_EQ(plan(0, 2400, 4800), "host host nvme nvme 0");  // no unit fits: all in swap
  try {
    plan(0, 4800, 2399);
    FAIL() << "the swapped half does not fit its budget";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("fit in no tier"), std::string::npos) << e.what();
  }
  const se::StatePlacement two = se::place_state(c, need, {0, 4800, 2400});
  EXPECT_NE(se::describe_placement(two, need).find("master host 800 B (units 0-1) + nvme 800 B"), std::string::npos)
      << se::describe_placement(two, need);
  // Compute copies on the device; gradients too large for the host follow their master: the
  // first unit (50 elements: 600 + 200 bytes) fits, the second does not.
  need = {800, 1600, 1600, 3200, {50, 100, 100, 150}};
  EXPECT_EQ(plan(800, 1500, 10000), "device nvme nvme nvme 1");
  EXPECT_NE(se::describe_placement(se::place_state(c, need, {800, 1500, 10000}), need).find("grads host 200 B (units 0-0) + nvme"),
            std::string::npos);
  // Gradients placed in swap explicitly cannot follow a master into host RAM: no split.
  c.grads = P::kNvme;
  EXPECT_EQ(plan(800, 4000, 10000), "device nvme nvme nvme 0");
}

// Gradients that are not stored (the update during backward, one micro-batch a step) take no
// room beside a master off the device; a master on the device still keeps them there.
TEST(StatePlacement, GradientsNotStoredTakeNoRoomOffTheDevice) {
  using P = se::Placement;
  se::EngineConfig c;
  c.params = c.grads = c.master = c.moments = P::kAuto;
  c.update_overlap = se::UpdateOverlap::kBackward;
  c.clip_grad_norm = 0;
  c.grad_accum = 1;
  // 400 bytes of gradient buffers instead of 1600 bytes of stored gradients.
  se::StateBytes need{800, 1600, 1600, 3200, {100, 100, 100, 100}, 400};
  auto plan = [&](uint64_t device, uint64_t host, uint64_t nvme) {
    const se::StatePlacement p = se::place_state(c, need, {device, host, nvme});
    return std::string(se::to_string(p.params)) + " " + se::to_string(p.grads) + " " + se::to_string(p.master) +
           " " + std::to_string(p.host_units) + (p.grads_transient ? " transient" : "");
  };
  // The device holds everything with gradients (800 + 1600 + 4800) or nothing but compute copies.
  EXPECT_EQ(plan(7200, 0, 0), "device device device 0");
  // Master and moments (4800) and the buffers (400) fill the host whole, where stored gradients
  // would need 1600.
  EXPECT_EQ(plan(800, 5200, 0), "device host host 0 transient");
  // Split: the buffers, then three units' master and moments (3600) in 4799 of host RAM.
  EXPECT_EQ(plan(800, 5199, 1200), "device host nvme 3 transient");
  EXPECT_EQ(plan(800, 2800, 2400), "device host nvme 2 transient");
  EXPECT_NE(se::describe_placement(se::place_state(c, need, {800, 5200, 0}), need).find("grads not stored (updated during backward; host buffers 400 B)"),
            std::string::npos) << se::describe_placement(se::place_state(c, need, {800, 5200, 0}), need);
  // Gradients placed in swap explicitly are not stored either: the group still splits.
  c.grads = P::kNvme;
  EXPECT_EQ(plan(800, 2800, 2400), "device host nvme 2 transient");
  c.grads = P::kAuto;
  c.grad_accum = 2;  // accumulated over micro-batches: stored (1600 on the host), one unit fewer
  EXPECT_EQ(plan(800, 4800, 2400), "device host nvme 2");
  c.grad_accum = 1;
  c.update_overlap = se::UpdateOverlap::kForward;
  EXPECT_EQ(plan(800, 4800, 2400), "device host nvme 2");
  // Master placed in swap explicitly: the buffers still go to the host, and must fit there.
  c.update_overlap = se::UpdateOverlap::kBackward;
  c.master = c.moments = P::kNvme;
  EXPECT_EQ(plan(800, 400, 4800), "device host nvme 0 transient");
  try {
    plan(800, 399, 4800);
    FAIL() << "buffers that do not fit the host were placed";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("gradient buffers"), std::string::npos) << e.what();
  }
  // Gradients placed on the device explicitly are stored there.
  c.master = c.moments = P::kAuto;
  c.grads = P::kDevice;
  EXPECT_EQ(plan(7200, 0, 0), "device device device 0");
}

// The device's room beside the compute copies holds the first units' master, moments and
// gradients (16 bytes an element), before host RAM and swap take the rest.
TEST(StatePlacement, GivesTheDeviceTheFirstUnitsOfTheOptimizerGroup) {
  using P = se::Placement;
  se::EngineConfig c;
  c.params = c.grads = c.master = c.moments = P::kAuto;
  se::StateBytes need{800, 1600, 1600, 3200, {100, 100, 100, 100}};  // bf16 compute copies
  auto plan = [&](uint64_t device, uint64_t host, uint64_t nvme) {
    const se::StatePlacement p = se::place_state(c, need, {device, host, nvme});
    return std::string(se::to_string(p.params)) + " " + se::to_string(p.grads) + " " + se::to_string(p.master) +
           " d" + std::to_string(p.device_units) + " h" + std::to_string(p.host_units) + (p.grads_transient ? " transient" : "");
  };
  EXPECT_EQ(plan(8000, 0, 0), "device device device d0 h0");       // everything fits
  EXPECT_EQ(plan(800 + 1600, 10000, 0), "device host host d1 h0");  // one unit beside the compute copies
  EXPECT_EQ(plan(800 + 3199, 10000, 0), "device host host d1 h0");
  EXPECT_EQ(plan(800 + 3200, 0, 10000), "device nvme nvme d2 h2");  // no host RAM: the rest in swap
  // Gradients of the other units (1200) on the host, one more unit's master and moments there,
  // two in swap.
  EXPECT_EQ(plan(800 + 1600, 2400, 2400), "device host nvme d1 h2");
  const se::StatePlacement three = se::place_state(c, need, {800 + 1600, 2400, 2400});
  const std::string text = se::describe_placement(three, need);
  EXPECT_NE(text.find("grads device 400 B (units 0-0) + host 1.17 KiB (units 1-3)"), std::string::npos) << text;
  EXPECT_NE(text.find("master device 400 B (units 0-0) + host 400 B (units 1-1) + nvme 800 B (units 2-3)"),
            std::string::npos) << text;
  try {
    plan(800 + 1600, 2400, 2399);
    FAIL() << "the swapped units do not fit their budget";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("fit in no tier"), std::string::npos) << e.what();
  }
  // Compute copies too large for the device go to the host first, then the group takes the device:
  // all of it here, so that it is not split.
  need.params = 5000;
  EXPECT_EQ(plan(1600, 10000, 0), "host host host d1 h0");
  need.params = 7000;
  EXPECT_EQ(plan(6400, 10000, 0), "host device device d0 h0");
  need.params = 5000;
  // ... and with no room for them on the host either, none: the device cannot write compute
  // copies in swap.
  EXPECT_EQ(plan(1600, 4000, 10000), "nvme host nvme d0 h2");
  need.params = 800;
  // Gradients placed explicitly: no device share (a device unit's gradient lives beside it).
  c.grads = P::kHost;
  EXPECT_EQ(plan(800 + 1600, 10000, 0), "device host host d0 h0");
  // The update during backward with one micro-batch: the device's units keep their gradients, the
  // others' go through the buffers (400) on the host.
  c.grads = P::kAuto;
  c.update_overlap = se::UpdateOverlap::kBackward;
  c.clip_grad_norm = 0;
  c.grad_accum = 1;
  need.grad_buffers = 400;
  EXPECT_EQ(plan(800 + 1600, 3600 + 400, 0), "device host host d1 h0 transient");
  const std::string transient = se::describe_placement(se::place_state(c, need, {800 + 1600, 4000, 0}), need);
  EXPECT_NE(transient.find("grads not stored (updated during backward; host buffers 400 B) except device 400 B (units 0-0)"),
            std::string::npos) << transient;
  // Compute copies that fit on the host but not beside the buffers there: no device share (it
  // would need them in host RAM), and the rest is placed as without one.
  need.params = 2000;
  EXPECT_EQ(plan(1600, 2200, 10000), "nvme host nvme d0 h1 transient");
}

}  // namespace
