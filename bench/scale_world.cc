// `strata bench scale`, its world-size parts: the engine's collectives and a whole training run
// (steps, a save, a load) as the number of ranks on this machine grows (scale_bench.h).
#include "scale_bench.h"

#include "flat_dir.h"
#include "shell.h"
#include "timing.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <stdexcept>

#include <unistd.h>

#include "strata/engine/comm.h"

namespace strata::bench {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// This process's socket and file writes so far, from /proc/self/io: bytes passed to write(2) and
// writev(2) (Gloo's TCP pairs send with writev) and the number of such calls.
struct WriteCounters {
  uint64_t bytes = 0, calls = 0;
};
WriteCounters write_counters() {
  std::ifstream in("/proc/self/io");
  WriteCounters c;
  std::string key;
  uint64_t v = 0;
  while (in >> key >> v) {
    if (key == "wchar:") c.bytes = v;
    if (key == "syscw:") c.calls = v;
  }
  return c;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// --- collectives ----------------------------------------------------------------------------

struct CollectiveRow {
  int world;
  double ag_seconds, rs_seconds;            // one collective, the slowest rank's mean
  double ag_bytes, rs_bytes, ag_msgs, rs_msgs;  // sent by one rank per collective, the most any rank sent
};

CollectiveRow collectives_at(int world, uint64_t buffer_bytes, int iters) {
  const std::string out = run_capture(self_command() + " launch -n " + std::to_string(world) + " -- " + self_command() +
                                          " bench scale --collective-rank --bytes " + std::to_string(buffer_bytes) +
                                          " --iters " + std::to_string(iters),
                                      "bench scale");
  CollectiveRow row{world, 0, 0, 0, 0, 0, 0};
  std::istringstream lines(out);
  std::string line;
  int ranks = 0;
  while (std::getline(lines, line)) {
    if (line.empty() || line[0] != '{') continue;
    const json j = json::parse(line);
    ++ranks;
    row.ag_seconds = std::max(row.ag_seconds, j["ag_seconds"].get<double>());
    row.rs_seconds = std::max(row.rs_seconds, j["rs_seconds"].get<double>());
    row.ag_bytes = std::max(row.ag_bytes, j["ag_bytes"].get<double>());
    row.rs_bytes = std::max(row.rs_bytes, j["rs_bytes"].get<double>());
    row.ag_msgs = std::max(row.ag_msgs, j["ag_msgs"].get<double>());
    row.rs_msgs = std::max(row.rs_msgs, j["rs_msgs"].get<double>());
  }
  if (ranks != world)
    throw std::runtime_error("bench scale: " + std::to_string(ranks) + " of " + std::to_string(world) +
                             " ranks reported their collectives");
  return row;
}

// --- a training run --------------------------------------------------------------------------

struct RunRow {
  int world;
  double step_seconds;        // median of the steps after the first
  double network_bytes;       // rank 0's collectives a step (the engine's count)
  double save_seconds, load_seconds;
  uint64_t manifest_bytes, index_bytes;  // the save's metadata: the manifest, every rank's index
  uint64_t save_peak_rss, load_peak_rss; // rank 0's process peak in the saving and the loading run
};

json tiny_run_config(int64_t steps) {
  return {{"model", {{"preset", "llama-1b"}, {"layers", 4}, {"hidden", 128}, {"heads", 4}, {"kv_heads", 2},
                     {"intermediate", 352}, {"vocab_size", 512}, {"tie_embeddings", false}, {"seed", 1}}},
          {"data", {{"seq_len", 64}, {"seed", 1}}},
          {"batch", {{"micro_batch", 2}, {"grad_accum", 1}}},
          {"optimizer", {{"lr", 1e-3}}},
          {"run", {{"steps", steps}, {"progress", false}, {"async_checkpoint", false}}}};  // the save's whole time
}

RunRow run_at(int world, const fs::path& root) {
  const fs::path dir = root / ("world-" + std::to_string(world));
  fs::create_directories(dir);
  const std::string launch = self_command() + " launch -n " + std::to_string(world) + " -- " + self_command() + " train";
  std::ofstream(dir / "first.json") << tiny_run_config(5).dump();
  std::ofstream(dir / "second.json") << tiny_run_config(6).dump();
  const std::string ckpt = shell_quote((dir / "ckpt").string());
  run_capture(launch + " --config " + shell_quote((dir / "first.json").string()) + " --log " +
                  shell_quote((dir / "first.jsonl").string()) + " --checkpoint-dir " + ckpt + " 2> " +
                  shell_quote((dir / "first.out").string()),
              "bench scale");
  run_capture(launch + " --config " + shell_quote((dir / "second.json").string()) + " --log " +
                  shell_quote((dir / "second.jsonl").string()) + " --checkpoint-dir " + ckpt + " --resume 2> " +
                  shell_quote((dir / "second.out").string()),
              "bench scale");
  RunRow row{world, 0, 0, 0, 0, 0, 0, 0, 0};
  std::vector<double> steps, net;
  std::istringstream first(slurp(dir / "first.jsonl"));
  std::string line;
  while (std::getline(first, line)) {
    const json j = json::parse(line);
    if (j.contains("event")) continue;
    if (j["step"].get<int>() > 1) steps.push_back(j["seconds"].get<double>());
    net.push_back(j["timeline"]["network_bytes"].get<double>());
    row.save_peak_rss = std::max<uint64_t>(row.save_peak_rss, j["peak_rss"].get<uint64_t>());
  }
  row.step_seconds = median(steps);
  row.network_bytes = median(net);
  const std::string out = slurp(dir / "first.out");
  const size_t blocked = out.find("(training blocked ");
  if (blocked == std::string::npos) throw std::runtime_error("bench scale: the run did not save:\n" + out);
  row.save_seconds = std::stod(out.substr(blocked + 18));
  std::istringstream second(slurp(dir / "second.jsonl"));
  while (std::getline(second, line)) {
    const json j = json::parse(line);
    if (j.contains("event")) row.load_seconds = j["load_seconds"].get<double>();
    else row.load_peak_rss = std::max<uint64_t>(row.load_peak_rss, j["peak_rss"].get<uint64_t>());
  }
  for (const auto& e : fs::directory_iterator(dir / "ckpt" / "step-00000005")) {
    const std::string name = e.path().filename().string();
    if (name == "manifest.json") row.manifest_bytes = e.file_size();
    else if (name.size() > 11 && name.substr(name.size() - 11) == ".index.json") row.index_bytes += e.file_size();
  }
  return row;
}

std::vector<double> column(const std::vector<int>& worlds) { return {worlds.begin(), worlds.end()}; }

}  // namespace

double growth_exponent(const std::vector<double>& x, const std::vector<double>& y) {
  std::vector<std::pair<double, double>> p;
  for (size_t i = 0; i < x.size(); ++i)
    if (x[i] > 1 && y[i] > 0) p.push_back({std::log(x[i]), std::log(y[i])});
  if (p.size() < 2) return std::nan("");
  double mx = 0, my = 0;
  for (auto [a, b] : p) mx += a, my += b;
  mx /= double(p.size()), my /= double(p.size());
  double sxy = 0, sxx = 0;
  for (auto [a, b] : p) sxy += (a - mx) * (b - my), sxx += (a - mx) * (a - mx);
  return sxy / sxx;
}

int collective_rank(uint64_t buffer_bytes, int iters) {
  const engine::DistEnv env = engine::DistEnv::from_env();
  auto comm = engine::Communicator::create(env, std::chrono::seconds(120));
  const int64_t world = comm->world_size();
  const int64_t shard = std::max<int64_t>(1, int64_t(buffer_bytes / 4) / world);
  const at::Tensor whole = at::ones({shard * world}, at::kFloat), part = at::ones({shard}, at::kFloat);
  comm->all_gather(whole, part)->wait();  // warm-up: connections, buffers
  comm->reduce_scatter(part, whole)->wait();
  comm->barrier();
  const WriteCounters c0 = write_counters();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) comm->all_gather(whole, part)->wait();
  const double ag = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const WriteCounters c1 = write_counters();
  comm->barrier();
  const WriteCounters c2 = write_counters();
  t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) comm->reduce_scatter(part, whole)->wait();
  const double rs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const WriteCounters c3 = write_counters();
  std::cout << json{{"rank", comm->rank()},
                    {"ag_seconds", ag / iters},
                    {"rs_seconds", rs / iters},
                    {"ag_bytes", double(c1.bytes - c0.bytes) / iters},
                    {"rs_bytes", double(c3.bytes - c2.bytes) / iters},
                    {"ag_msgs", double(c1.calls - c0.calls) / iters},
                    {"rs_msgs", double(c3.calls - c2.calls) / iters}}
                   .dump()
            << std::endl;
  return 0;
}

void run_world_scaling(const ScaleBenchOptions& o) {
  if (o.worlds.empty()) return;
  const double buffer = double(o.collective_bytes);
  std::printf("the engine's collectives on this machine (Gloo over loopback), a %.0f MiB buffer (all-gather's "
              "output, reduce-scatter's input); what one rank sends per collective, counted by the kernel "
              "(/proc/self/io: bytes and calls of write/writev), the most any rank sent; time the slowest rank's:\n",
              buffer / 1048576.0);
  std::vector<int> coll_worlds;
  for (int w : o.worlds)
    if (w > 1) coll_worlds.push_back(w);
  std::vector<CollectiveRow> coll;
  for (int w : coll_worlds) {
    coll.push_back(collectives_at(w, o.collective_bytes, o.collective_iters));
    const CollectiveRow& r = coll.back();
    const double ideal = buffer * double(w - 1) / double(w);
    std::printf("  %3d ranks: all-gather %7.3f s, sends %6.2f MiB (%.3f of (w-1)/w of the buffer) in %6.0f "
                "writes; reduce-scatter %7.3f s, sends %6.2f MiB (%.3f) in %6.0f writes\n",
                w, r.ag_seconds, r.ag_bytes / 1048576.0, r.ag_bytes / ideal, r.ag_msgs, r.rs_seconds,
                r.rs_bytes / 1048576.0, r.rs_bytes / ideal, r.rs_msgs);
  }
  std::vector<double> ag_msgs, rs_msgs, ag_s, rs_s;
  for (const CollectiveRow& r : coll)
    ag_msgs.push_back(r.ag_msgs), rs_msgs.push_back(r.rs_msgs), ag_s.push_back(r.ag_seconds), rs_s.push_back(r.rs_seconds);
  std::printf("  growth exponents against the world size: all-gather writes %.2f, seconds %.2f; reduce-scatter "
              "writes %.2f, seconds %.2f\n",
              growth_exponent(column(coll_worlds), ag_msgs), growth_exponent(column(coll_worlds), ag_s),
              growth_exponent(column(coll_worlds), rs_msgs), growth_exponent(column(coll_worlds), rs_s));

  std::printf("a training run at each world size on this machine (tiny Llama, 2 sequences of 64 tokens a rank "
              "a step, 5 steps, a save, a resume for one more step; every rank shares this machine's cores):\n");
  const fs::path root = o.dir / "runs";
  std::vector<RunRow> runs;
  for (int w : o.worlds) {
    runs.push_back(run_at(w, root));
    const RunRow& r = runs.back();
    std::printf("  %3d ranks: step %.3f s, rank 0's collectives %.2f MB a step; save %.3f s, metadata %.1f KB "
                "(manifest %.1f KB + indexes %.1f KB); load %.3f s; rank 0's peak RSS %.0f MiB saving, %.0f MiB "
                "loading\n",
                w, r.step_seconds, r.network_bytes / 1e6, r.save_seconds, (r.manifest_bytes + r.index_bytes) / 1e3,
                r.manifest_bytes / 1e3, r.index_bytes / 1e3, r.load_seconds, r.save_peak_rss / 1048576.0,
                r.load_peak_rss / 1048576.0);
  }
  std::vector<double> step, save, load, meta, manifest, net;
  for (const RunRow& r : runs) {
    step.push_back(r.step_seconds), save.push_back(r.save_seconds), load.push_back(r.load_seconds);
    meta.push_back(double(r.manifest_bytes + r.index_bytes)), manifest.push_back(double(r.manifest_bytes));
    net.push_back(r.network_bytes);
  }
  const std::vector<double> x = column(o.worlds);
  std::printf("  growth exponents against the world size (2 ranks up): step %.2f, save %.2f, load %.2f, "
              "collective bytes a rank %.2f, manifest %.2f, whole metadata %.2f\n",
              growth_exponent(x, step), growth_exponent(x, save), growth_exponent(x, load), growth_exponent(x, net),
              growth_exponent(x, manifest), growth_exponent(x, meta));
  remove_tree(root);
}

json run_many_rank_tests(const ScaleBenchOptions& o) {
  if (o.many_rank_tests == "off" || (o.worlds.empty() && o.many_rank_tests == "auto")) return nullptr;
  const fs::path self = fs::read_symlink("/proc/self/exe");
  const fs::path binary = o.many_rank_tests == "auto" ? self.parent_path() / "tests" / "many_ranks_tests"
                                                      : fs::path(o.many_rank_tests);
  if (!fs::exists(binary)) {
    if (o.many_rank_tests != "auto") throw std::invalid_argument("bench scale: no test binary " + binary.string());
    std::printf("the 32-rank tests: skipped (no %s beside this strata: build the tests, or pass "
                "--many-rank-tests PATH)\n", binary.c_str());
    return nullptr;
  }
  std::printf("the many-rank tests at 32 ranks (%s --gtest_filter='Ranks32.*'; 32 processes of one thread, Gloo "
              "over loopback):\n", binary.c_str());
  std::fflush(stdout);
  const fs::path report = fs::temp_directory_path() / ("strata-ranks32-" + std::to_string(::getpid()) + ".json");
  // As ctest runs them: the same time limit (1800 s), temporary directories where it puts them
  // when STRATA_TEST_DIR is set.
  const std::string command = "timeout 1800 " + shell_quote(binary.string()) +
                              " --gtest_filter='Ranks32.*' --gtest_output=json:" + shell_quote(report.string()) +
                              " > /dev/null 2>&1";
  const auto t0 = std::chrono::steady_clock::now();
  const int status = std::system(command.c_str());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  json result = {{"passed", 0}, {"failed", 0}, {"seconds", seconds}};
  std::ifstream in(report);
  if (!in) {
    std::printf("  the test binary wrote no report (exit status %d): counted as one failure\n", status);
    result["failed"] = 1;
    return result;
  }
  json r;
  try {
    r = json::parse(in);
  } catch (const std::exception& e) {
    r = json::object();
    std::printf("  the report is not JSON (%s)\n", e.what());
  }
  ::unlink(report.c_str());
  for (const json& suite : r.value("testsuites", json::array()))
    for (const json& t : suite.value("testsuite", json::array())) {
      // Passed: ran to the end without a failure (a skipped or unfinished test did not pass).
      const bool ok = t.value("result", "") == "COMPLETED" && (!t.contains("failures") || t["failures"].empty());
      result[ok ? "passed" : "failed"] = result[ok ? "passed" : "failed"].get<int>() + 1;
      std::printf("  %s.%s: %s in %s\n", suite.value("name", "").c_str(), t.value("name", "").c_str(),
                  ok ? "passed" : "FAILED", t.value("time", "?").c_str());
    }
  // No test found, or the binary failed beyond what the report says (a crash, the time limit).
  if (result["passed"].get<int>() + result["failed"].get<int>() == 0 || (status != 0 && result["failed"] == 0))
    result["failed"] = result["failed"].get<int>() + 1;
  std::printf("  %d passed, %d failed (exit status %d), %.0f s in all\n", result["passed"].get<int>(),
              result["failed"].get<int>(), status, seconds);
  return result;
}

}  // namespace strata::bench
