// `strata train`: the command line, `--plan`, the stop signals and run_training, which calls the
// phases of a run (train_parts.h) in order.
#include "train.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include "args.h"
#include "strata/engine/checkpoint.h"
#include "strata/engine/comm.h"
#include "strata/engine/config.h"
#include "strata/engine/config_parse.h"
#include "strata/engine/cpu_share.h"
#include "strata/engine/device.h"
#include "strata/engine/engine.h"
#include "train_parts.h"

namespace strata::cli {
namespace train {
namespace {

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
                     directory without any committed checkpoint starts at step 0 (said so);
                     where `latest` cannot be followed (missing, or naming a checkpoint a power
                     cut left incomplete), the newest complete checkpoint, saying why
  --resume-from DIR  start from this committed checkpoint directory or stored checkpoint URL
                     (s3://bucket/prefix/step-N; the checkpoint directory is then its parent
                     unless --checkpoint-dir names another; refused if the run would save over
                     the checkpoint that directory's `latest` names)
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

int agreed_stop = 0;  // the signal every rank agreed to stop on (0: none)

}  // namespace

// The signal any rank got, agreed by all of them (0: go on). Collective.
int agreed_stop_signal(engine::Communicator& comm) {
  at::Tensor s = at::tensor({double(stop_signal.load())}, at::TensorOptions().dtype(at::kDouble));
  comm.all_reduce(s, engine::ReduceOp::kMax);
  return int(s.item<double>());
}

namespace {

// What the command line asks for.
struct TrainArgs {
  engine::TrainConfig tc;                   // the configuration with the options' overrides
  std::optional<std::string> resume_from;  // --resume-from
  bool plan = false;                        // --plan
};

bool wants_help(const std::vector<std::string>& argv) {
  for (const auto& a : argv)
    if (a == "--help" || a == "-h") return true;
  return false;
}

// The configuration (--config, else the defaults) with the options' overrides. Throws for an
// unknown option, a bad value, or run.export_every without run.export.
TrainArgs parse_train_args(const std::vector<std::string>& argv) {
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
  std::optional<std::string> resume_from;
  if (args.has("resume-from")) resume_from = args.get("resume-from", "");
  return TrainArgs{std::move(tc), std::move(resume_from), args.has("plan")};
}

// Meets the other ranks: this rank's share of the node's cores for its compute is set before
// any op runs (cpu_share.h), rank 0 prints the stop messages, and a failed collective ends this
// rank at once, with the error: the world is broken, and unwinding would first join threads (an
// asynchronous save, the updater) that may wait on peers until the timeout, printing nothing
// meanwhile. The log is flushed line by line and the last committed checkpoint stays loadable.
std::unique_ptr<engine::Communicator> join_world(engine::TrainConfig& tc, const engine::DistEnv& env) {
  if (env.local_world_size > 0) tc.engine.local_ranks = env.local_world_size;
  engine::apply_compute_threads(env.local_world_size > 0 ? env.local_world_size : env.world_size);
  stop_messages = env.rank == 0;
  auto comm = engine::Communicator::create(
      env, std::chrono::milliseconds(int64_t(tc.engine.timeout_s * 1000)), tc.engine.device == "cuda");
  comm->set_failure_handler([rank = comm->rank()](const std::string& what) {
    std::cerr << "strata: error: rank " << rank << ": " << what << "\n" << std::flush;
    _exit(1);
  });
  return comm;
}

// Rank 0, after a run stopped by a signal: after which step, and where it can continue from.
void report_stop(const engine::TrainConfig& tc, const StepsDone& done, int64_t first_step) {
  std::cerr << "strata train: stopped by " << signal_name(done.stopped_by) << " after step " << done.steps << " of "
            << tc.steps;
  if (tc.checkpoint_dir.empty())
    std::cerr << "; no checkpoint directory (run.checkpoint_dir, --checkpoint-dir): its "
              << done.steps - first_step << " steps are not saved\n";
  else if (const auto latest = engine::latest_checkpoint(tc.checkpoint_dir))
    std::cerr << "; latest checkpoint " << latest->string() << " (continue with --resume)\n";
  else
    std::cerr << "; nothing was saved in " << tc.checkpoint_dir << "\n";
  if (!tc.export_dir.empty()) std::cerr << "strata train: not exported (the run did not finish)\n";
}

// The run once its engine is built: room for the outputs, the resume point loaded, the steps,
// then what ends the run (the last saves and uploads, the trace, the export). Returns the exit
// status.
int train_with_engine(const Run& run, const ResumePoint& resume, const std::string& export_store) {
  const engine::TrainConfig& tc = run.tc;
  check_checkpoint_space(tc, run.mc);
  const at::ScalarType export_type = export_dtype(tc, run.ec);
  if (run.lead) check_export_space(tc, run.mc, export_type, !export_store.empty(), run.comm.world_size());
  const engine::MemoryReport m0 = run.eng.memory();
  const Start start = load_resume_point(run, resume);
  Checkpoints checkpoints(run, start.first_step);
  RunLog log(run, start, m0);
  checkpoints.on_commit([&log](const std::filesystem::path& dir) { log.committed(dir); });
  at::Tensor ids = at::empty({int64_t(run.loader.local_batch()), run.ec.seq_len + 1}, at::kLong);
  Exporter exporter(run, export_type, export_store, start.first_step);
  exporter.check_periodic_dirs();
  const StepsDone done = train_steps(run, checkpoints, log, exporter, ids, start.first_step);

  log.finish(start.first_step, done);
  const bool final_upload_failed = checkpoints.finish(done.stopped_by, done.steps);
  if (done.stopped_by != 0 && run.lead) report_stop(tc, done, start.first_step);
  if (run.ec.profile) write_profile(run, done.trace);
  if (!tc.export_dir.empty() && done.stopped_by == 0) exporter.export_model(tc.export_dir, tc.export_overwrite);
  run.comm.barrier();
  agreed_stop = done.stopped_by;
  if (done.stopped_by == 0 && final_upload_failed) {
    if (run.lead) std::cerr << "strata train: error: the last checkpoint did not reach " << tc.checkpoint_upload << "\n";
    return 1;
  }
  return done.stopped_by == 0 ? 0 : 128 + done.stopped_by;
}

int run_training(const std::vector<std::string>& argv) {
  if (wants_help(argv)) {
    std::cout << kTrainUsage;
    return 0;
  }
  TrainArgs args = parse_train_args(argv);
  if (args.plan) return plan_main(args.tc);
  engine::TrainConfig& tc = args.tc;
  catch_stop_signals();
  tc.engine.profile = !tc.profile_path.empty();
  if (tc.resume && tc.checkpoint_dir.empty() && !args.resume_from)
    throw std::invalid_argument("--resume needs a checkpoint directory (--checkpoint-dir or run.checkpoint_dir)");
  tier_checkpoints(tc);
  // Before anything is built: what the run starts from, and whether its outputs can be written.
  const engine::DistEnv env = engine::DistEnv::from_env();
  const ResumeRequest request = choose_resume_point(tc, env, args.resume_from);
  if (!tc.checkpoint_dir.empty()) check_writable(tc.checkpoint_dir, "checkpoint directory");
  if (!tc.tensorboard_dir.empty()) check_writable(tc.tensorboard_dir, "TensorBoard directory");
  const std::string export_store = prepare_export(tc);

  const std::unique_ptr<engine::Communicator> comm = join_world(tc, env);
  const bool lead = comm->rank() == 0;
  const ResumePoint resume = agree_on_resume_point(*comm, tc, env, request, lead);
  const std::unique_ptr<engine::Device> device =
      engine::Device::create(tc.engine.device, env.local_rank, tc.engine.device_budget);
  fetch_init_model(tc, env, *comm, lead);
  std::unique_ptr<models::Decoder> model = make_model(tc);
  const std::string frozen_base = frozen_base_of(tc);
  const models::ModelConfig mc = model->config();
  const DataSources data = open_data(tc, uint64_t(mc.vocab_size), lead);
  const uint64_t global_batch =
      uint64_t(tc.engine.micro_batch * tc.engine.grad_accum) * uint64_t(comm->world_size());
  models::BatchLoader loader(data.train, global_batch, comm->rank(), comm->world_size(), tc.data_seed);
  if (lead && tc.progress) tc.engine.on_unit_placed = placement_progress();
  engine::Engine eng(std::move(model), tc.engine, *comm, *device);
  const Run run{tc, env, *comm, *device, eng, eng.config(), mc, data, loader, global_batch, lead, frozen_base};
  return train_with_engine(run, resume, export_store);
}

}  // namespace
}  // namespace train

int train_main(const std::vector<std::string>& argv) {
  const int status = train::run_training(argv);
  // Stopped by SIGINT: once everything is torn down (swap files removed, I/O drained), end by
  // SIGINT itself, the cooperative exit a shell expects (its loop over runs stops too).
  if (train::agreed_stop == SIGINT) {
    std::cerr << std::flush;
    train::die_by(SIGINT);
  }
  return status;
}

}  // namespace strata::cli
