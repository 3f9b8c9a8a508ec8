// `strata train`: what rank 0 reports of a run (train_parts.h): the banner, the JSON-lines log,
// TensorBoard scalars, the progress line, the per-step timeline and the Chrome trace.
#include "train_parts.h"

#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <stdexcept>
#include <string>
#include <utility>

#include <unistd.h>

#include "strata/engine/bytes.h"

namespace strata::cli::train {
namespace {

using engine::format_bytes;

// The process's peak resident set (VmHWM), in bytes; 0 where /proc does not say.
uint64_t peak_rss_bytes() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::stoull(line.substr(6)) * 1024;  // kB
  return 0;
}

// A 4-bit base's line of the banner: its settings, and whether init_from holds it saved in 4 bits
// (read as saved) or in 16 bits (quantized at load). "" without one.
std::string quantized_base_line(const engine::TrainConfig& tc, const models::ModelConfig& mc) {
  if (!mc.quantize.enabled()) return "";
  bool saved = false;
  if (std::ifstream in(std::filesystem::path(tc.init_from) / "config.json"); !tc.init_from.empty() && in) {
    const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
    saved = j.is_object() && j.contains("quantization_config");
  }
  return "\n  base: in 4 bits (" + mc.quantize.describe() + "), " +
         (saved ? "read as init_from saved it" : "quantized at load");
}

// A mixture of experts' least and most chosen expert over its sparse blocks, as shares of their
// block's choices (StepResult::expert_shares).
std::pair<double, double> expert_share_range(const engine::StepResult& r) {
  double least = 1, most = 0;
  for (const auto& block : r.expert_shares)
    for (double s : block) {
      least = std::min(least, s);
      most = std::max(most, s);
    }
  return {least, most};
}

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

}  // namespace

NodeTrafficSum::NodeTrafficSum(engine::Communicator& comm, const engine::DistEnv& env)
    : comm_(comm), node_(std::max(env.node, 0)) {
  if (comm.world_size() <= 1) return;
  at::Tensor highest = at::full({1}, node_, at::kLong);
  comm.all_reduce(highest, engine::ReduceOp::kMax);
  nodes_ = highest.item<int64_t>() + 1;
}

std::vector<NodeTraffic> NodeTrafficSum::operator()(const engine::StepTimeline& t) {
  if (comm_.world_size() <= 1 || nodes_ <= 1) return {};
  // Per node: ranks, swap reads, swap writes, network bytes.
  at::Tensor table = at::zeros({nodes_ * 4}, at::kLong);
  int64_t* mine = table.data_ptr<int64_t>() + 4 * node_;
  mine[0] = 1, mine[1] = int64_t(t.nvme_read_bytes), mine[2] = int64_t(t.nvme_write_bytes);
  mine[3] = int64_t(t.network_bytes);
  comm_.all_reduce(table, engine::ReduceOp::kSum);
  const int64_t* a = table.data_ptr<int64_t>();
  std::vector<NodeTraffic> out;
  for (int64_t n = 0; n < nodes_; ++n, a += 4)
    if (a[0] > 0) out.push_back({n, uint64_t(a[1]), uint64_t(a[2]), uint64_t(a[3])});
  if (out.size() <= 1) return {};
  return out;
}

std::function<void(size_t, size_t)> placement_progress() {
  const auto t0 = std::chrono::steady_clock::now();
  return [t0, tty = bool(isatty(STDERR_FILENO))](size_t done, size_t total) {
    if (!tty && done * 10 / total == (done - 1) * 10 / total && done != total) return;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    char secs[32];  // formatted here: std::cerr's precision stays as it was
    std::snprintf(secs, sizeof secs, "%.1f", s);
    std::cerr << (tty ? "\r\033[K" : "") << "strata train: placing the initial weights: unit " << done << "/"
              << total << " (" << secs << " s)" << (done == total || !tty ? "\n" : "") << std::flush;
  };
}

RunLog::RunLog(const Run& run, const Start& start, const engine::MemoryReport& m0) : run_(run) {
  if (run.lead && !run.tc.log_path.empty()) open_log(start);
  if (run.lead) print_banner(start, m0);
  tty_ = isatty(STDERR_FILENO);
  if (run.lead && !run.tc.tensorboard_dir.empty()) tensorboard_ = std::make_unique<TensorBoardWriter>(run.tc.tensorboard_dir);
}

void RunLog::write(const nlohmann::json& line) {
  errno = 0;
  log_ << line.dump() << "\n" << std::flush;
  if (!log_)
    throw std::runtime_error("cannot write the log " + run_.tc.log_path + (errno ? std::string(": ") + std::strerror(errno) : ""));
}

// Its start line: the run's shape, placement and data.
void RunLog::open_log(const Start& start) {
  const engine::TrainConfig& tc = run_.tc;
  const engine::EngineConfig& ec = run_.ec;
  const engine::Engine& eng = run_.eng;
  log_.open(tc.log_path, start.first_step > 0 ? std::ios::app : std::ios::trunc);
  if (!log_) throw std::runtime_error("cannot write the log " + tc.log_path);
  nlohmann::json line = {
      {"event", "start"},
      {"model", run_.mc.name},
      {"parameters", run_.mc.parameters()},
      {"active_parameters", run_.mc.active_parameters()},
      {"world_size", run_.comm.world_size()},
      {"launcher", run_.env.launcher},
      {"global_batch", run_.global_batch},
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
      {"device", run_.device.description()},
      {"device_budget", ec.device_budget},
      {"data", run_.data.train->description()},
      {"data_packed", run_.data.train->packed()},
      // Real tokens over window tokens (seq_len + 1 per sample): what packing (or padding) leaves.
      {"packing_efficiency", double(run_.data.train->real_tokens()) /
                                 double((uint64_t(ec.seq_len) + 1) * run_.data.train->size())},
      {"eval_data", run_.data.eval ? run_.data.eval->description() : ""},
      {"resumed_from", start.resumed_from},
      {"resume_note", start.resume_note},
      {"load_seconds", start.load_seconds},
      {"first_step", start.first_step + 1}};
  write(line);
}

void RunLog::print_banner(const Start& start, const engine::MemoryReport& m0) const {
  const models::ModelConfig& mc = run_.mc;
  const engine::EngineConfig& ec = run_.ec;
  const DataSources& data = run_.data;
  std::cerr << "strata train: " << mc.name << " (" << mc.parameters() / 1e6 << "M parameters, "
            << (mc.moe.enabled() ? std::to_string(mc.active_parameters() / 1000000) + "M active, " : std::string())
            << mc.layers << " layers), world " << run_.comm.world_size()
            << (run_.env.launcher == "none" ? "" : " (" + run_.env.launcher + ")") << ", global batch "
            << run_.global_batch << " x " << ec.seq_len << " tokens, " << to_string(ec.compute)
            << " compute" << quantized_base_line(run_.tc, mc) << "\n  " << run_.eng.placement_report() << "\n  device: " << run_.device.description() << ", budget "
            << (ec.device_budget == UINT64_MAX ? "unlimited" : format_bytes(ec.device_budget))
            << ", " << format_bytes(m0.device_used) << " of state on it; host state "
            << format_bytes(m0.host_state) << ", NVMe state " << format_bytes(m0.nvme_state)
            << " per rank\n  data: " << data.train->description()
            << (data.eval ? "\n  evaluation: " + data.eval->description() : std::string()) << "\n";
  if (!start.resumed_from.empty())
    std::cerr << "  resumed from " << start.resumed_from << " after step " << start.first_step << " (loaded in "
              << start.load_seconds << " s)\n";
}

void RunLog::step(int64_t step, double lr, const engine::StepResult& r, const engine::MemoryReport& mem,
                  const std::vector<NodeTraffic>& traffic) {
  if (run_.ec.profile)
    std::cerr << (run_.tc.progress && tty_ ? "\r\033[K" : "") << timeline_line(step, r)
              << traffic_line(traffic, r.seconds) << "\n";
  if (log_.is_open()) write(step_line(step, lr, r, mem, traffic));
  if (tensorboard_) step_scalars(step, lr, r, mem);
  if (run_.tc.progress) print_progress(step, r, mem);
}

nlohmann::json RunLog::step_line(int64_t step, double lr, const engine::StepResult& r,
                                 const engine::MemoryReport& mem, const std::vector<NodeTraffic>& traffic) const {
  nlohmann::json line = step_fields(step, lr, r, mem, traffic);
  if (!r.expert_shares.empty()) {  // a mixture of experts: its load balance
    const auto [least, most] = expert_share_range(r);
    line["aux_loss"] = r.aux_loss;
    line["expert_share_min"] = least;
    line["expert_share_max"] = most;
  }
  return line;
}

nlohmann::json RunLog::step_fields(int64_t step, double lr, const engine::StepResult& r,
                                   const engine::MemoryReport& mem, const std::vector<NodeTraffic>& traffic) const {
  return {{"step", step},
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
          {"samples_consumed", run_.loader.position()},
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
}

void RunLog::step_scalars(int64_t step, double lr, const engine::StepResult& r, const engine::MemoryReport& mem) {
  tensorboard_->scalar("train/loss", step, r.loss);
  tensorboard_->scalar("train/lr", step, lr);
  tensorboard_->scalar("train/grad_norm", step, r.grad_norm);
  tensorboard_->scalar("train/tokens_per_s", step, double(r.tokens) / r.seconds);
  tensorboard_->scalar("memory/device_peak_bytes", step, double(mem.device_peak));
  tensorboard_->scalar("memory/host_state_bytes", step, double(mem.host_state));
  tensorboard_->scalar("memory/nvme_state_bytes", step, double(mem.nvme_state));
  if (r.expert_shares.empty()) return;
  tensorboard_->scalar("train/aux_loss", step, r.aux_loss);
  // Each sparse block's experts by the share of its top-k choices they received: a block whose
  // routing collapses shows a few experts far right and many at 0.
  for (size_t b = 0; b < r.expert_shares.size(); ++b)
    tensorboard_->histogram("experts/share.sparse_block_" + std::to_string(b), step, r.expert_shares[b]);
}

void RunLog::print_progress(int64_t step, const engine::StepResult& r, const engine::MemoryReport& mem) const {
  const int64_t steps = run_.tc.steps;
  char line[512];
  snprintf(line, sizeof line,
           "step %lld/%lld [%s] loss %.4f%s | %.0f tok/s | %.3f TFLOPS | device %s peak / %s"
           " | host %s state + %s act | nvme %s",
           (long long)step, (long long)steps, bar(double(step) / double(steps), 20).c_str(),
           r.loss, r.skipped ? " (skipped)" : "", double(r.tokens) / r.seconds, r.model_tflops,
           format_bytes(mem.device_peak).c_str(),
           mem.device_budget == UINT64_MAX ? "unlimited" : format_bytes(mem.device_budget).c_str(),
           format_bytes(mem.host_state).c_str(), format_bytes(mem.host_activations).c_str(),
           format_bytes(mem.nvme_state).c_str());
  std::string moe;
  if (!r.expert_shares.empty()) {
    const auto [least, most] = expert_share_range(r);
    char part[128];
    snprintf(part, sizeof part, " | aux %.4f, experts %.3f-%.3f", r.aux_loss, least, most);
    moe = part;
  }
  std::cerr << (tty_ ? "\r\033[K" : "") << line << moe << (tty_ ? "" : "\n") << std::flush;
}

void RunLog::eval(int64_t after_step, double loss, uint64_t tokens, double secs) {
  const DataSources& data = run_.data;
  // Formatted here: the stream's precision is whatever an earlier report left it at.
  char line[256];
  snprintf(line, sizeof line, "eval after step %lld: loss %.4f (%llu samples, %llu targets, %.2f s)",
           (long long)after_step, loss, (unsigned long long)data.eval->size(), (unsigned long long)tokens, secs);
  std::cerr << (run_.tc.progress && isatty(STDERR_FILENO) ? "\r\033[K" : "") << "strata train: " << line << "\n";
  if (log_.is_open())
    write({{"event", "eval"}, {"step", after_step}, {"eval_loss", loss}, {"eval_samples", data.eval->size()},
           {"eval_tokens", tokens}, {"seconds", secs}});
  if (tensorboard_) tensorboard_->scalar("eval/loss", after_step, loss);
}

void RunLog::committed(const std::filesystem::path& dir) {
  if (log_.is_open()) write({{"event", "committed"}, {"checkpoint", dir.string()}});
}

void RunLog::finish(int64_t first_step, const StepsDone& done) {
  if (tensorboard_) tensorboard_->flush();
  if (run_.lead && run_.tc.progress && tty_) std::cerr << "\n";
  if (run_.lead && done.steps > first_step) {
    char rate[64];
    snprintf(rate, sizeof rate, "%.1f", done.seconds_total > 0 ? done.tokens_total / done.seconds_total : 0.0);
    std::cerr << "strata train: " << done.steps - first_step << " steps, " << rate << " tokens/s\n";
  }
}

void write_profile(const Run& run, const std::vector<engine::TraceSpan>& trace) {
  const engine::TrainConfig& tc = run.tc;
  const std::string path =
      run.comm.rank() == 0 ? tc.profile_path : tc.profile_path + ".rank" + std::to_string(run.comm.rank());
  write_trace(path, run.comm.rank(), trace);
  if (run.lead) std::cerr << "strata train: trace of " << trace.size() << " spans written to " << path << "\n";
}

}  // namespace strata::cli::train
