// `strata train` and `strata launch`: the training job and the one-node process launcher.
#pragma once

#include <string>
#include <vector>

namespace strata::cli {

int train_main(const std::vector<std::string>& argv);
int launch_main(const std::vector<std::string>& argv);

}  // namespace strata::cli
