#include "train.h"

#include <ATen/ops/from_blob.h>
#include <ATen/ops/empty.h>

#include <functional>
#include <c10/core/GradMode.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <sys/statvfs.h>
#include <thread>
#include <unistd.h>

#include "args.h"
#include "strata/engine/checkpoint.h"
#include "strata/engine/checkpoint_store.h"
#include "strata/offload/object_store.h"
#include "object_paths.h"
#include "strata/engine/comm.h"
#include "strata/engine/config.h"
#include "strata/engine/cpu_share.h"
#include "strata/engine/device.h"
#include "strata/engine/engine.h"
#include "strata/models/hf_io.h"
#include "strata/models/token_data.h"
#include "tensorboard.h"

namespace strata::cli {
namespace {

constexpr const char* kExportOverwriteHint =
    "set run.export_overwrite (--export-overwrite) to replace its config.json and model.safetensors, or give "
    "another run.export";

// Output locations are tried before the first step: a read-only or missing directory found at
// the first save, or at the export after the last step, would cost the run. Creates `dir` if
// missing and writes, syncs and removes a probe file in it; throws naming `what` and the error.
// An object-store checkpoint_dir (--checkpoint-dir s3://...) means tiered saves: checkpoints are
// saved in a local directory and uploaded to the store in the background. The local directory:
// run.checkpoint_local_dir, else $STRATA_CACHE (default ~/.cache/strata)/checkpoints/<URL after
// its scheme>.
void tier_checkpoints(engine::TrainConfig& tc) {
  if (!offload::is_object_store_url(tc.checkpoint_dir)) return;
  if (!tc.checkpoint_upload.empty() && tc.checkpoint_upload != tc.checkpoint_dir)
    throw std::invalid_argument("run.checkpoint_dir " + tc.checkpoint_dir + " and run.checkpoint_upload " +
                                tc.checkpoint_upload + " name two stores; give one");
  tc.checkpoint_upload = tc.checkpoint_dir;
  if (!tc.checkpoint_local_dir.empty()) {
    tc.checkpoint_dir = tc.checkpoint_local_dir;
    return;
  }
  tc.checkpoint_dir = cache_path("checkpoints", tc.checkpoint_upload);
}

void check_writable(const std::filesystem::path& dir, const std::string& what) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw std::runtime_error(what + " " + dir.string() + ": cannot create it: " + ec.message());
  const std::filesystem::path probe = dir / (".strata-write-test-" + std::to_string(getpid()));
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  const bool ok = fd >= 0 && ::write(fd, "x", 1) == 1 && ::fsync(fd) == 0;
  const int err = errno;
  if (fd >= 0) ::close(fd);
  ::unlink(probe.c_str());
  if (!ok) throw std::runtime_error(what + " " + dir.string() + " is not writable: " + std::strerror(err));
}

// And that a filesystem has room for what the run will write there (`need` bytes), once the
// swap files are reserved (they may share it).
void check_free_space(const std::filesystem::path& dir, uint64_t need, const std::string& what) {
  struct statvfs st {};
  if (::statvfs(dir.c_str(), &st) != 0) return;  // checked writable before; nothing more to learn
  const uint64_t free = uint64_t(st.f_bavail) * uint64_t(st.f_frsize);
  if (free < need)
    throw std::runtime_error(what + " " + dir.string() + " has " + engine::format_bytes(free) + " free, and " +
                             engine::format_bytes(need) + " are needed");
}

// The process's peak resident set (VmHWM), in bytes; 0 where /proc does not say.
uint64_t peak_rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;  // kB
  return 0;
}

constexpr const char* kTrainUsage = R"(usage: strata train [options]

Trains a decoder model with Strata's engine (docs/CONFIG.md lists every configuration key).
Distributed: run one process per rank with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set
(torchrun or `strata launch -n N -- strata train ...`), or one task per rank under srun
(`srun --ntasks-per-node=8 strata train ...`: rank, world and rendezvous host from Slurm).

  --config FILE      JSON configuration (default: the built-in defaults: a GPT-2-shaped model
                     on /usr/share/common-licenses)
  --steps N          override run.steps
  --log PATH         override run.log (JSON lines, one per step; written by rank 0)
  --export DIR       override run.export (Hugging Face safetensors + config.json at the end)
  --checkpoint-dir D override run.checkpoint_dir (save after the last step, and every
                     run.save_every steps); an s3://bucket/prefix URL: tiered saves, each
                     checkpoint saved in run.checkpoint_local_dir and uploaded in the background
  --checkpoint-upload URL
                     override run.checkpoint_upload: upload every committed checkpoint to this
                     object store (s3://bucket/prefix or a directory) in the background
  --resume           start from the checkpoint <checkpoint dir>/latest names (at any world
                     size), or from the newest in the upload store when that one is newer; a
                     directory without any committed checkpoint starts at step 0 (said so); one
                     whose `latest` cannot be followed is an error saying what is there
  --resume-from DIR  start from this committed checkpoint directory or stored checkpoint URL
                     (s3://bucket/prefix/step-N; the checkpoint directory is then its parent
                     unless --checkpoint-dir names another)
  --export-overwrite replace config.json and model.safetensors of a non-empty export directory
                     (otherwise refused before the first step)
  --allow-batch-change
                     resume with another global batch than the checkpoint's (otherwise refused
                     unless another grad_accum keeps it at a new world size, which is then used)
  --profile FILE     override run.profile: print each step's timeline (compute busy, waits by
                     cause, optimizer time, PCIe and NVMe GB/s each way) and write a Chrome
                     trace (chrome://tracing, ui.perfetto.dev) to FILE (FILE.rankN for N > 0)
  --no-progress      no progress line
  --plan             resolve the placement (each "auto" kind's tier, the optimizer group's split
                     by unit over device, host RAM and swap) as this run would, print it with
                     the budgets, and exit: no state is allocated, no weights made. Without the
                     configured GPU, a host device with the device budget stands in for it (set
                     --device-budget then). Under `strata launch -n N` the ranks agree as in a run.
  --device-budget B  override device.budget (bytes; suffixes KiB, MiB, GiB, KB, MB, GB)
  --host-budget B    override offload.host_budget
  --nvme-budget B    override offload.nvme_budget

SIGINT, SIGTERM or SIGUSR1 (Slurm: --signal=USR1@120) stop the run after the current step, on
every rank alike: with a checkpoint directory it saves that step first (continue with --resume);
the exit status is then 128 + the signal. A second SIGINT or SIGTERM stops it at once (not
after SIGUSR1, nor within a second of the first: docs/CONFIG.md).
)";

using engine::format_bytes;

// One step's timeline as one line, its largest stall named.
std::string timeline_line(int64_t step, const engine::StepResult& r) {
  const engine::StepTimeline& t = r.timeline;
  const double sec = std::max(r.seconds, 1e-9);
  const std::pair<const char*, double> stalls[] = {
      {"parameters not gathered", t.wait_params}, {"optimizer update", t.wait_update},
      {"activation offload", t.wait_activations}, {"gradient offload", t.wait_grads},
      {"optimizer", t.optimizer_exposed - t.wait_update}, {"gradient norm", t.norm}};
  const auto* top = &stalls[0];
  for (const auto& st : stalls)
    if (st.second > top->second) top = &st;
  char busy[32] = "n/a";
  if (t.compute_busy >= 0) snprintf(busy, sizeof busy, "%.0f%%", 100 * t.compute_busy / sec);
  char line[640];
  snprintf(line, sizeof line,
           "timeline step %lld: %.3f s | compute busy %s | waits: params %.3f s, update %.3f s, "
           "activations %.3f s, gradients %.3f s | norm %.3f s | optimizer %.3f s (exposed %.3f s, "
           "held by a checkpoint %.3f s) | "
           "PCIe up %.2f GB/s, down %.2f GB/s | NVMe read %.2f GB/s, write %.2f GB/s | network %.2f GB/s | "
           "prefetch %d | largest stall: %s (%.3f s)",
           (long long)step, r.seconds, busy, t.wait_params, t.wait_update, t.wait_activations, t.wait_grads,
           t.norm, t.optimizer, t.optimizer_exposed, t.wait_checkpoint, double(t.h2d_bytes) / sec / 1e9,
           double(t.d2h_bytes) / sec / 1e9, double(t.nvme_read_bytes) / sec / 1e9,
           double(t.nvme_write_bytes) / sec / 1e9, double(t.network_bytes) / sec / 1e9, t.prefetch, top->second > 0 ? top->first : "none",
           std::max(0.0, top->second));
  return line;
}

// One node's disks and network in a step: its ranks' swap reads and writes and what their
// collectives sent.
struct NodeTraffic {
  int64_t node = 0;
  uint64_t nvme_read = 0, nvme_write = 0, network = 0;
};

// Collective on every run of more than one rank (every rank calls it after each step): each
// node's traffic, nodes in the order of their number (DistEnv::node; a rank without one counts
// as node 0). The node numbers
// travel with the numbers, so that every rank takes the same view whatever its own environment
// says. Empty on one node: the rank's own timeline says it all.
std::vector<NodeTraffic> node_traffic(engine::Communicator& comm, const engine::DistEnv& env,
                                      const engine::StepTimeline& t) {
  if (comm.world_size() <= 1) return {};
  at::Tensor mine = at::empty({4}, at::kLong);
  mine[0] = int64_t(std::max(env.node, 0));
  mine[1] = int64_t(t.nvme_read_bytes);
  mine[2] = int64_t(t.nvme_write_bytes);
  mine[3] = int64_t(t.network_bytes);
  at::Tensor all = at::empty({4 * comm.world_size()}, at::kLong);
  comm.all_gather(all, mine)->wait();
  const int64_t* a = all.data_ptr<int64_t>();
  std::map<int64_t, NodeTraffic> by_node;
  for (int r = 0; r < comm.world_size(); ++r) {
    NodeTraffic& n = by_node[a[4 * r]];
    n.nvme_read += uint64_t(a[4 * r + 1]), n.nvme_write += uint64_t(a[4 * r + 2]), n.network += uint64_t(a[4 * r + 3]);
  }
  if (by_node.size() <= 1) return {};
  std::vector<NodeTraffic> out;
  for (auto& [id, n] : by_node) n.node = id, out.push_back(n);
  return out;
}

// " | node 0: NVMe read 1.20 GB/s, write 0.80 GB/s, network 0.31 GB/s | node 1: ...".
std::string traffic_line(const std::vector<NodeTraffic>& nodes, double seconds) {
  std::string out;
  const double sec = std::max(seconds, 1e-9);
  for (size_t i = 0; i < nodes.size(); ++i) {
    char part[160];
    snprintf(part, sizeof part, " | node %lld: NVMe read %.2f GB/s, write %.2f GB/s, network %.2f GB/s",
             (long long)nodes[i].node,
             double(nodes[i].nvme_read) / sec / 1e9, double(nodes[i].nvme_write) / sec / 1e9,
             double(nodes[i].network) / sec / 1e9);
    out += part;
  }
  return out;
}

nlohmann::json traffic_json(const std::vector<NodeTraffic>& nodes) {
  nlohmann::json out = nlohmann::json::array();
  for (const NodeTraffic& n : nodes)
    out.push_back({{"node", n.node},
                   {"nvme_read_bytes", n.nvme_read}, {"nvme_write_bytes", n.nvme_write}, {"network_bytes", n.network}});
  return out;
}

// Chrome trace event format: complete events ("ph": "X", microseconds), one thread per lane.
void write_trace(const std::string& path, int rank, const std::vector<engine::TraceSpan>& spans) {
  std::map<std::string, int> lanes;
  nlohmann::json events = nlohmann::json::array();
  for (const auto& sp : spans) {
    auto it = lanes.emplace(sp.lane, int(lanes.size()) + 1).first;
    events.push_back({{"name", sp.name}, {"cat", sp.lane}, {"ph", "X"}, {"pid", rank}, {"tid", it->second},
                      {"ts", sp.begin * 1e6}, {"dur", (sp.end - sp.begin) * 1e6}});
  }
  for (const auto& [lane, tid] : lanes)
    events.push_back({{"name", "thread_name"}, {"ph", "M"}, {"pid", rank}, {"tid", tid}, {"args", {{"name", lane}}}});
  events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", rank}, {"args", {{"name", "rank " + std::to_string(rank)}}}});
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << nlohmann::json{{"traceEvents", events}, {"displayTimeUnit", "ms"}}.dump() << "\n";
    if (!out.flush()) throw std::runtime_error("cannot write the trace " + tmp);
  }
  std::filesystem::rename(tmp, path);
}

std::string bar(double frac, int width) {
  const int full = int(std::round(std::clamp(frac, 0.0, 1.0) * width));
  return std::string(size_t(full), '#') + std::string(size_t(width - full), '.');
}

// `strata train --plan`: the engine resolves the placement and stops (EngineConfig::plan_only).
int plan_main(engine::TrainConfig tc) {
  tc.engine.validate();
  const engine::DistEnv env = engine::DistEnv::from_env();
  if (env.local_world_size > 0) tc.engine.local_ranks = env.local_world_size;
  auto comm = engine::Communicator::create(env, std::chrono::milliseconds(int64_t(tc.engine.timeout_s * 1000)),
                                           tc.engine.device == "cuda");
  std::unique_ptr<engine::Device> device;
  std::string stand_in;
  try {
    device = engine::Device::create(tc.engine.device, env.local_rank, tc.engine.device_budget);
  } catch (const std::exception& e) {
    if (tc.engine.device != "cuda") throw;
    if (tc.engine.device_budget == UINT64_MAX)
      throw std::invalid_argument("strata train --plan: no GPU here (" + std::string(e.what()) +
                                  "); give the GPU's budget with --device-budget or device.budget");
    device = engine::Device::create_host(tc.engine.device_budget);
    stand_in = " (no GPU here: a host device with the device budget stands in)";
  }
  tc.engine.plan_only = true;
  auto model = std::make_unique<models::Decoder>(tc.model, tc.init_seed, models::Decoder::Init::kDeferred);
  const models::ModelConfig mc = model->config();
  engine::Engine eng(std::move(model), tc.engine, *comm, *device);
  if (comm->rank() == 0)
    std::cout << "strata train --plan: " << mc.name << ", " << mc.layers << " layers x " << mc.hidden << ", "
              << std::fixed << std::setprecision(2) << double(mc.parameters()) / 1e9 << "B parameters, "
              << comm->world_size() << " rank(s), " << tc.engine.micro_batch << " x " << tc.engine.seq_len
              << " tokens a micro-batch\n  device: " << device->description() << stand_in << "\n  "
              << eng.placement_report() << "\n";
  return 0;
}

// --- stopping on a signal ----------------------------------------------------------------------
// SIGINT, SIGTERM (what a scheduler sends before it kills) and SIGUSR1 (Slurm's
// `--signal=USR1@SECONDS` warning) ask the run to stop at the next step boundary. There the ranks
// agree (any rank's request stops every rank after the same step), save a checkpoint if the run
// has a checkpoint directory, and exit with 128 + the signal (SIGINT: by SIGINT itself, so that a
// shell loop running strata stops too). A second SIGINT or SIGTERM ends the process at once, as the
// signal would have; not: SIGINT or SIGTERM after a SIGUSR1 warning (Slurm's time limit: the stop
// under way keeps its grace period), nor a repeat within a second of the first (the same request
// delivered twice: `pkill strata` or a process-group kill reaches a rank directly and through
// `strata launch`). The signals are blocked before any thread starts and taken by one waiting
// thread, so no system call of the engine's threads (I/O, collectives) is interrupted; a handler
// covers a thread that existed before. A SIGINT ignored when strata started (a background job of
// a script) stays ignored.
std::atomic<int> stop_signal{0};
std::atomic<int64_t> stop_signal_ns{0};  // CLOCK_MONOTONIC of the first
std::atomic<bool> stop_messages{false};  // this process prints "stopping ..." (rank 0)

const char* signal_name(int sig) {
  return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : sig == SIGUSR1 ? "SIGUSR1" : strsignal(sig);
}

int64_t monotonic_ns() {  // async-signal-safe
  timespec t{};
  clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t(t.tv_sec) * 1000000000 + t.tv_nsec;
}

// Ends the process as `sig` would (its default action), from any thread. Async-signal-safe.
[[noreturn]] void die_by(int sig) {
  signal(sig, SIG_DFL);
  sigset_t one;
  sigemptyset(&one);
  sigaddset(&one, sig);
  pthread_sigmask(SIG_UNBLOCK, &one, nullptr);
  raise(sig);
  _exit(128 + sig);  // not reached for SIGINT and SIGTERM
}

// Records a stop request; true if it was the first. Async-signal-safe (lock-free atomics,
// clock_gettime): the handler and the waiting thread both call it.
bool note_stop_signal(int sig) {
  int prev = 0;
  if (stop_signal.compare_exchange_strong(prev, sig)) {
    stop_signal_ns.store(monotonic_ns());
    return true;
  }
  if (sig == SIGUSR1) return false;  // a repeated warning
  if (prev == SIGUSR1) {             // the warning, then the real thing: still the first stop
    stop_signal.compare_exchange_strong(prev, sig);
    return false;
  }
  if (monotonic_ns() - stop_signal_ns.load() < 1000000000) return false;  // the same request twice
  die_by(sig);
}

extern "C" void on_train_stop_signal(int sig) { note_stop_signal(sig); }

void catch_stop_signals() {
  static const bool installed = [] {
    sigset_t set;
    sigemptyset(&set);
    for (int sig : {SIGINT, SIGTERM, SIGUSR1}) {
      struct sigaction old {};
      sigaction(sig, nullptr, &old);
      if (sig == SIGINT && old.sa_handler == SIG_IGN) continue;
      sigaddset(&set, sig);
      struct sigaction sa {};
      sa.sa_handler = on_train_stop_signal;
      sa.sa_flags = SA_RESTART;
      sigaction(sig, &sa, nullptr);
    }
    pthread_sigmask(SIG_BLOCK, &set, nullptr);  // threads started from here on inherit it
    std::thread([set] {
      for (;;) {
        siginfo_t info{};
        const int sig = sigwaitinfo(&set, &info);
        if (sig < 0) continue;
        if (sig == SIGTERM && info.si_code == SI_QUEUE && (info.si_value.sival_int & 0xffff0000) == kPeerFailedTag) {
          // From `strata launch`: a rank failed, so no step can finish. A save under way is
          // abandoned; the last committed checkpoint stays loadable (the commit protocol).
          std::cerr << "strata train: rank " << (info.si_value.sival_int & 0xffff)
                    << " failed (strata launch): exiting\n" << std::flush;
          die_by(SIGTERM);
        }
        const int before = stop_signal.load();
        if (note_stop_signal(sig) && stop_messages.load())
          std::cerr << "\nstrata train: " << signal_name(sig) << ": stopping after the current step"
                    << (sig == SIGUSR1 ? "" : " (again to stop at once)") << "\n" << std::flush;
        else if (before == SIGUSR1 && sig != SIGUSR1 && stop_messages.load())
          std::cerr << "\nstrata train: " << signal_name(sig) << " after SIGUSR1: still stopping after the current step\n"
                    << std::flush;
      }
    }).detach();
    return true;
  }();
  (void)installed;
}

// The signal any rank got, agreed by all of them (0: go on). Collective.
int agreed_stop_signal(engine::Communicator& comm) {
  at::Tensor s = at::tensor({double(stop_signal.load())}, at::TensorOptions().dtype(at::kDouble));
  comm.all_reduce(s, engine::ReduceOp::kMax);
  return int(s.item<double>());
}

int agreed_stop = 0;  // the signal every rank agreed to stop on (0: none)

// The training samples and the evaluation samples (null without evaluation data).
struct DataSources {
  std::shared_ptr<const models::SampleSource> train, eval;
};

std::shared_ptr<const models::SampleSource> open_samples(const engine::TrainConfig& tc, const std::string& path,
                                                         const std::string& format, uint64_t vocab, bool lead) {
  const uint64_t T = uint64_t(tc.engine.seq_len);
  if (format != "sft")
    return std::make_shared<models::TokenWindows>(
        std::make_shared<models::TokenCorpus>(path, models::parse_token_format(format), vocab), T);
  auto sft = std::make_shared<models::SftExamples>(path, T, vocab, tc.data_pad_id);
  if (lead && sft->truncated_examples() > 0)
    std::cerr << "strata train: warning: " << sft->truncated_examples() << " of " << sft->size() << " examples of "
              << path << " are longer than seq_len + 1 = " << T + 1 << " tokens and are cut there ("
              << sft->truncated_loss_tokens() << " response tokens never trained on); raise data.seq_len to keep them\n";
  return sft;
}

DataSources open_data(const engine::TrainConfig& tc, uint64_t vocab, bool lead) {
  DataSources d;
  d.train = open_samples(tc, tc.data_path, tc.data_format, vocab, lead);
  if (!tc.eval_path.empty()) d.eval = open_samples(tc, tc.eval_path, tc.eval_format, vocab, lead);
  if (tc.eval_split > 0) {  // the last samples are held out
    const uint64_t n = d.train->size(), held = std::max<uint64_t>(1, uint64_t(std::llround(tc.eval_split * double(n))));
    if (held >= n)
      throw std::invalid_argument("data.eval_split " + std::to_string(tc.eval_split) + " of the " + std::to_string(n) +
                                  " samples of " + d.train->description() + " leaves none to train on");
    d.eval = std::make_shared<models::SampleRange>(d.train, n - held, n);
    d.train = std::make_shared<models::SampleRange>(d.train, 0, n - held);
  }
  if (d.eval && tc.eval_max_samples > 0 && d.eval->size() > uint64_t(tc.eval_max_samples))
    d.eval = std::make_shared<models::SampleRange>(d.eval, 0, uint64_t(tc.eval_max_samples));
  return d;
}

int run_training(const std::vector<std::string>& argv) {
  for (const auto& a : argv)
    if (a == "--help" || a == "-h") {
      std::cout << kTrainUsage;
      return 0;
    }
  Args args(argv, {"config", "steps", "log", "export", "checkpoint-dir", "checkpoint-upload", "resume-from", "profile",
                   "device-budget", "host-budget", "nvme-budget"},
            {"no-progress", "resume", "plan", "allow-batch-change", "export-overwrite"});
  engine::TrainConfig tc = args.has("config") ? engine::load_train_config(args.get("config", ""))
                                                : engine::parse_train_config("{}", "(defaults)");
  if (args.has("steps")) tc.steps = args.count("steps", 0);
  if (args.has("log")) tc.log_path = args.get("log", "");
  if (args.has("export")) tc.export_dir = args.get("export", "");
  if (args.has("no-progress")) tc.progress = false;
  if (args.has("checkpoint-dir")) tc.checkpoint_dir = args.get("checkpoint-dir", "");
  if (args.has("checkpoint-upload")) tc.checkpoint_upload = args.get("checkpoint-upload", "");
  if (args.has("resume")) tc.resume = true;
  if (args.has("allow-batch-change")) tc.allow_batch_change = true;
  if (args.has("export-overwrite")) tc.export_overwrite = true;
  if (tc.export_every > 0 && tc.export_dir.empty())
    throw std::invalid_argument("run.export_every needs run.export (or --export): the exports go beside it");
  if (args.has("profile")) tc.profile_path = args.get("profile", "");
  if (args.has("device-budget")) tc.engine.device_budget = engine::parse_bytes(args.get("device-budget", ""));
  if (args.has("host-budget")) tc.engine.host_budget = engine::parse_bytes(args.get("host-budget", ""));
  if (args.has("nvme-budget")) tc.engine.nvme_budget = engine::parse_bytes(args.get("nvme-budget", ""));
  if (args.has("plan")) return plan_main(tc);
  catch_stop_signals();
  tc.engine.profile = !tc.profile_path.empty();
  if (tc.resume && tc.checkpoint_dir.empty() && !args.has("resume-from"))
    throw std::invalid_argument("--resume needs a checkpoint directory (--checkpoint-dir or run.checkpoint_dir)");
  tier_checkpoints(tc);
  // What this run starts from, decided before anything is built; a committed checkpoint is never
  // overwritten by a run that did not load it. `resume_dir` is a directory or a stored checkpoint's URL.
  // Rank 0 alone chooses (its error, if any, reaches every rank once they have met): with
  // node-local checkpoint disks only rank 0's holds `latest` and the manifests.
  const engine::DistEnv env = engine::DistEnv::from_env();
  std::optional<std::filesystem::path> resume_dir;
  std::string resume_error;
  const auto choose = [&](const std::function<void()>& f) {
    if (env.rank != 0) return;
    try {
      f();
    } catch (const std::exception& e) {
      resume_error = e.what();
    }
  };
  if (args.has("resume-from")) {
    const std::filesystem::path from(args.get("resume-from", ""));
    choose([&] {
      resume_dir = from;
      if (offload::is_object_store_url(from.string()))
        engine::read_checkpoint_meta(from);  // throws, saying why, unless committed
      else if (!std::filesystem::exists(from / "manifest.json"))
        throw std::invalid_argument("--resume-from " + from.string() +
                                    ": not a committed checkpoint directory (no manifest.json)");
    });
    if (tc.checkpoint_dir.empty()) tc.checkpoint_dir = from.parent_path().string();
    tier_checkpoints(tc);
  } else if (tc.resume) {
    choose([&] {
      resume_dir = engine::resume_point(tc.checkpoint_dir);
      if (!tc.checkpoint_upload.empty()) {
        // The store may hold a newer one (saved on another machine, or the local copy pruned).
        const auto stored = engine::newest_stored_checkpoint(tc.checkpoint_upload);
        if (stored && (!resume_dir || engine::read_checkpoint_meta(*stored).train_steps >
                                          engine::read_checkpoint_meta(*resume_dir).train_steps))
          resume_dir = std::filesystem::path(*stored);
      }
    });
  } else if (!tc.checkpoint_dir.empty()) {
    choose([&] {
    const auto committed = engine::committed_checkpoints(tc.checkpoint_dir);
    if (!committed.empty())
      throw std::invalid_argument("checkpoint directory " + tc.checkpoint_dir + " already holds " +
                                  std::to_string(committed.size()) + " committed checkpoint(s) (the newest " +
                                  committed.back().filename().string() +
                                  "): continue from them with --resume (or --resume-from DIR), or give "
                                  "another --checkpoint-dir; a run that did not load them would overwrite them");
    if (!tc.checkpoint_upload.empty()) {
      const auto stored = engine::stored_checkpoints(tc.checkpoint_upload);
      if (!stored.empty())
        throw std::invalid_argument("the checkpoint store " + tc.checkpoint_upload + " already holds " +
                                    std::to_string(stored.size()) + " committed checkpoint(s) (the newest " +
                                    stored.back() + "): continue from them with --resume, or upload elsewhere; a "
                                    "run that did not load them would replace them");
    }
    });
  }
  const engine::EngineConfig* ecp = &tc.engine;  // until the engine resolves "auto" placements
  if (!tc.checkpoint_dir.empty()) check_writable(tc.checkpoint_dir, "checkpoint directory");
  if (!tc.tensorboard_dir.empty()) check_writable(tc.tensorboard_dir, "TensorBoard directory");
  // An export to object storage (run.export s3://...) is staged in a local directory of the
  // cache, then uploaded.
  std::string export_store;
  if (offload::is_object_store_url(tc.export_dir)) {
    if (tc.export_every > 0)
      throw std::invalid_argument("run.export_every with an export to object storage (" + tc.export_dir +
                                  ") is not supported: export to a directory, or only at the end");
    check_export_store(tc.export_dir, tc.export_overwrite, kExportOverwriteHint);
    export_store = tc.export_dir;
    tc.export_dir = cache_path("exports", export_store);
    tc.export_overwrite = true;  // the staging directory is the cache's
    clear_directory(tc.export_dir);  // nothing of an earlier staged export is uploaded again
  }
  if (!tc.export_dir.empty()) {
    models::ExportDirectory::check(tc.export_dir, tc.export_overwrite, kExportOverwriteHint);
    check_writable(models::ExportDirectory::temporary(tc.export_dir).parent_path(), "the export's parent directory");
  }

  if (env.local_world_size > 0) tc.engine.local_ranks = env.local_world_size;
  // This rank's share of the node's cores for its compute, before any op runs (cpu_share.h).
  engine::apply_compute_threads(env.local_world_size > 0 ? env.local_world_size : env.world_size);
  stop_messages = env.rank == 0;
  auto comm = engine::Communicator::create(
      env, std::chrono::milliseconds(int64_t(ecp->timeout_s * 1000)), ecp->device == "cuda");
  // A failed collective ends this rank at once, with the error: the world is broken, and
  // unwinding would first join threads (an asynchronous save, the updater) that may wait on
  // peers until the timeout, printing nothing meanwhile. The log is flushed line by line and the
  // last committed checkpoint stays loadable.
  comm->set_failure_handler([rank = comm->rank()](const std::string& what) {
    std::cerr << "strata: error: rank " << rank << ": " << what << "\n" << std::flush;
    _exit(1);
  });
  const bool lead = comm->rank() == 0;
  // Rank 0's choice on every rank (and its error thrown on every rank); the saved run's global
  // batch kept, or changed only when asked.
  bool fresh_under_resume = false;
  {
    const engine::ResumeChoice choice = engine::agree_resume_point(*comm, resume_dir, resume_error);
    resume_dir = choice.dir;
    fresh_under_resume = tc.resume && !args.has("resume-from") && !resume_dir;
    if (resume_dir) {
      const engine::ResumeBatch rb = engine::resume_batch(choice.meta, tc.engine.micro_batch, tc.engine.grad_accum,
                                                          env.world_size, tc.allow_batch_change);
      tc.engine.grad_accum = rb.grad_accum;
      if (!rb.note.empty() && lead) std::cerr << "strata train: " << rb.note << "\n";
    }
  }
  auto device = engine::Device::create(ecp->device, env.local_rank, ecp->device_budget);

  // A model in a bucket: one rank per node mirrors it into the cache (ranged GETs, files whose
  // size and etag match the last copy skipped), the others wait; then it loads from there.
  if (offload::is_object_store_url(tc.init_from)) {
    const std::string local = cache_path("models", tc.init_from);
    if (env.local_rank == 0) {
      const uint64_t bytes = offload::mirror_to_directory(
          *offload::open_object_store(tc.init_from), local, {}, [&](const std::string& name, uint64_t size) {
            if (lead) std::cerr << "strata train: fetching " << tc.init_from << "/" << name << " (" << double(size) / (1 << 20) << " MiB)\n";
          });
      if (lead)
        std::cerr << "strata train: model " << tc.init_from << " in " << local << " (" << double(bytes) / (1 << 20)
                  << " MiB fetched)\n";
    }
    comm->barrier();
    tc.init_from = local;
  }

  std::unique_ptr<models::Decoder> model =
      tc.init_from.empty() ? std::make_unique<models::Decoder>(tc.model, tc.init_seed, models::Decoder::Init::kDeferred)
                           : models::load_hf_model(tc.init_from);
  const models::ModelConfig mc = model->config();
  const DataSources data = open_data(tc, uint64_t(mc.vocab_size), comm->rank() == 0);
  const uint64_t global_batch =
      uint64_t(ecp->micro_batch * ecp->grad_accum) * uint64_t(comm->world_size());
  models::BatchLoader loader(data.train, global_batch, comm->rank(), comm->world_size(), tc.data_seed);

  if (lead && tc.progress) {
    // A large model spends minutes here: a line that updates on a terminal, else one line per
    // tenth of the units.
    const auto t0 = std::chrono::steady_clock::now();
    tc.engine.on_unit_placed = [t0, tty = bool(isatty(STDERR_FILENO))](size_t done, size_t total) {
      if (!tty && done * 10 / total == (done - 1) * 10 / total && done != total) return;
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      char secs[32];  // formatted here: std::cerr's precision stays as it was
      std::snprintf(secs, sizeof secs, "%.1f", s);
      std::cerr << (tty ? "\r\033[K" : "") << "strata train: placing the initial weights: unit " << done << "/"
                << total << " (" << secs << " s)" << (done == total || !tty ? "\n" : "") << std::flush;
    };
  }
  engine::Engine eng(std::move(model), tc.engine, *comm, *device);
  const engine::EngineConfig& ec = eng.config();
  // Room for one checkpoint (fp32 master weights and two Adam moments: every rank's files in
  // one directory), with the swap files already reserved.
  if (!tc.checkpoint_dir.empty())
    check_free_space(tc.checkpoint_dir, uint64_t(mc.parameters()) * engine::Engine::kStateKinds * 4,
                     "checkpoint directory");
  const at::ScalarType export_type =
      tc.export_dtype != "auto"                ? models::parse_export_dtype(tc.export_dtype)
      : ec.compute == engine::Precision::kBf16 ? at::kBFloat16
                                               : at::kFloat;
  // And for every export the run may write (the periodic ones stay), in the export's dtype.
  if (!tc.export_dir.empty() && lead) {
    const uint64_t exports = 1 + (tc.export_every > 0 && tc.steps > 0 ? uint64_t((tc.steps - 1) / tc.export_every) : 0);
    check_free_space(models::ExportDirectory::temporary(tc.export_dir).parent_path(),
                     uint64_t(mc.parameters()) * uint64_t(at::elementSize(export_type)) * exports,
                     exports == 1 ? "the export's parent directory"
                                  : "the export's parent directory (" + std::to_string(exports) + " exports)");
  }
  const engine::MemoryReport m0 = eng.memory();

  int64_t first_step = 0;
  int64_t saved_through = 0;  // the steps the newest checkpoint (saved or resumed from) holds
  std::string resumed_from;
  if (resume_dir) {
    const engine::CheckpointMeta meta = engine::load_checkpoint(eng, *comm, *resume_dir, tc.checkpoint_transfer);
    loader.set_position(meta.samples_consumed);
    first_step = meta.train_steps;
    saved_through = first_step;
    resumed_from = resume_dir->string();
  } else if (fresh_under_resume && lead) {
    std::cerr << "strata train: no committed checkpoint under " << tc.checkpoint_dir << " yet: starting at step 0\n";
  }
  // Saves run in the background (the step blocks only for the snapshot) unless
  // run.async_checkpoint is false; each is committed at a later step boundary or at the end.
  engine::CheckpointOptions ckpt_options;
  ckpt_options.staging_bytes = tc.checkpoint_staging;
  engine::AsyncCheckpointer checkpointer(*comm, ckpt_options);
  // Tiered saves: every committed checkpoint goes up to the store in the background.
  std::unique_ptr<engine::CheckpointUploader> uploader;
  if (!tc.checkpoint_upload.empty()) {
    uploader = std::make_unique<engine::CheckpointUploader>(*comm, tc.checkpoint_upload, tc.checkpoint_transfer);
    if (lead) {
      std::cerr << "strata train: checkpoints are saved in " << tc.checkpoint_dir << " and uploaded to "
                << uploader->store_url() << "\n";
      const auto& left = uploader->aborted_leftovers();
      if (!left.empty()) {
        std::cerr << "strata train: aborted " << left.size() << " incomplete upload" << (left.size() > 1 ? "s" : "")
                  << " an earlier run left in " << uploader->store_url() << " (" << left.front().key
                  << (left.size() > 1 ? ", ..." : "") << "): the store drops their parts\n";
      }
      if (!uploader->leftover_error().empty())
        std::cerr << "strata train: warning: could not look for incomplete uploads an earlier run left: "
                  << uploader->leftover_error() << "\n";
    }
  }
  const auto uploaded = [&](const std::optional<std::string>& url) {
    if (!uploader) return;
    const std::string nl = tc.progress && isatty(STDERR_FILENO) ? "\n" : "";
    if (!url) {
      if (!uploader->last_error().empty() && lead) std::cerr << nl << "strata train: warning: " << uploader->last_error() << "\n";
      return;
    }
    if (lead) {
      std::cerr << nl << "strata train: uploaded " << *url << " (" << double(uploader->last_bytes()) / (1 << 20)
                << " MiB from this rank in " << uploader->last_seconds() << " s)\n";
      if (!uploader->last_warning().empty()) std::cerr << "strata train: warning: " << uploader->last_warning() << "\n";
    }
    if (tc.keep_uploaded_checkpoints > 0) {
      try {  // collective: every rank gets the same outcome
        engine::prune_stored_checkpoints(*comm, tc.checkpoint_upload, size_t(tc.keep_uploaded_checkpoints));
      } catch (const engine::CommError&) {
        throw;
      } catch (const std::exception& e) {
        if (lead) std::cerr << "strata train: warning: " << e.what() << " (training goes on)\n";
      }
    }
  };
  auto committed = [&](const std::optional<std::filesystem::path>& dir) {
    if (!dir) return;
    if (lead)
      std::cerr << (tc.progress && isatty(STDERR_FILENO) ? "\n" : "") << "strata train: committed "
                << dir->string() << "\n";
    if (uploader) {
      // An upload still in flight is finished (and committed) first; then this one starts,
      // before pruning, which never removes the checkpoint being uploaded (the newest).
      if (uploader->in_flight()) uploaded(uploader->finish());
      uploader->start(*dir);
    }
    if (tc.keep_checkpoints > 0)
      engine::prune_checkpoints(*comm, tc.checkpoint_dir, size_t(tc.keep_checkpoints));
  };
  auto save = [&](int64_t steps_done, bool synchronous) {
    char name[32];
    snprintf(name, sizeof name, "step-%08lld", (long long)steps_done);
    const engine::CheckpointMeta meta{steps_done, loader.position(), global_batch};
    saved_through = steps_done;
    if (synchronous) {
      const auto t0 = std::chrono::steady_clock::now();
      const std::filesystem::path dir = engine::save_checkpoint(eng, *comm, tc.checkpoint_dir, name, meta, ckpt_options);
      if (lead)
        std::cerr << (tc.progress && isatty(STDERR_FILENO) ? "\n" : "") << "strata train: saved " << name
                  << " (training blocked "
                  << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s)\n";
      committed(dir);
      return;
    }
    const double blocked = checkpointer.start(eng, tc.checkpoint_dir, name, meta);
    if (lead)
      std::cerr << (tc.progress && isatty(STDERR_FILENO) ? "\n" : "") << "strata train: saving "
                << name << " in the background (training blocked " << blocked << " s)\n";
  };

  std::ofstream log;
  // A line that cannot be written (a full disk) stops the run: a log cut short would pass for a
  // complete one.
  const auto write_log = [&](const nlohmann::json& line) {
    errno = 0;
    log << line.dump() << "\n" << std::flush;
    if (!log)
      throw std::runtime_error("cannot write the log " + tc.log_path + (errno ? std::string(": ") + std::strerror(errno) : ""));
  };
  if (lead && !tc.log_path.empty()) {
    log.open(tc.log_path, first_step > 0 ? std::ios::app : std::ios::trunc);
    if (!log) throw std::runtime_error("cannot write the log " + tc.log_path);
    nlohmann::json start = {
        {"event", "start"},
        {"model", mc.name},
        {"parameters", mc.parameters()},
        {"world_size", comm->world_size()},
        {"launcher", env.launcher},
        {"global_batch", global_batch},
        {"lr_schedule",
         {{"lr", ec.lr}, {"decay", engine::to_string(tc.schedule().decay)},
          {"warmup_steps", tc.schedule().warmup_steps}, {"total_steps", tc.schedule().total_steps},
          {"min_lr_ratio", tc.schedule().min_lr_ratio}}},
        {"seq_len", ec.seq_len},
        {"compute", to_string(ec.compute)},
        {"reduce", to_string(ec.reduce)},
        {"overlap", to_string(ec.update_overlap)},
        {"placement",
         {{"params", to_string(ec.params)}, {"grads", eng.gradients_stored() ? to_string(ec.grads) : "not stored"},
          {"master", to_string(ec.master)}, {"moments", to_string(ec.moments)},
          {"activations", to_string(ec.activations)}, {"recomputed_blocks", ec.recompute_blocks},
          {"head_tiles", ec.head_tiles}, {"attention_tiles", ec.attention_tiles}, {"mlp_tiles", ec.mlp_tiles}, {"vocab_tiles", ec.vocab_tiles},
          {"mlp_token_chunk", ec.mlp_token_chunk}, {"head_one_pass", ec.head_one_pass},
          {"optimizer_device_units", eng.optimizer_device_units()},
          {"optimizer_host_units", eng.optimizer_host_units()}}},
        {"device", device->description()},
        {"device_budget", ec.device_budget},
        {"data", data.train->description()},
        {"eval_data", data.eval ? data.eval->description() : ""},
        {"resumed_from", resumed_from},
        {"first_step", first_step + 1}};
    write_log(start);
  }
  if (lead) {
    std::cerr << "strata train: " << mc.name << " (" << mc.parameters() / 1e6 << "M parameters, "
              << mc.layers << " layers), world " << comm->world_size()
              << (env.launcher == "none" ? "" : " (" + env.launcher + ")") << ", global batch "
              << global_batch << " x " << ec.seq_len << " tokens, " << to_string(ec.compute)
              << " compute\n  " << eng.placement_report() << "\n  device: " << device->description() << ", budget "
              << (ec.device_budget == UINT64_MAX ? "unlimited" : format_bytes(ec.device_budget))
              << ", " << format_bytes(m0.device_used) << " of state on it; host state "
              << format_bytes(m0.host_state) << ", NVMe state " << format_bytes(m0.nvme_state)
              << " per rank\n  data: " << data.train->description()
              << (data.eval ? "\n  evaluation: " + data.eval->description() : std::string()) << "\n";
    if (!resumed_from.empty())
      std::cerr << "  resumed from " << resumed_from << " after step " << first_step << "\n";
  }

  const bool tty = isatty(STDERR_FILENO);
  std::unique_ptr<TensorBoardWriter> tensorboard;
  if (lead && !tc.tensorboard_dir.empty()) tensorboard = std::make_unique<TensorBoardWriter>(tc.tensorboard_dir);
  at::Tensor ids = at::empty({int64_t(loader.local_batch()), ec.seq_len + 1}, at::kLong);
  // A Hugging Face model directory of the weights now (collective: every rank gathers), with the
  // tokenizer and generation config of init_from; run.export_every's go beside run.export.
  const auto write_export = [&](const std::filesystem::path& dir, bool overwrite) {
    auto params = eng.gather_parameters();  // collective: every rank
    if (!lead) return;
    const auto t0 = std::chrono::steady_clock::now();
    models::Decoder out(mc, 0, models::Decoder::Init::kDeferred);  // every weight is copied in
    at::NoGradGuard no_grad;
    std::map<std::string, at::Tensor> by_name(params.begin(), params.end());
    for (auto& [name, t] : out.hf_parameters()) t.copy_(by_name.at(name));
    params.clear();
    models::ExportDirectory target(dir, overwrite, kExportOverwriteHint);
    models::export_hf_model(out, target.tmp(), export_type, tc.export_shard_bytes);
    const std::vector<std::string> carried =
        tc.init_from.empty() ? std::vector<std::string>{} : models::copy_tokenizer_files(tc.init_from, target.tmp());
    target.commit();
    std::cerr << (tc.progress && isatty(STDERR_FILENO) ? "\r\033[K" : "") << "strata train: exported " << dir.string()
              << " (" << models::hf_dtype_name(export_type) << (carried.empty() ? "" : ", with the tokenizer of init_from")
              << ", " << std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() << " s)\n";
    if (!export_store.empty() && dir == std::filesystem::path(tc.export_dir)) upload_export(dir.string(), export_store);
  };
  // Every rank waits for rank 0's write (within distributed.timeout_s) and learns whether it
  // failed, so that a failed export stops every rank at once instead of leaving them in the next
  // step's collectives.
  const auto export_model = [&](const std::filesystem::path& dir, bool overwrite) {
    std::string failure;
    try {
      write_export(dir, overwrite);
    } catch (const engine::CommError&) {
      throw;  // a peer is gone: nothing to agree on
    } catch (const std::exception& e) {
      failure = e.what();
    }
    at::Tensor failed = at::tensor({failure.empty() ? 0.0 : 1.0}, at::TensorOptions().dtype(at::kDouble));
    comm->all_reduce(failed, engine::ReduceOp::kSum);
    if (failed.item<double>() > 0)
      throw std::runtime_error(!failure.empty() ? failure : "the export on rank 0 failed (rank 0 says why)");
  };
  const auto periodic_export_dir = [&](int64_t step) {
    return models::ExportDirectory::beside(tc.export_dir, "-step-" + std::to_string(step));
  };
  // The periodic exports' directories are checked now, not after hours of training. A resumed
  // run replaces those past its checkpoint: the interrupted run's, of the same weights.
  const bool replace_periodic = tc.export_overwrite || first_step > 0;
  for (int64_t k = first_step + 1; tc.export_every > 0 && k < tc.steps; ++k)
    if (k % tc.export_every == 0) models::ExportDirectory::check(periodic_export_dir(k), replace_periodic, kExportOverwriteHint);
  // Supervised examples: which targets count (engine.h train_step).
  at::Tensor loss_mask;
  if (data.train->masked()) loss_mask = at::empty({int64_t(loader.local_batch()), ec.seq_len}, at::kByte);
  // The evaluation pass: every sample of the evaluation data once, through the engine's forward.
  const auto evaluate = [&](int64_t after_step) {
    if (!data.eval) return;
    const auto t0 = std::chrono::steady_clock::now();
    const models::EvalBatches batches(data.eval, global_batch, comm->rank(), comm->world_size());
    at::Tensor eval_ids = at::empty_like(ids);
    at::Tensor eval_mask = at::empty({int64_t(batches.local_batch()), ec.seq_len}, at::kByte);
    double loss_sum = 0;
    uint64_t tokens = 0;
    for (uint64_t b = 0; b < batches.batches(); ++b) {
      batches.batch(b, eval_ids.data_ptr<int64_t>(), eval_mask.data_ptr<uint8_t>());
      const engine::Engine::EvalResult r = eng.evaluate(eval_ids, eval_mask);
      loss_sum += r.loss_sum;
      tokens += r.tokens;
    }
    const double loss = tokens > 0 ? loss_sum / double(tokens) : std::numeric_limits<double>::quiet_NaN();
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!lead) return;
    std::cerr << (tc.progress && isatty(STDERR_FILENO) ? "\r\033[K" : "") << "strata train: eval after step "
              << after_step << ": loss " << loss << " (" << data.eval->size() << " samples, " << tokens
              << " targets, " << secs << " s)\n";
    if (log.is_open())
      write_log({{"event", "eval"}, {"step", after_step}, {"eval_loss", loss}, {"eval_samples", data.eval->size()},
                 {"eval_tokens", tokens}, {"seconds", secs}});
    if (tensorboard) tensorboard->scalar("eval/loss", after_step, loss);
  };
  double tokens_total = 0, seconds_total = 0;
  std::vector<engine::TraceSpan> trace;
  int stopped_by = 0;  // the signal that stopped the run early
  int64_t steps_done = first_step;
  const engine::LrSchedule schedule = tc.schedule();  // a function of the step: resumes exactly
  for (int64_t s = first_step; s < tc.steps; ++s) {
    if ((stopped_by = agreed_stop_signal(*comm)) != 0) break;
    loader.next(ids.data_ptr<int64_t>(), loss_mask.defined() ? loss_mask.data_ptr<uint8_t>() : nullptr);
    const double lr = engine::scheduled_lr(schedule, ec.lr, s);
    eng.set_learning_rate(lr);
    const engine::StepResult r = eng.train_step(ids, loss_mask);
    const engine::MemoryReport mem = eng.memory();
    const std::vector<NodeTraffic> traffic = node_traffic(*comm, env, r.timeline);
    tokens_total += double(r.tokens);
    seconds_total += r.seconds;
    steps_done = s + 1;
    committed(checkpointer.poll());
    if (uploader) uploaded(uploader->poll());
    const bool save_now = !tc.checkpoint_dir.empty() &&
                          (s + 1 == tc.steps || (tc.save_every > 0 && (s + 1) % tc.save_every == 0));
    if (save_now) save(s + 1, !tc.async_checkpoint);
    if (ec.profile) {
      auto spans = eng.take_trace();
      trace.insert(trace.end(), std::make_move_iterator(spans.begin()), std::make_move_iterator(spans.end()));
    }
    // The evaluation after the step's log line (every rank takes part: it is collective).
    const bool eval_now = data.eval && ((tc.eval_every > 0 && (s + 1) % tc.eval_every == 0) || s + 1 == tc.steps);
    // Periodic exports (the last step's is run.export itself, after the loop).
    const bool export_now = tc.export_every > 0 && (s + 1) % tc.export_every == 0 && s + 1 < tc.steps;
    if (!lead) {
      if (eval_now) evaluate(s + 1);
      if (export_now) export_model(periodic_export_dir(s + 1), replace_periodic);
      continue;
    }
    if (ec.profile)
      std::cerr << (tc.progress && tty ? "\r\033[K" : "") << timeline_line(s + 1, r) << traffic_line(traffic, r.seconds)
                << "\n";
    if (log.is_open()) {
      nlohmann::json j = {{"step", s + 1},
                          {"optimizer_step", r.step},
                          {"loss", r.loss},
                          {"lr", lr},
                          {"grad_norm", r.grad_norm},
                          {"skipped", r.skipped},
                          {"loss_scale", r.loss_scale},
                          {"seconds", r.seconds},
                          {"tokens", r.tokens},
                          {"loss_tokens", r.loss_tokens},
                          {"tokens_per_s", double(r.tokens) / r.seconds},
                          {"model_tflops", r.model_tflops},
                          {"device_used", mem.device_used},
                          {"device_peak", mem.device_peak},
                          {"host_state", mem.host_state},
                          {"nvme_state", mem.nvme_state},
                          {"peak_rss", peak_rss_bytes()},
                          {"host_activations", mem.host_activations},
                          {"samples_consumed", loader.position()},
                          {"timeline",
                           {{"compute_busy", r.timeline.compute_busy},
                            {"wait_params", r.timeline.wait_params},
                            {"wait_update", r.timeline.wait_update},
                            {"wait_activations", r.timeline.wait_activations},
                            {"wait_grads", r.timeline.wait_grads},
                            {"norm", r.timeline.norm},
                            {"optimizer", r.timeline.optimizer},
                            {"optimizer_exposed", r.timeline.optimizer_exposed},
                            {"wait_checkpoint", r.timeline.wait_checkpoint},
                            {"h2d_bytes", r.timeline.h2d_bytes},
                            {"d2h_bytes", r.timeline.d2h_bytes},
                            {"nvme_read_bytes", r.timeline.nvme_read_bytes},
                            {"nvme_write_bytes", r.timeline.nvme_write_bytes},
                            {"network_bytes", r.timeline.network_bytes},
                            {"nodes", traffic_json(traffic)},
                            {"prefetch", r.timeline.prefetch}}}};
      write_log(j);
    }
    if (tensorboard) {
      const int64_t k = s + 1;
      tensorboard->scalar("train/loss", k, r.loss);
      tensorboard->scalar("train/lr", k, lr);
      tensorboard->scalar("train/grad_norm", k, r.grad_norm);
      tensorboard->scalar("train/tokens_per_s", k, double(r.tokens) / r.seconds);
      tensorboard->scalar("memory/device_peak_bytes", k, double(mem.device_peak));
      tensorboard->scalar("memory/host_state_bytes", k, double(mem.host_state));
      tensorboard->scalar("memory/nvme_state_bytes", k, double(mem.nvme_state));
    }
    if (tc.progress) {
      char line[512];
      snprintf(line, sizeof line,
               "step %lld/%lld [%s] loss %.4f%s | %.0f tok/s | %.3f TFLOPS | device %s peak / %s"
               " | host %s state + %s act | nvme %s",
               (long long)(s + 1), (long long)tc.steps, bar(double(s + 1) / double(tc.steps), 20).c_str(),
               r.loss, r.skipped ? " (skipped)" : "", double(r.tokens) / r.seconds, r.model_tflops,
               format_bytes(mem.device_peak).c_str(),
               mem.device_budget == UINT64_MAX ? "unlimited" : format_bytes(mem.device_budget).c_str(),
               format_bytes(mem.host_state).c_str(), format_bytes(mem.host_activations).c_str(),
               format_bytes(mem.nvme_state).c_str());
      std::cerr << (tty ? "\r\033[K" : "") << line << (tty ? "" : "\n") << std::flush;
    }
    if (eval_now) evaluate(s + 1);
    if (export_now) export_model(periodic_export_dir(s + 1), replace_periodic);
  }
  if (tensorboard) tensorboard->flush();
  if (lead && tc.progress && tty) std::cerr << "\n";
  if (lead && steps_done > first_step)
    std::cerr << "strata train: " << steps_done - first_step << " steps, "
              << (seconds_total > 0 ? tokens_total / seconds_total : 0) << " tokens/s\n";

  committed(checkpointer.finish());
  if (stopped_by != 0) {
    // Every rank stops after the same step; what a checkpoint directory can keep is kept.
    const bool keep = !tc.checkpoint_dir.empty() && steps_done > saved_through;
    if (keep) save(steps_done, /*synchronous=*/true);
  }
  bool final_upload_failed = false;
  if (uploader && uploader->in_flight()) {
    if (lead) std::cerr << "strata train: waiting for the upload to " << uploader->store_url() << "\n";
    const auto url = uploader->finish();
    uploaded(url);
    final_upload_failed = !url;  // the last checkpoint is only local: the run does not end well
  }
  if (stopped_by != 0) {
    if (lead) {
      std::cerr << "strata train: stopped by " << signal_name(stopped_by) << " after step " << steps_done << " of "
                << tc.steps;
      if (tc.checkpoint_dir.empty())
        std::cerr << "; no checkpoint directory (run.checkpoint_dir, --checkpoint-dir): its "
                  << steps_done - first_step << " steps are not saved\n";
      else if (const auto latest = engine::latest_checkpoint(tc.checkpoint_dir))
        std::cerr << "; latest checkpoint " << latest->string() << " (continue with --resume)\n";
      else
        std::cerr << "; nothing was saved in " << tc.checkpoint_dir << "\n";
      if (!tc.export_dir.empty()) std::cerr << "strata train: not exported (the run did not finish)\n";
    }
  }
  if (ec.profile) {
    const std::string path =
        comm->rank() == 0 ? tc.profile_path : tc.profile_path + ".rank" + std::to_string(comm->rank());
    write_trace(path, comm->rank(), trace);
    if (lead) std::cerr << "strata train: trace of " << trace.size() << " spans written to " << path << "\n";
  }
  if (!tc.export_dir.empty() && stopped_by == 0) export_model(tc.export_dir, tc.export_overwrite);
  comm->barrier();
  agreed_stop = stopped_by;
  if (stopped_by == 0 && final_upload_failed) {
    if (lead) std::cerr << "strata train: error: the last checkpoint did not reach " << tc.checkpoint_upload << "\n";
    return 1;
  }
  return stopped_by == 0 ? 0 : 128 + stopped_by;
}

}  // namespace

int train_main(const std::vector<std::string>& argv) {
  const int status = run_training(argv);
  // Stopped by SIGINT: once everything is torn down (swap files removed, I/O drained), end by
  // SIGINT itself, the cooperative exit a shell expects (its loop over runs stops too).
  if (agreed_stop == SIGINT) {
    std::cerr << std::flush;
    die_by(SIGINT);
  }
  return status;
}

}  // namespace strata::cli
