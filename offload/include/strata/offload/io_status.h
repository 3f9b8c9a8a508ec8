// Status of one I/O operation, and the exception that carries a failed one.
//
// Every failure names the operation, the file, the offset and length, and the errno text, e.g.
//   "write /nvme0/strata-swap-r00000-d0.bin offset 1048576 length 4096: No space left on device"
// Errors are never swallowed: a failed request completes its future with a non-ok IoStatus, and
// IoFuture::get() turns it into an IoError.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace strata::offload {

class IoStatus {
 public:
  IoStatus() = default;  // ok
  // `error` is a positive errno value (0 means ok); `message` is the full human-readable text.
  IoStatus(int error, std::string message) : error_(error), message_(std::move(message)) {}

  // "<op> <path> offset <offset> length <length>: <strerror(error)>[ (<detail>)]"
  static IoStatus from_errno(int error, const char* op, const std::string& path, uint64_t offset,
                             uint64_t length, const std::string& detail = {});

  bool ok() const { return error_ == 0; }
  int error() const { return error_; }
  const std::string& message() const { return message_; }

  // Transient conditions that the engine itself retries a bounded number of times.
  static bool is_transient(int error);
  // The device or file system is out of space: retrying will not help, nothing was corrupted.
  bool is_no_space() const;

  // Throws IoError when not ok.
  void throw_if_error() const;

 private:
  int error_ = 0;
  std::string message_;
};

class IoError : public std::runtime_error {
 public:
  explicit IoError(const IoStatus& status)
      : std::runtime_error(status.message()), error_(status.error()) {}
  IoError(int error, const std::string& message) : std::runtime_error(message), error_(error) {}
  int error() const { return error_; }

 private:
  int error_;
};

// Throws IoError built from errno for a failed system call on `path` ("open", "fallocate", ...).
[[noreturn]] void throw_errno(int error, const std::string& what, const std::string& path);

}  // namespace strata::offload
