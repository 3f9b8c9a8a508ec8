#include "strata/engine/placement.h"

#include <sys/statvfs.h>

#include <algorithm>
#include <fstream>
#include <stdexcept>

#include "strata/engine/bytes.h"

namespace strata::engine {

namespace state {

const char* kind_name(int kind) {
  static const char* const names[kKinds] = {"master", "exp_avg", "exp_avg_sq", "grad", "compute"};
  if (kind < 0 || kind >= kKinds) throw std::out_of_range("unknown state kind " + std::to_string(kind));
  return names[kind];
}

Placement kind_tier(const StatePlacement& plan, int k) {
  switch (k) {
    case kMaster: return plan.master;
    case kExpAvg:
    case kExpAvgSq: return plan.moments;
    case kGrad: return plan.grads;
    case kCompute: return plan.params;
  }
  throw std::out_of_range("unknown state kind " + std::to_string(k));
}

}  // namespace state

namespace {

constexpr Placement kAuto = Placement::kAuto;

// Bytes left in each tier as kinds are placed.
struct Room {
  TierBudgets left;
  uint64_t& of(Placement p) { return p == Placement::kDevice ? left.device : p == Placement::kHost ? left.host : left.nvme; }
  bool fits(Placement p, uint64_t bytes) { return bytes <= of(p); }
  void take(Placement p, uint64_t bytes) { of(p) -= std::min(of(p), bytes); }
};

uint64_t mem_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit)
    if (key == "MemAvailable:") return kb * 1024;
  return 0;
}

}  // namespace

bool gradients_transient(const EngineConfig& cfg, Placement master) {
  return cfg.update_overlap == UpdateOverlap::kBackward && cfg.grad_accum == 1 && master != Placement::kDevice &&
         master != kAuto && cfg.grads != Placement::kDevice;
}

namespace {

// place_state's state while it places the kinds: the plan so far, the room left in each tier,
// and the bytes of the optimizer group (and of gradients placed with it) not yet placed.
struct Placer {
  const EngineConfig& cfg;
  const StateBytes& need;
  StatePlacement plan;
  Room room;
  bool transient = false;   // gradients not stored (if the master ends up off the device)
  bool grads_free = false;  // gradients placed automatically
  uint64_t group = 0;       // master and moments
  uint64_t rest_group = 0, rest_grads = 0;  // of the units not on the device

  Placer(const EngineConfig& c, const StateBytes& n, const TierBudgets& budgets)
      : cfg(c), need(n), plan{c.params, c.grads, c.master, c.moments}, room{budgets} {
    // Master and moments live together: an explicit one fixes the other.
    if (plan.master == kAuto) plan.master = plan.moments;
    if (plan.moments == kAuto) plan.moments = plan.master;
    // Gradients that are not stored (if the master ends up off the device) take only their
    // buffers, in host RAM, whatever tier the configuration names for them.
    transient = gradients_transient(cfg, plan.master == kAuto ? Placement::kHost : plan.master);
    grads_free = plan.grads == kAuto;
    group = need.master + need.moments;
    rest_group = group;
    rest_grads = grads_free ? need.grads : 0;
  }

  void take_buffers() {
    if (!room.fits(Placement::kHost, need.grad_buffers))
      throw std::runtime_error("automatic placement: the gradient buffers of the update during backward (" +
                               format_bytes(need.grad_buffers) + " on this rank) do not fit in host RAM (" +
                               format_bytes(room.left.host) + " left); raise offload.host_budget");
    room.take(Placement::kHost, need.grad_buffers);
  }

  // Fixed kinds first: their bytes are spoken for.
  void place_fixed() {
    if (plan.params != kAuto) room.take(plan.params, need.params);
    if (plan.grads != kAuto) {
      if (transient) take_buffers();
      else room.take(plan.grads, need.grads);
    }
    if (plan.master != kAuto) room.take(plan.master, need.master + need.moments);
  }

  // The optimizer group placed automatically: all on the device where it fits beside the
  // gradients and compute copies, else the device's share and the rest.
  void place_group() {
    const uint64_t params_on_device = plan.params == kAuto ? need.params : 0;
    if (room.fits(Placement::kDevice, group + (grads_free ? need.grads : 0) + params_on_device) &&
        (plan.grads == kAuto || plan.grads == Placement::kDevice)) {
      plan.master = plan.moments = Placement::kDevice;
      room.take(Placement::kDevice, group);
      rest_group = 0;
      return;
    }
    place_device_share();
    // What gradients placed here need beside the rest of the group on the host or in swap.
    const uint64_t grads_off_device = !grads_free ? 0 : transient ? need.grad_buffers : rest_grads;
    if (plan.device_units > 0 && plan.device_units == need.unit_numel.size()) {
      // The whole group fits there; the compute copies do not, and go elsewhere.
      plan.device_units = 0;
      plan.master = plan.moments = plan.grads = Placement::kDevice;
    } else if (room.fits(Placement::kHost, rest_group + grads_off_device) &&
               (plan.grads == kAuto || plan.grads == Placement::kHost || transient)) {
      plan.master = plan.moments = Placement::kHost;
      room.take(Placement::kHost, rest_group);
    } else {
      split_host_and_nvme();
    }
  }

  // The device's share: what is left of it once the compute copies have their room (where they
  // fit) holds the first units' master, moments and gradients (16 bytes an element; their update
  // runs on the device). Only with gradients placed automatically (a device unit's gradient lives
  // beside its master) and compute copies not in swap (the device writes them): without room on
  // the device, they take theirs in host RAM first.
  void place_device_share() {
    uint64_t device_elems = 0;
    const bool params_device = plan.params == kAuto && room.fits(Placement::kDevice, need.params);
    // (beside the gradient buffers, which host RAM must hold in any case)
    const bool params_host = plan.params == kAuto && !params_device &&
                             room.fits(Placement::kHost, need.params + (grads_free && transient ? need.grad_buffers : 0));
    if (params_device) {  // placed now, so that the room left says what the group has
      plan.params = Placement::kDevice;
      room.take(Placement::kDevice, need.params);
    }
    if (grads_free && (plan.params == Placement::kDevice || plan.params == Placement::kHost || params_host)) {
      for (uint64_t n : need.unit_numel) {
        if (16 * (device_elems + n) > room.left.device) break;
        device_elems += n;
        ++plan.device_units;
      }
    }
    room.take(Placement::kDevice, 16 * device_elems);
    if (plan.device_units > 0 && params_host) {
      plan.params = Placement::kHost;
      room.take(Placement::kHost, need.params);
    }
    rest_group -= std::min(rest_group, 12 * device_elems);
    rest_grads -= std::min(rest_grads, 4 * device_elems);
  }

  // The rest of the group split by unit between host RAM and swap, after the device's units (no
  // units given: all in swap).
  void split_host_and_nvme() {
    if (grads_free && transient) take_buffers();
    const bool grads_host = transient || plan.grads == Placement::kHost ||
                            (grads_free && room.fits(Placement::kHost, rest_grads));
    const bool grads_follow = !grads_host && plan.grads != Placement::kDevice;  // swap-bound gradients stay with their master
    uint64_t host_left = room.left.host - (grads_free && grads_host && !transient ? rest_grads : 0);
    if (plan.params == kAuto && !room.fits(Placement::kDevice, need.params) && host_left >= need.params)
      host_left -= need.params;
    uint64_t host_group = 0, host_grads = 0;  // bytes of the units kept in host RAM
    plan.host_units = plan.device_units;
    // Gradients placed in swap explicitly cannot follow a master into host RAM: no split then.
    const bool may_split = grads_free || transient || plan.grads != Placement::kNvme;
    for (size_t u = plan.device_units; may_split && u < need.unit_numel.size(); ++u) {
      const uint64_t n = need.unit_numel[u];
      const uint64_t grads_here = grads_follow ? 4 * n : 0;
      if (host_group + host_grads + 12 * n + grads_here > host_left) break;
      host_group += 12 * n;
      host_grads += grads_here;
      ++plan.host_units;
    }
    const uint64_t swapped = rest_group - host_group + (grads_free && grads_follow ? rest_grads - host_grads : 0);
    if (!room.fits(Placement::kNvme, swapped))
      throw std::runtime_error(
          "automatic placement: the fp32 master weights and Adam moments (" + format_bytes(group) +
          " on this rank) fit in no tier: device " + format_bytes(room.left.device) + ", host " +
          format_bytes(room.left.host) + ", NVMe " + format_bytes(room.left.nvme) +
          " left; raise offload.host_budget or offload.nvme_budget, add offload.nvme_dirs, or use more ranks");
    plan.master = plan.moments = Placement::kNvme;
    if (grads_free) {
      plan.grads = grads_host ? Placement::kHost : Placement::kNvme;
      if (grads_host && !transient) room.take(Placement::kHost, rest_grads);
    }
    room.take(Placement::kHost, host_group + host_grads);
    room.take(Placement::kNvme, swapped);
  }

  // Gradients placed automatically and not yet placed with their group: with their master (its
  // host buffers when not stored).
  void place_grads() {
    if (transient && plan.master != Placement::kDevice) {
      plan.grads = Placement::kHost;
      take_buffers();
    } else {
      if (plan.master != Placement::kNvme) plan.grads = plan.master;
      else plan.grads = room.fits(Placement::kHost, rest_grads) ? Placement::kHost : Placement::kNvme;
      room.take(plan.grads, plan.grads == Placement::kDevice ? need.grads : rest_grads);
    }
  }

  // Compute copies placed automatically: the fastest tier with room left after the group.
  void place_params() {
    for (Placement p : {Placement::kDevice, Placement::kHost, Placement::kNvme})
      if (room.fits(p, need.params)) {
        plan.params = p;
        break;
      }
    if (plan.params == kAuto)
      throw std::runtime_error("automatic placement: the compute copies (" + format_bytes(need.params) +
                               " on this rank) fit in no tier after the optimizer state");
    room.take(plan.params, need.params);
  }
};

}  // namespace

StatePlacement place_state(const EngineConfig& cfg, const StateBytes& need, const TierBudgets& budgets) {
  Placer p(cfg, need, budgets);
  p.place_fixed();
  if (p.plan.master == kAuto) p.place_group();
  if (p.grads_free && p.plan.grads == kAuto) p.place_grads();
  if (gradients_transient(cfg, p.plan.master)) {
    p.plan.grads = Placement::kHost;  // where each unit's gradient waits for its update
    p.plan.grads_transient = true;
  }
  if (p.plan.params == kAuto) p.place_params();
  return p.plan;
}

TierBudgets budgets_from(const EngineConfig& cfg, uint64_t device, uint64_t host_available, uint64_t nvme_free,
                         int local_ranks) {
  const uint64_t n = uint64_t(std::max(1, local_ranks));
  TierBudgets b;
  b.device = device;
  b.host = cfg.host_budget ? cfg.host_budget : uint64_t(double(host_available) * 0.8) / n;
  b.nvme = cfg.nvme_budget ? cfg.nvme_budget : cfg.nvme_dirs.empty() ? 0 : uint64_t(double(nvme_free) * 0.95) / n;
  return b;
}

MachineFree machine_free(const EngineConfig& cfg) {
  MachineFree m;
  for (const std::string& d : cfg.nvme_dirs) {
    struct statvfs st {};
    if (::statvfs(d.c_str(), &st) == 0) m.nvme_free += uint64_t(st.f_bavail) * st.f_frsize;
  }
  m.host_available = mem_available();
  return m;
}

TierBudgets machine_budgets(const EngineConfig& cfg, uint64_t device, int local_ranks) {
  const MachineFree m = machine_free(cfg);
  return budgets_from(cfg, device, m.host_available, m.nvme_free, local_ranks);
}

int PrefetchTuner::next(double waited) {
  depth = std::clamp(depth, 1, std::max(deepest, 1));
  if (settled) return depth;
  if (waited_before >= 0 && waited > 0.9 * waited_before) {
    depth = std::max(1, depth - 1);  // deeper did not help: more memory for nothing
    settled = true;
    return depth;
  }
  waited_before = -1;
  if (waited > 0.02 && depth < deepest) {
    waited_before = waited;
    ++depth;
  }
  return depth;
}

std::string describe_placement(const StatePlacement& p, const StateBytes& need) {
  // Kinds split by unit: the bytes of each tier's units, in forward order (device, host, swap).
  const size_t n = need.unit_numel.size();
  uint64_t total = 0;
  for (uint64_t e : need.unit_numel) total += e;
  auto one = [&](const char* what, Placement where, uint64_t bytes, bool splits) {
    const size_t host_end = where == Placement::kNvme ? std::max(p.host_units, p.device_units) : n;
    if (!splits || total == 0 || where == Placement::kDevice ||
        (p.device_units == 0 && (where != Placement::kNvme || p.host_units == 0)))
      return std::string(what) + " " + to_string(where) + " " + format_bytes(bytes);
    std::string out = what;
    uint64_t given = 0, elems = 0;
    size_t u = 0;
    const std::pair<Placement, size_t> ranges[] = {
        {Placement::kDevice, p.device_units}, {Placement::kHost, host_end}, {Placement::kNvme, n}};
    for (auto [tier, end] : ranges) {
      if (u >= end) continue;
      const size_t first = u;
      for (; u < end; ++u) elems += need.unit_numel[u];
      const uint64_t upto = end == n ? bytes : uint64_t(double(bytes) * double(elems) / double(total));
      out += std::string(given ? " + " : " ") + to_string(tier) + " " + format_bytes(upto - given) + " (units " +
             std::to_string(first) + "-" + std::to_string(end - 1) + ")";
      given = upto;
    }
    return out;
  };
  // The device units' share of the gradients, which stay stored there.
  auto device_grads = [&] {
    uint64_t elems = 0;
    for (size_t u = 0; u < p.device_units && u < n; ++u) elems += need.unit_numel[u];
    return format_bytes(total ? uint64_t(double(need.grads) * double(elems) / double(total)) : 0) + " (units 0-" +
           std::to_string(p.device_units - 1) + ")";
  };
  return one("params", p.params, need.params, false) + ", " +
         (p.grads_transient ? "grads not stored (updated during backward; host buffers " + format_bytes(need.grad_buffers) + ")" +
                                  (p.device_units ? " except device " + device_grads() : "")
                            : one("grads", p.grads, need.grads, p.grads == Placement::kNvme || p.device_units > 0)) +
         ", " + one("master", p.master, need.master, true) + ", " + one("moments", p.moments, need.moments, true);
}

}  // namespace strata::engine
