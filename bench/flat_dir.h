// Removing a benchmark's flat work directory. std::filesystem::remove_all must not be called in
// binaries that link libtorch: libtorch.so carries its own copy of libstdc++'s filesystem library,
// and its remove_all crashes when it interposes ours (docs/ARCHITECTURE.md, Build).
#pragma once

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

}  // namespace strata::bench
