// TensorBoardWriter against TensorBoard's own reader, and `strata plot` against Pillow
// (tests/cli/py; both skip where STRATA_PYTHON is not configured), plus their errors.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>

#include <cmath>
#include <cstdio>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "plot.h"
#include "tensorboard.h"
#include "test_util.h"

namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using strata::cli::TensorBoardWriter;

const std::string kPython = STRATA_PYTHON;
const std::string kPyDir = STRATA_TEST_PY_DIR;

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void spit(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << text;
  ASSERT_TRUE(out.good()) << p;
}

// Runs a Python oracle with its output in `log`; returns its exit status.
int run_py(const std::string& script, const std::string& args, const fs::path& log) {
  const std::string cmd = kPython + " " + kPyDir + "/" + script + " " + args + " >" + log.string() + " 2>&1";
  return std::system(cmd.c_str());
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "(no exception)";
}

std::vector<fs::path> event_files(const fs::path& dir) {
  std::vector<fs::path> v;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) v.push_back(e.path());
  return v;
}

// Writes the awkward points to a writer in `dir` and their description for tb_check.py to
// `expected`; returns the writer, still open.
std::unique_ptr<TensorBoardWriter> write_awkward_scalars(const fs::path& dir, const fs::path& expected) {
  auto w = std::make_unique<TensorBoardWriter>(dir);
  json points = json::array();
  double wall = 1.7e9 + 0.123456789;
  auto add = [&](const std::string& tag, int64_t step, double value) {
    wall += 0.015625;
    w->scalar(tag, step, value, wall);
    char text[64];
    std::snprintf(text, sizeof text, "%.17g", value);  // JSON has no nan or inf: as text
    points.push_back({{"tag", tag}, {"step", step}, {"value", text}, {"wall_time", wall}});
  };
  // A negative step takes the 10-byte varint; EventAccumulator discards it (it is below the
  // file-version event's step 0), so tb_check.py checks it through the record reader only.
  add("negative step", -5, 1.0);
  const double values[] = {-3.5, 1e-8, 1e-40, 0.1, -0.0, 123456789.123, 3.3e38, 1e39,
                           -std::numeric_limits<double>::infinity(), std::nan("")};
  const int64_t steps[] = {0, 1, 7, int64_t{1} << 31, int64_t{1} << 33, int64_t{1} << 62,
                           std::numeric_limits<int64_t>::max()};
  std::vector<std::string> tags = {"loss", "train/lr", "weird tag: \xce\xbb/\xc2\xb5 (x)"};
  for (int i = 0; i < 47; ++i) tags.push_back("many/tag_" + std::to_string(i));
  // Steps in order across all tags: EventAccumulator takes a step below the last as a restart.
  for (size_t s = 0; s < std::size(steps); ++s)
    for (size_t t = 0; t < tags.size(); ++t) add(tags[t], steps[s], values[(s * 7 + t) % std::size(values)]);
  std::ofstream(expected) << json{{"points", points}}.dump();
  return w;
}

TEST(TensorBoardWriter, ScalarsReadBackWithTensorBoardWhileTheWriterIsOpen) {
  if (kPython.empty()) GTEST_SKIP() << "no Python with tensorboard configured (STRATA_PYTHON)";
  strata::test::TempDir tmp;
  const fs::path dir = tmp / "runs" / "a";  // created by the writer, parents included
  auto w = write_awkward_scalars(dir, tmp / "expected.json");
  ASSERT_EQ(event_files(dir).size(), 1u);
  EXPECT_EQ(event_files(dir)[0], w->path());
  EXPECT_NE(w->path().filename().string().find(".strata"), std::string::npos);
  // No flush and no destructor yet: every point must already be in the file.
  EXPECT_EQ(run_py("tb_check.py", dir.string() + " " + (tmp / "expected.json").string(), tmp / "check.log"), 0)
      << slurp(tmp / "check.log");
  w->flush();
  w.reset();
  EXPECT_EQ(run_py("tb_check.py", dir.string() + " " + (tmp / "expected.json").string(), tmp / "check.log"), 0)
      << slurp(tmp / "check.log");
}

// Histograms (a mixture of experts' shares per expert): TensorBoard reads each back with its
// statistics and buckets; a single value (every expert equally chosen) is one bucket.
TEST(TensorBoardWriter, HistogramsReadBackWithTensorBoard) {
  if (kPython.empty()) GTEST_SKIP() << "no Python with tensorboard configured (STRATA_PYTHON)";
  strata::test::TempDir tmp;
  const fs::path dir = tmp / "tb";
  json want = json::array();
  {
    TensorBoardWriter w(dir);
    const std::vector<std::vector<double>> sets = {{0.1, 0.25, 0.25, 0.4, 0.0}, {0.2, 0.2, 0.2}, {1, 7, 3, 3, 5, 2.5, 6.25}};
    for (size_t i = 0; i < sets.size(); ++i) {
      const int buckets = i == 2 ? 4 : 16;
      w.histogram("experts/share.sparse_block_0", int64_t(i + 1), sets[i], buckets);
      want.push_back({{"tag", "experts/share.sparse_block_0"}, {"step", i + 1}, {"values", sets[i]}, {"buckets", buckets}});
    }
    EXPECT_THROW(w.histogram("empty", 9, {}), std::invalid_argument);
  }
  std::ofstream(tmp / "expected.json") << json{{"histograms", want}}.dump();
  EXPECT_EQ(run_py("tb_histogram_check.py", dir.string() + " " + (tmp / "expected.json").string(), tmp / "check.log"), 0)
      << slurp(tmp / "check.log");
}

// The oracle itself: one flipped data byte must fail TensorBoard's CRC check.
TEST(TensorBoardWriter, CheckerRejectsACorruptedRecord) {
  if (kPython.empty()) GTEST_SKIP() << "no Python with tensorboard configured (STRATA_PYTHON)";
  strata::test::TempDir tmp;
  const fs::path file = write_awkward_scalars(tmp / "tb", tmp / "expected.json")->path();
  std::string bytes = slurp(file);
  bytes[bytes.size() - 10] ^= 0x01;  // inside the last record's data
  spit(file, bytes);
  EXPECT_NE(run_py("tb_check.py", (tmp / "tb").string() + " " + (tmp / "expected.json").string(), tmp / "check.log"), 0);
  EXPECT_NE(slurp(tmp / "check.log").find("crc32"), std::string::npos) << slurp(tmp / "check.log");
}

TEST(TensorBoardWriter, DefaultWallTimeIsNow) {
  const double t = TensorBoardWriter::now();
  EXPECT_NEAR(t, static_cast<double>(std::time(nullptr)), 2.0);
}

TEST(TensorBoardWriter, TwoWritersInOneDirectoryGetTwoFiles) {
  strata::test::TempDir tmp;
  TensorBoardWriter a(tmp.path()), b(tmp.path());
  EXPECT_NE(a.path(), b.path());
  EXPECT_EQ(event_files(tmp.path()).size(), 2u);
}

TEST(TensorBoardWriter, UncreatableDirectoryIsAnErrorNamingIt) {
  strata::test::TempDir tmp;
  spit(tmp / "file", "x");
  const std::string msg = error_of([&] { TensorBoardWriter w(tmp / "file" / "runs"); });
  EXPECT_NE(msg.find((tmp / "file" / "runs").string()), std::string::npos) << msg;
}

// A write the file system refuses (here: past RLIMIT_FSIZE, EFBIG) throws naming the file.
TEST(TensorBoardWriter, FailedWriteIsAnErrorNamingTheFile) {
  strata::test::TempDir tmp;
  auto w = std::make_unique<TensorBoardWriter>(tmp.path());
  struct rlimit old;
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  auto old_handler = signal(SIGXFSZ, SIG_IGN);  // else the process is killed
  struct rlimit small = old;
  small.rlim_cur = 4096;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string msg = "(no exception)";
  try {
    for (int i = 0; i < 1000; ++i) w->scalar("loss", i, 1.0 / (i + 1));
  } catch (const std::runtime_error& e) {
    msg = e.what();
  }
  setrlimit(RLIMIT_FSIZE, &old);
  signal(SIGXFSZ, old_handler);
  EXPECT_NE(msg.find(w->path().string()), std::string::npos) << msg;
  EXPECT_NE(msg.find("too large"), std::string::npos) << msg;
}

// --- plot ------------------------------------------------------------------------------------

// A run of 60 steps, resumed from step 40 and run to 100: steps 41-60 appear twice and the
// second values (loss + 100, recognisable) must win. Eval every 10 steps, 50 twice.
std::string synthetic_log() {
  std::ostringstream s;
  auto step = [&](int n, double loss, bool skipped = false) {
    const double lr = n < 10 ? 3e-4 * n / 10 : 3e-4 * (0.1 + 0.9 * 0.5 * (1 + std::cos(M_PI * (n - 10) / 90.0)));
    json j = {{"step", n}, {"optimizer_step", n}, {"loss", loss}, {"lr", lr}, {"skipped", skipped},
              {"tokens_per_s", 50000 + 3000 * std::sin(n * 0.7)},
              {"device_peak", 20.5 * (1ull << 30) + n * 1e6}, {"host_state", 42.0 * (1ull << 30)},
              {"nvme_state", n < 50 ? 0.0 : 96.0 * (1ull << 30)}, {"timeline", {{"norm", 0.1}}}};
    if (std::isnan(loss)) j["loss"] = nullptr;  // how nlohmann::json writes NaN
    s << j.dump() << "\n";
  };
  s << R"({"event":"start","model":"tiny","lr_schedule":{"lr":0.0003}})" << "\n";
  for (int n = 1; n <= 60; ++n) {
    step(n, 10.0 * std::exp(-n / 30.0) + 2);
    if (n % 10 == 0) s << json{{"event", "eval"}, {"step", n}, {"eval_loss", 10.0 * std::exp(-n / 30.0) + 2.3}}.dump() << "\n";
  }
  s << "\n" << R"({"event":"start","model":"tiny","resumed_from":40})" << "\n";
  for (int n = 41; n <= 100; ++n) {
    step(n, n == 70 ? std::nan("") : 100 + 10.0 * std::exp(-n / 30.0) + 2, n == 45);
    if (n % 10 == 0) s << json{{"event", "eval"}, {"step", n}, {"eval_loss", 100 + 2.5}}.dump() << "\n";
  }
  s << R"({"event":"checkpoint","step":100})" << "\n";
  return s.str();
}

TEST(Plot, ReadsAResumedRunLaterLinesWinning) {
  strata::test::TempDir tmp;
  spit(tmp / "run.jsonl", synthetic_log());
  const auto log = strata::cli::read_training_log(tmp / "run.jsonl");
  EXPECT_EQ(log.starts, 2);
  ASSERT_EQ(log.steps.size(), 100u);
  EXPECT_EQ(log.steps.begin()->first, 1);
  EXPECT_EQ(log.steps.rbegin()->first, 100);
  EXPECT_DOUBLE_EQ(log.steps.at(40).loss, 10.0 * std::exp(-40 / 30.0) + 2);        // first run only
  EXPECT_DOUBLE_EQ(log.steps.at(41).loss, 100 + 10.0 * std::exp(-41 / 30.0) + 2);  // resumed run
  EXPECT_DOUBLE_EQ(log.steps.at(60).loss, 100 + 10.0 * std::exp(-60 / 30.0) + 2);
  EXPECT_TRUE(std::isnan(log.steps.at(70).loss));
  EXPECT_TRUE(log.steps.at(45).skipped);
  EXPECT_FALSE(log.steps.at(44).skipped);
  EXPECT_DOUBLE_EQ(log.steps.at(99).nvme_state, 96.0 * (1ull << 30));
  ASSERT_EQ(log.eval_loss.size(), 10u);
  EXPECT_DOUBLE_EQ(log.eval_loss.at(40), 10.0 * std::exp(-40 / 30.0) + 2.3);
  EXPECT_DOUBLE_EQ(log.eval_loss.at(50), 102.5);
}

TEST(Plot, DrawsFourPanels) {
  strata::test::TempDir tmp;
  spit(tmp / "run.jsonl", synthetic_log());
  const fs::path png = tmp / "run.png";
  testing::internal::CaptureStderr();
  const int rc = strata::cli::plot_main({(tmp / "run.jsonl").string(), "-o", png.string()});
  const std::string err = testing::internal::GetCapturedStderr();
  ASSERT_EQ(rc, 0) << err;
  EXPECT_EQ(err, "strata plot: wrote " + png.string() + " (100 steps, 10 eval points)\n");
  ASSERT_TRUE(fs::exists(png));
  if (kPython.empty()) GTEST_SKIP() << "no Python with Pillow configured (STRATA_PYTHON)";
  EXPECT_EQ(run_py("plot_check.py",
                   png.string() + " " + std::to_string(strata::cli::kPlotWidth) + " " +
                       std::to_string(strata::cli::kPlotHeight),
                   tmp / "check.log"),
            0)
      << slurp(tmp / "check.log");
}

// One step, no eval, every memory tier 0, lr absent: still a picture, no division by zero.
TEST(Plot, DrawsASingleStep) {
  strata::test::TempDir tmp;
  spit(tmp / "one.jsonl", R"({"step":1,"loss":3.5,"tokens_per_s":1000,"device_peak":0,"host_state":0,"nvme_state":0})"
                          "\n");
  strata::cli::plot_training_log(tmp / "one.jsonl", tmp / "one.png");
  const std::string png = slurp(tmp / "one.png");
  ASSERT_GT(png.size(), 8u);
  EXPECT_EQ(png.substr(1, 3), "PNG");
}

TEST(Plot, Errors) {
  strata::test::TempDir tmp;
  using strata::cli::plot_training_log;
  const fs::path out = tmp / "out.png";
  auto contains = [](const std::string& msg, const std::string& part) {
    return msg.find(part) != std::string::npos;
  };

  std::string msg = error_of([&] { plot_training_log(tmp / "absent.jsonl", out); });
  EXPECT_TRUE(contains(msg, (tmp / "absent.jsonl").string())) << msg;

  msg = error_of([&] { plot_training_log(tmp.path(), out); });  // a directory
  EXPECT_TRUE(contains(msg, tmp.path().string())) << msg;

  spit(tmp / "nosteps.jsonl", "{\"event\":\"start\"}\n{\"event\":\"eval\",\"step\":3,\"eval_loss\":2.0}\n");
  msg = error_of([&] { plot_training_log(tmp / "nosteps.jsonl", out); });
  EXPECT_TRUE(contains(msg, (tmp / "nosteps.jsonl").string()) && contains(msg, "no step lines")) << msg;

  spit(tmp / "empty.jsonl", "");
  msg = error_of([&] { plot_training_log(tmp / "empty.jsonl", out); });
  EXPECT_TRUE(contains(msg, "no step lines")) << msg;

  const std::string good = "{\"step\":1,\"loss\":2.0}\n";
  const struct {
    std::string text, line;
  } bad[] = {
      {"{\"event\":\"start\"}\n" + good + "{\"step\":2,\"loss\":2.\n", ":3:"},   // cut short
      {good + "\n\n{\"step\":2,\"loss\":\"high\"}\n", ":4:"},                 // blank lines count
      {good + "[1,2]\n", ":2:"},                                             // not an object
      {good + "{\"step\":2.5,\"loss\":1}\n", ":2:"},                          // step not an integer
      {good + "{\"loss\":1}\n", ":2:"},                                       // neither step nor event
      {good + "{\"event\":\"eval\",\"eval_loss\":1}\n", ":2:"},               // eval without step
      {good + "{\"step\":2,\"skipped\":\"no\"}\n", ":2:"},
  };
  for (const auto& b : bad) {
    spit(tmp / "bad.jsonl", b.text);
    msg = error_of([&] { plot_training_log(tmp / "bad.jsonl", out); });
    EXPECT_TRUE(contains(msg, (tmp / "bad.jsonl").string() + b.line)) << msg << "\nfor:\n" << b.text;
  }
  EXPECT_FALSE(fs::exists(out));

  spit(tmp / "good.jsonl", good);
  msg = error_of([&] { plot_training_log(tmp / "good.jsonl", tmp / "no" / "such" / "dir.png"); });
  EXPECT_TRUE(contains(msg, (tmp / "no" / "such" / "dir.png").string())) << msg;
}

// Writes that fail part way (here: past RLIMIT_FSIZE, EFBIG) are an error naming the output,
// and the plot drawn before is left whole, with no temporary file beside it.
TEST(Plot, FailedWriteKeepsThePreviousPlot) {
  strata::test::TempDir tmp;
  spit(tmp / "run.jsonl", synthetic_log());
  const fs::path png = tmp / "run.png";
  strata::cli::plot_training_log(tmp / "run.jsonl", png);
  const std::string before = slurp(png);
  ASSERT_GT(before.size(), 4096u);
  struct rlimit old;
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  auto old_handler = signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old;
  small.rlim_cur = 4096;
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  const std::string msg = error_of([&] { strata::cli::plot_training_log(tmp / "run.jsonl", png); });
  setrlimit(RLIMIT_FSIZE, &old);
  signal(SIGXFSZ, old_handler);
  EXPECT_NE(msg.find("cannot write " + png.string() + ": File too large"), std::string::npos) << msg;
  EXPECT_EQ(slurp(png), before);
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(tmp.path())) files += e.is_regular_file();
  EXPECT_EQ(files, 2u);  // run.jsonl and run.png
}

// A FIFO (like /dev/stdout piped on) is written in place, not replaced by a regular file.
TEST(Plot, WritesIntoAPipeInPlace) {
  strata::test::TempDir tmp;
  spit(tmp / "good.jsonl", "{\"step\":1,\"loss\":2.0}\n");
  const fs::path fifo = tmp / "pipe";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  std::string got;
  std::thread reader([&] { got = slurp(fifo); });
  try {
    strata::cli::plot_training_log(tmp / "good.jsonl", fifo);
  } catch (...) {
    std::ofstream{fifo};  // lets the reader's open return
    reader.join();
    throw;
  }
  reader.join();
  EXPECT_TRUE(fs::is_fifo(fifo));
  ASSERT_GT(got.size(), 8u);
  EXPECT_EQ(got.substr(0, 8), "\x89PNG\r\n\x1a\n");
}

TEST(Plot, CommandLine) {
  strata::test::TempDir tmp;
  using strata::cli::plot_main;
  spit(tmp / "good.jsonl", "{\"step\":1,\"loss\":2.0}\n");
  const std::string log = (tmp / "good.jsonl").string(), out = (tmp / "o.png").string();
  testing::internal::CaptureStderr();
  EXPECT_EQ(plot_main({}), 2);
  EXPECT_EQ(plot_main({log}), 2);                       // no -o
  EXPECT_EQ(plot_main({log, "-o"}), 2);                 // -o without a value
  EXPECT_EQ(plot_main({log, "-o", out, "--dpi", "3"}), 2);
  EXPECT_EQ(plot_main({log, log, "-o", out}), 2);
  EXPECT_EQ(plot_main({(tmp / "absent.jsonl").string(), "-o", out}), 1);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("usage: strata plot LOG.jsonl -o OUT.png"), std::string::npos) << err;
  EXPECT_NE(err.find("unknown option --dpi"), std::string::npos) << err;
  EXPECT_NE(err.find("absent.jsonl"), std::string::npos) << err;
  EXPECT_FALSE(fs::exists(out));
  testing::internal::CaptureStderr();
  EXPECT_EQ(plot_main({"--output=" + out, log}), 0);
  testing::internal::GetCapturedStderr();
  EXPECT_TRUE(fs::exists(out));
}

}  // namespace
