// `strata bench pack` (pack_bench.h).
#include "pack_bench.h"

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <functional>
#include <iostream>
#include <random>
#include <span>
#include <stdexcept>
#include <string>

#include "pack_baseline.h"
#include "strata/models/safetensors.h"
#include "strata/models/token_data.h"
#include "timing.h"

namespace strata::bench {
namespace {

// Chat-like lengths: log-normal around 400 tokens (most conversations short, a long tail), cut to
// [8, capacity].
std::vector<uint64_t> synthetic_lengths(uint64_t n, uint64_t capacity, uint64_t seed) {
  std::mt19937_64 rng(seed + 1);
  std::lognormal_distribution<double> d(std::log(400.0), 1.0);
  std::vector<uint64_t> out(n);
  for (auto& l : out) l = std::clamp<uint64_t>(uint64_t(d(rng)), 8, capacity);
  return out;
}

uint64_t resident_kib() {
  std::ifstream f("/proc/self/status");
  std::string key;
  uint64_t kib = 0;
  while (f >> key) {
    if (key == "VmRSS:") return f >> kib ? kib : 0;
    f.ignore(1 << 20, '\n');
  }
  return 0;
}

struct Side {
  double seconds = 0;
  uint64_t bins = 0, peak_kib = 0, base_kib = 0, fingerprint = 0;
};

using Method = std::function<models::Bins(const std::vector<uint64_t>&, uint64_t, uint64_t)>;

// One method in a child process: the lengths made there, then `rounds` timed runs.
Side measure(const Method& method, uint64_t n, const PackBenchOptions& o) {
  int fd[2];
  if (pipe(fd) != 0) throw std::runtime_error("bench pack: pipe failed");
  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("bench pack: fork failed");
  if (pid == 0) {
    close(fd[0]);
    Side s;
    const std::vector<uint64_t> lengths = synthetic_lengths(n, o.seq_len + 1, o.seed);
    s.base_kib = resident_kib();
    std::vector<double> t;
    for (unsigned r = 0; r < std::max(1u, o.rounds); ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      const models::Bins b = method(lengths, o.seq_len + 1, o.seed);
      t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      uint64_t h = 1469598103934665603ull;  // FNV-1a over the bins
      for (uint64_t v : b.order) h = (h ^ v) * 1099511628211ull;
      for (uint64_t v : b.begin) h = (h ^ v) * 1099511628211ull;
      s.fingerprint = h, s.bins = b.begin.size() - 1;
    }
    s.seconds = median(t);
    rusage ru{};
    getrusage(RUSAGE_SELF, &ru);
    s.peak_kib = uint64_t(ru.ru_maxrss);
    const bool ok = write(fd[1], &s, sizeof s) == ssize_t(sizeof s);
    _exit(ok ? 0 : 1);
  }
  close(fd[1]);
  Side s;
  const ssize_t got = read(fd[0], &s, sizeof s);
  close(fd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (got != ssize_t(sizeof s) || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw std::runtime_error("bench pack: a measuring child failed (out of memory?)");
  return s;
}

double mib(uint64_t kib) { return double(kib) / 1024.0; }

// A file as `strata data prepare --chat` writes it (offsets, tokens, loss_mask), the examples of
// the chat-like lengths, the second half of each in the loss; streamed example by example.
std::filesystem::path write_sft_file(const PackBenchOptions& o) {
  const std::vector<uint64_t> lengths = synthetic_lengths(o.file_examples, 4 * (o.seq_len + 1), o.seed + 7);
  int64_t n = 0;
  for (uint64_t l : lengths) n += int64_t(l);
  const int64_t e = int64_t(lengths.size());
  std::filesystem::create_directories(o.dir);
  const std::filesystem::path path = std::filesystem::path(o.dir) / "synthetic.sft";
  models::SafetensorsWriter out(path,
                                {{"offsets", models::StDType::kI64, {e + 1}},
                                 {"tokens", models::StDType::kI32, {n}},
                                 {"loss_mask", models::StDType::kU8, {n}}},
                                {{"format", "strata-sft-1"}, {"examples", std::to_string(e)}});
  const auto bytes = [](const auto& v) { return std::as_bytes(std::span(v.data(), v.size())); };
  std::vector<int64_t> offsets = {0};
  for (uint64_t l : lengths) offsets.push_back(offsets.back() + int64_t(l));
  out.append(bytes(offsets));
  std::vector<int32_t> ids;
  for (uint64_t l : lengths) {
    ids.resize(l);
    for (uint64_t j = 0; j < l; ++j) ids[j] = int32_t((j * 7 + l) % 1000);
    out.append(bytes(ids));
  }
  std::vector<uint8_t> mask;
  for (uint64_t l : lengths) {
    mask.assign(l, 0);
    std::fill(mask.begin() + int64_t(l / 2), mask.end(), uint8_t(1));
    out.append(bytes(mask));
  }
  out.finish();
  return path;
}

// SftExamples + PackedExamples over the file in a child: seconds, windows, peak above the start.
Side load_and_pack(const std::filesystem::path& path, const PackBenchOptions& o) {
  PackBenchOptions one = o;
  one.rounds = 1;
  return measure(
      [&](const std::vector<uint64_t>&, uint64_t, uint64_t) {
        auto sft = std::make_shared<const models::SftExamples>(path, o.seq_len, 0, 0);
        const models::PackedExamples packed(sft, o.seed);
        models::Bins b;
        b.begin.resize(packed.size() + 1);  // the windows' count is what the fingerprint needs
        return b;
      },
      0, one);
}

}  // namespace

void run_pack_bench(const PackBenchOptions& o) {
  if (o.examples.empty()) throw std::invalid_argument("bench pack: no example counts");
  std::printf("packing synthetic chat lengths (log-normal around 400 tokens) into windows of %llu tokens, "
              "median of %u runs, each method in its own process\n",
              (unsigned long long)(o.seq_len + 1), std::max(1u, o.rounds));
  Side first_new, first_old;
  for (size_t k = 0; k < o.examples.size(); ++k) {
    const uint64_t n = o.examples[k];
    const Side now = measure(models::best_fit_decreasing, n, o);
    const Side before = measure(best_fit_decreasing_multimap, n, o);
    std::printf("%llu examples -> %llu windows: best fit decreasing %.3f s, peak %.0f MiB above the lengths' %.0f; "
                "previous (multimap) %.3f s, peak %.0f MiB above; same windows: %s\n",
                (unsigned long long)n, (unsigned long long)now.bins, now.seconds, mib(now.peak_kib - now.base_kib),
                mib(now.base_kib), before.seconds, mib(before.peak_kib - before.base_kib),
                now.fingerprint == before.fingerprint && now.bins == before.bins ? "yes" : "NO");
    std::fflush(stdout);
    if (now.fingerprint != before.fingerprint || now.bins != before.bins)
      throw std::runtime_error("bench pack: the two methods packed " + std::to_string(n) + " examples differently");
    if (k == 0) first_new = now, first_old = before;
  }
  std::string file_fields;
  if (o.file_examples > 0) {
    const std::filesystem::path path = write_sft_file(o);
    const double file_mib = double(std::filesystem::file_size(path)) / (1 << 20);
    const Side s = load_and_pack(path, o);
    std::printf("a file of %llu examples (%.0f MiB, examples up to %llu tokens): loaded and packed as strata train "
                "does in %.2f s, peak %.0f MiB above the process's start (the file is not held)\n",
                (unsigned long long)o.file_examples, file_mib, (unsigned long long)(4 * (o.seq_len + 1)), s.seconds,
                mib(s.peak_kib - s.base_kib));
    char buf[256];
    std::snprintf(buf, sizeof buf, ", \"file_examples\": %llu, \"file_mib\": %.0f, \"load_pack_seconds\": %.3f, "
                  "\"load_pack_peak_mib\": %.1f", (unsigned long long)o.file_examples, file_mib, s.seconds,
                  mib(s.peak_kib - s.base_kib));
    file_fields = buf;
    std::filesystem::remove(path);
  }
  std::printf("{\"metric\": \"pack_seconds\", \"examples\": %llu, \"value\": %.4f, \"baseline\": \"multimap best fit "
              "decreasing\", \"baseline_value\": %.4f, \"ratio\": %.4f, \"peak_mib\": %.1f, \"baseline_peak_mib\": %.1f%s}\n",
              (unsigned long long)o.examples[0], first_new.seconds, first_old.seconds,
              first_new.seconds / std::max(first_old.seconds, 1e-12), mib(first_new.peak_kib - first_new.base_kib),
              mib(first_old.peak_kib - first_old.base_kib), file_fields.c_str());
}

}  // namespace strata::bench
