// Removing a benchmark's work directories. std::filesystem::remove_all must not be called in
// binaries that link libtorch: libtorch.so carries its own copy of libstdc++'s filesystem library,
// and its remove_all crashes when it interposes ours (docs/ARCHITECTURE.md, Build).
#pragma once

#include <ftw.h>
#include <stdio.h>
#include <unistd.h>

#include <filesystem>
#include <system_error>

namespace strata::bench {

// Removes the files directly in `d`, then `d`; nothing if it does not exist.
inline void remove_flat_dir(const std::filesystem::path& d) {
  std::error_code ec;
  if (!std::filesystem::exists(d, ec)) return;
  for (const auto& e : std::filesystem::directory_iterator(d)) ::unlink(e.path().c_str());
  ::rmdir(d.c_str());
}

// Removes `d` and everything under it (nftw, depth first, links not followed); nothing if it
// does not exist.
inline void remove_tree(const std::filesystem::path& d) {
  ::nftw(d.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { ::remove(p);
    return 0;
  }, 16,
         FTW_DEPTH | FTW_PHYS);
}

}  // namespace strata::bench
