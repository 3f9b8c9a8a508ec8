#include "strata/offload/io_status.h"

#include <cerrno>
#include <cstring>

namespace strata::offload {

IoStatus IoStatus::from_errno(int error, const char* op, const std::string& path, uint64_t offset,
                              uint64_t length, const std::string& detail) {
  std::string msg = std::string(op) + " " + path + " offset " + std::to_string(offset) +
                    " length " + std::to_string(length) + ": " + std::strerror(error);
  if (!detail.empty()) msg += " (" + detail + ")";
  return IoStatus(error, std::move(msg));
}

bool IoStatus::is_transient(int error) { return error == EINTR || error == EAGAIN; }

bool IoStatus::is_no_space() const { return error_ == ENOSPC || error_ == EDQUOT; }

void IoStatus::throw_if_error() const {
  if (!ok()) throw IoError(*this);
}

void throw_errno(int error, const std::string& what, const std::string& path) {
  throw IoError(error, what + " " + path + ": " + std::strerror(error));
}

}  // namespace strata::offload
