#include "tensorboard.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <stdexcept>
#include <system_error>

#include "strata/offload/crc32c.h"

namespace strata::cli {
namespace {

// TFRecord stores CRC32C "masked": a checksum of data that itself contains checksums is easy
// to get wrong, so the stored value is rotated and offset.
uint32_t masked_crc(const std::string& bytes) {
  const uint32_t crc = offload::crc32c(bytes.data(), bytes.size());
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

// Little-endian regardless of the host: the format fixes the byte order.
void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

// --- Protobuf wire format, the three field kinds an Event needs ----------------------------------

void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

void put_key(std::string& out, uint32_t field, WireType type) { put_varint(out, (field << 3) | type); }

void put_bytes(std::string& out, uint32_t field, const std::string& bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out += bytes;
}

void put_double(std::string& out, uint32_t field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_key(out, field, kFixed64);
  put_le(out, bits, 8);
}

void put_float(std::string& out, uint32_t field, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  put_key(out, field, kFixed32);
  put_le(out, bits, 4);
}

// Event { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
std::string event_header(double wall_time, int64_t step) {
  std::string e;
  put_double(e, 1, wall_time);
  put_key(e, 2, kVarint);
  put_varint(e, static_cast<uint64_t>(step));  // int64: negatives as 10-byte two's complement
  return e;
}

std::string hostname() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0 || buf[0] == '\0') return "localhost";
  return buf;
}

std::runtime_error io_error(const std::string& what, const std::filesystem::path& p, int err) {
  return std::runtime_error("tensorboard: cannot " + what + " " + p.string() + ": " + std::strerror(err));
}

}  // namespace

double TensorBoardWriter::now() {
  using namespace std::chrono;
  return duration<double>(system_clock::now().time_since_epoch()).count();
}

TensorBoardWriter::TensorBoardWriter(const std::filesystem::path& log_dir) {
  std::error_code ec;
  std::filesystem::create_directories(log_dir, ec);
  if (ec) throw std::runtime_error("tensorboard: cannot create " + log_dir.string() + ": " + ec.message());
  const double t = now();
  const std::string base = "events.out.tfevents." + std::to_string(static_cast<int64_t>(t)) + "." +
                           hostname() + ".strata";
  // O_EXCL: two writers started in the same second must not share (and corrupt) one file.
  for (int n = 0; fd_ < 0; ++n) {
    path_ = log_dir / (n == 0 ? base : base + "." + std::to_string(n));
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ < 0 && (errno != EEXIST || n >= 1000)) throw io_error("create", path_, errno);
  }
  std::string first = event_header(t, 0);
  put_bytes(first, 3, "brain.Event:2");
  write_record(first);
}

TensorBoardWriter::~TensorBoardWriter() {
  if (fd_ >= 0) ::close(fd_);
}

void TensorBoardWriter::scalar(const std::string& tag, int64_t step, double value, double wall_time) {
  std::string v;  // Summary.Value { string tag = 1; float simple_value = 2; }
  put_bytes(v, 1, tag);
  put_float(v, 2, static_cast<float>(value));
  std::string summary;  // Summary { repeated Value value = 1; }
  put_bytes(summary, 1, v);
  std::string e = event_header(wall_time, step);
  put_bytes(e, 5, summary);
  write_record(e);
}

void TensorBoardWriter::histogram(const std::string& tag, int64_t step, const std::vector<double>& values,
                                  int buckets, double wall_time) {
  if (values.empty()) throw std::invalid_argument("tensorboard: histogram " + tag + " of no values");
  const auto [lo, hi] = std::minmax_element(values.begin(), values.end());
  const double min = *lo, max = *hi;
  const int n = max > min ? std::max(buckets, 1) : 1;
  std::vector<double> counts(size_t(n), 0.0);
  double sum = 0, squares = 0;
  for (double x : values) {
    sum += x;
    squares += x * x;
    const int b = max > min ? std::min(n - 1, int((x - min) / (max - min) * n)) : 0;
    counts[size_t(b)] += 1;
  }
  // HistogramProto { double min = 1; max = 2; num = 3; sum = 4; sum_squares = 5;
  //                  repeated double bucket_limit = 6 [packed]; repeated double bucket = 7 [packed]; }
  std::string h, limits, bucket;
  put_double(h, 1, min);
  put_double(h, 2, max);
  put_double(h, 3, double(values.size()));
  put_double(h, 4, sum);
  put_double(h, 5, squares);
  for (int b = 0; b < n; ++b) {
    const double limit = b == n - 1 ? max : min + (max - min) * double(b + 1) / double(n);
    uint64_t bits;
    std::memcpy(&bits, &limit, sizeof bits);
    put_le(limits, bits, 8);
    std::memcpy(&bits, &counts[size_t(b)], sizeof bits);
    put_le(bucket, bits, 8);
  }
  put_bytes(h, 6, limits);
  put_bytes(h, 7, bucket);
  std::string v;  // Summary.Value { string tag = 1; HistogramProto histo = 5; }
  put_bytes(v, 1, tag);
  put_bytes(v, 5, h);
  std::string summary;
  put_bytes(summary, 1, v);
  std::string e = event_header(wall_time, step);
  put_bytes(e, 5, summary);
  write_record(e);
}

void TensorBoardWriter::flush() {
  if (::fsync(fd_) != 0) throw io_error("fsync", path_, errno);
}

void TensorBoardWriter::write_record(const std::string& event) {
  // uint64 length, masked CRC of those 8 bytes, the data, masked CRC of the data; built whole so
  // one write(2) (normally) puts the complete record in the page cache.
  std::string len;
  put_le(len, event.size(), 8);
  std::string rec = len;
  put_le(rec, masked_crc(len), 4);
  rec += event;
  put_le(rec, masked_crc(event), 4);
  size_t done = 0;
  while (done < rec.size()) {
    const ssize_t n = ::write(fd_, rec.data() + done, rec.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) throw io_error("write", path_, n < 0 ? errno : EIO);
    done += static_cast<size_t>(n);
  }
}

}  // namespace strata::cli
