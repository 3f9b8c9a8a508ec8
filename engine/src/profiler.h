// The per-step timeline (StepTimeline) and, when profiling, the trace spans: a leaf every part
// of the engine (state, runtime, the step) reports to; it includes nothing of theirs. Waits are timed by scope (Profiler::time) and named by cause.
//
// Ownership and threads: the training thread owns `step`; the updater thread and I/O
// completions touch only the atomics and, under `mu`, the spans.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "strata/engine/timeline.h"

namespace strata::engine {

struct Profiler {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point origin = Clock::now();
  bool tracing = false;
  StepTimeline step;  // the step in progress; what runs between steps counts for the next one
  std::atomic<uint64_t> nvme_read{0}, nvme_write{0};
  // The overlapped update's swap traffic, moved into nvme_read/nvme_write when it is joined (in
  // the next step), so that it counts there however far it got before this step's end.
  std::atomic<uint64_t> update_read{0}, update_write{0};
  std::atomic<uint64_t> checkpoint_wait_ns{0};  // StepTimeline::wait_checkpoint, from any thread
  static inline thread_local bool on_updater = false;
  std::atomic<uint64_t>& read_counter() { return on_updater ? update_read : nvme_read; }
  std::atomic<uint64_t>& write_counter() { return on_updater ? update_write : nvme_write; }
  uint64_t nvme_read_seen = 0, nvme_write_seen = 0;
  std::mutex mu;
  std::vector<TraceSpan> spans;

  double at(Clock::time_point t) const { return std::chrono::duration<double>(t - origin).count(); }
  void span(const char* lane, std::string name, Clock::time_point b, Clock::time_point e) {
    if (!tracing) return;
    std::lock_guard<std::mutex> lock(mu);
    spans.push_back({lane, std::move(name), at(b), at(e)});
  }
  // Adds the time until destruction to `into` and, tracing, a host span named `what` + `unit`.
  struct Timer {
    Profiler& p;
    double& into;
    const char* what;
    const std::string* unit;
    Clock::time_point begin = Clock::now();
    ~Timer() {
      const Clock::time_point end = Clock::now();
      into += std::chrono::duration<double>(end - begin).count();
      if (p.tracing) p.span("host", unit ? std::string(what) + " " + *unit : std::string(what), begin, end);
    }
  };
  Timer time(double& into, const char* what, const std::string* unit = nullptr) {
    return Timer{*this, into, what, unit};
  }
  // The finished step's timeline; the next one starts from zero.
  StepTimeline take_step() {
    const uint64_t r = nvme_read.load(), w = nvme_write.load();
    step.nvme_read_bytes = r - nvme_read_seen;
    step.nvme_write_bytes = w - nvme_write_seen;
    step.wait_checkpoint = double(checkpoint_wait_ns.exchange(0)) * 1e-9;
    nvme_read_seen = r;
    nvme_write_seen = w;
    StepTimeline out = step;
    step = StepTimeline{};
    return out;
  }
};

}  // namespace strata::engine
