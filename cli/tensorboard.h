// TensorBoard scalars without TensorFlow or protobuf: one event file per writer, in TensorBoard's
// on-disk format (TFRecord framing around hand-encoded `Event` protobufs), readable by
// `tensorboard --logdir DIR` while the run is still writing it.
//
// Contract
//   - The writer owns its file descriptor; the file is created on construction, never
//     overwritten (an existing name gets a ".1", ".2", ... suffix) and closed by the destructor.
//   - Every scalar() is one write(2) of a complete record: once it returns, the point survives
//     a crash of this process. flush() also fsyncs, for points that must survive the machine.
//   - Errors (cannot create the directory or the file, a failed or short write, a failed fsync)
//     throw std::runtime_error naming the file. After a failed write the file may end in a
//     partial record, which TensorBoard's reader treats as the end of the file.
//   - Not thread safe: one thread writes through one writer (guard it yourself otherwise).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace strata::cli {

class TensorBoardWriter {
 public:
  // Creates `log_dir` (and its parents) if missing and an event file
  // events.out.tfevents.<unix seconds>.<hostname>.strata in it, starting with the file-version
  // record TensorBoard expects.
  explicit TensorBoardWriter(const std::filesystem::path& log_dir);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // Seconds since the Unix epoch, with sub-second precision: TensorBoard's wall_time.
  static double now();

  // One point of the series `tag`. TensorBoard stores scalars as float32: `value` is rounded.
  void scalar(const std::string& tag, int64_t step, double value, double wall_time = now());

  // The distribution of `values` at `step` as a TensorBoard histogram (its HistogramProto: min,
  // max, count, sum, sum of squares, and `buckets` equal-width buckets from min to max, each
  // counting the values up to its limit). Throws std::invalid_argument for no values.
  void histogram(const std::string& tag, int64_t step, const std::vector<double>& values, int buckets = 16,
                 double wall_time = now());

  // Makes everything written so far durable (fsync).
  void flush();

  const std::filesystem::path& path() const { return path_; }

 private:
  void write_record(const std::string& event);

  std::filesystem::path path_;
  int fd_ = -1;
};

}  // namespace strata::cli
