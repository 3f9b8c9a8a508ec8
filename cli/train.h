// `strata train` and `strata launch`: the training job and the one-node process launcher.
#pragma once

#include <string>
#include <vector>

namespace strata::cli {

int train_main(const std::vector<std::string>& argv);
int launch_main(const std::vector<std::string>& argv);

// When a rank fails, `strata launch` ends the others with SIGTERM sent by sigqueue carrying this
// tag plus the failed rank: `strata train` then exits at once, naming that rank, instead of
// taking it for a request to stop after the current step (which cannot finish without the
// failed rank).
constexpr int kPeerFailedTag = 0x53540000;  // "ST" in the high half; the rank in the low half

}  // namespace strata::cli
