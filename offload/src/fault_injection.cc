#include "strata/offload/fault_injection.h"

namespace strata::offload {

void RuleFaultInjector::add(Rule rule) {
  std::lock_guard lock(mu_);
  rules_.push_back(std::move(rule));
}

uint64_t RuleFaultInjector::fired() const {
  std::lock_guard lock(mu_);
  return fired_;
}

int64_t RuleFaultInjector::on_complete(const IoOpView& op, int64_t result) {
  std::lock_guard lock(mu_);
  for (Rule& r : rules_) {
    if (r.uses == 0) continue;
    if (r.kind && *r.kind != op.kind) continue;
    if (!r.path_contains.empty() && op.path.find(r.path_contains) == std::string::npos) continue;
    if (op.offset + op.length <= r.offset_begin || op.offset >= r.offset_end) continue;
    if (r.error == 0 && (result <= r.short_by || r.short_by <= 0)) continue;  // cannot shorten
    if (r.uses > 0) --r.uses;
    ++fired_;
    return r.error != 0 ? -static_cast<int64_t>(r.error) : result - r.short_by;
  }
  return result;
}

}  // namespace strata::offload
