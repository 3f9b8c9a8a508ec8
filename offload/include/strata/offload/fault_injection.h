// Fault injection for tests: makes an I/O engine see errors, short transfers and transient
// failures exactly where a test wants them, on either backend.
//
// The engine consults its FaultInjector on every completed kernel operation, before its own
// handling (resubmit, retry, error). Replacing the result there exercises the real recovery
// paths: a result shortened to k bytes is continued from byte k, -EAGAIN is retried, -ENOSPC
// fails the request with the documented message. The operation itself did run, so an injected
// error on a write leaves that write's own range with unspecified content; other ranges are
// never touched.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "strata/offload/io_engine.h"

namespace strata::offload {

struct IoOpView {
  IoRequest::Kind kind;
  const std::string& path;
  uint64_t offset;  // file offset of this operation
  uint64_t length;  // bytes this operation asked for
  bool direct;      // went through the O_DIRECT descriptor
};

class FaultInjector {
 public:
  virtual ~FaultInjector() = default;
  // `result` is bytes transferred or -errno; returns what the engine should see instead.
  // Called from completion threads: must be thread safe.
  virtual int64_t on_complete(const IoOpView& op, int64_t result) = 0;
};

// A list of rules; the first matching rule with uses left applies. Thread safe.
class RuleFaultInjector final : public FaultInjector {
 public:
  struct Rule {
    std::optional<IoRequest::Kind> kind;  // any if unset
    std::string path_contains;            // any if empty
    uint64_t offset_begin = 0;            // the operation must overlap [begin, end)
    uint64_t offset_end = UINT64_MAX;
    int error = 0;             // inject -error (e.g. ENOSPC, EIO, EAGAIN) ...
    int64_t short_by = 0;      // ... or shorten a successful transfer by this many bytes
    int64_t uses = 1;          // how many matching operations it applies to (-1: forever)
  };

  void add(Rule rule);
  // How many times rules fired so far.
  uint64_t fired() const;

  int64_t on_complete(const IoOpView& op, int64_t result) override;

 private:
  mutable std::mutex mu_;
  std::vector<Rule> rules_;
  uint64_t fired_ = 0;
};

}  // namespace strata::offload
