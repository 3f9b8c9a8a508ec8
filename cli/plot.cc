// `strata plot`: reading a training run's JSONL log, and the command. The drawing is in
// plot_render.cc (panels, axes) and plot_canvas.cc (font, canvas, PNG).
#include "plot.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iostream>
#include <stdexcept>
#include <string>
#include <nlohmann/json.hpp>

#include "plot_internal.h"

namespace strata::cli {

using plot_detail::kNaN;

namespace {

// --- The log ---------------------------------------------------------------------------------

[[noreturn]] void bad_line(const std::filesystem::path& p, size_t line, const std::string& why) {
  throw std::runtime_error(p.string() + ":" + std::to_string(line) + ": " + why);
}

// A missing key or null (how nlohmann::json writes NaN and infinities) is "no value".
double number_or_nan(const nlohmann::json& j, const char* key, const std::filesystem::path& p, size_t line) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return kNaN;
  if (!it->is_number()) bad_line(p, line, std::string("\"") + key + "\" is not a number");
  return it->get<double>();
}

int64_t step_of(const nlohmann::json& j, const std::filesystem::path& p, size_t line) {
  auto it = j.find("step");
  if (it == j.end()) bad_line(p, line, "no \"step\"");
  if (!it->is_number_integer()) bad_line(p, line, "\"step\" is not an integer");
  return it->get<int64_t>();
}

}  // namespace

TrainingLog read_training_log(const std::filesystem::path& jsonl) {
  std::error_code ec;
  if (std::filesystem::is_directory(jsonl, ec)) throw std::runtime_error("cannot read " + jsonl.string() + ": is a directory");
  std::ifstream in(jsonl);
  if (!in) throw std::runtime_error("cannot read " + jsonl.string() + ": " + std::strerror(errno));
  TrainingLog log;
  std::string text;
  for (size_t line = 1; std::getline(in, text); ++line) {
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error& e) {
      bad_line(jsonl, line, std::string("not JSON (") + e.what() + ")");
    }
    if (!j.is_object()) bad_line(jsonl, line, "not a JSON object");
    if (auto ev = j.find("event"); ev != j.end()) {
      if (!ev->is_string()) bad_line(jsonl, line, "\"event\" is not a string");
      if (*ev == "start") {
        ++log.starts;
      } else if (*ev == "eval") {
        const int64_t step = step_of(j, jsonl, line);
        log.eval_loss[step] = number_or_nan(j, "eval_loss", jsonl, line);
      }  // other events (checkpoints, ...) do not go in the plot
      continue;
    }
    if (!j.contains("step")) bad_line(jsonl, line, "neither a step (no \"step\") nor an event (no \"event\")");
    StepPoint pt;
    pt.loss = number_or_nan(j, "loss", jsonl, line);
    pt.lr = number_or_nan(j, "lr", jsonl, line);
    pt.tokens_per_s = number_or_nan(j, "tokens_per_s", jsonl, line);
    pt.device_peak = number_or_nan(j, "device_peak", jsonl, line);
    pt.host_state = number_or_nan(j, "host_state", jsonl, line);
    pt.nvme_state = number_or_nan(j, "nvme_state", jsonl, line);
    if (auto sk = j.find("skipped"); sk != j.end() && !sk->is_null()) {
      if (!sk->is_boolean()) bad_line(jsonl, line, "\"skipped\" is not true or false");
      pt.skipped = sk->get<bool>();
    }
    log.steps[step_of(j, jsonl, line)] = pt;  // a resumed run's later line replaces the earlier
  }
  if (in.bad()) throw std::runtime_error("cannot read " + jsonl.string() + ": " + std::strerror(errno));
  if (log.steps.empty()) throw std::runtime_error(jsonl.string() + " has no step lines: nothing to plot");
  return log;
}

void plot_training_log(const std::filesystem::path& jsonl, const std::filesystem::path& png) {
  render_training_log(read_training_log(jsonl), png);
}

int plot_main(const std::vector<std::string>& args) {
  constexpr const char* kUsage = R"(usage: strata plot LOG.jsonl -o OUT.png

Draws a training run's log (`strata train --log`) into a 1200 x 900 PNG: loss and eval loss,
learning rate, tokens/s and memory per tier (device peak, host state, NVMe state) by step.
When a resumed run repeated steps, the later lines are drawn.
)";
  std::string log, out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "-h" || a == "--help") {
      std::cout << kUsage;
      return 0;
    }
    if (a == "-o" || a == "--output") {
      if (i + 1 == args.size()) {
        std::cerr << "strata plot: " << a << " needs a file name\n" << kUsage;
        return 2;
      }
      out = args[++i];
    } else if (a.rfind("--output=", 0) == 0) {
      out = a.substr(9);
    } else if (a.size() > 1 && a[0] == '-') {
      std::cerr << "strata plot: unknown option " << a << "\n" << kUsage;
      return 2;
    } else if (log.empty()) {
      log = a;
    } else {
      std::cerr << "strata plot: one log at a time (" << log << ", " << a << ")\n" << kUsage;
      return 2;
    }
  }
  if (log.empty() || out.empty()) {
    std::cerr << "strata plot: " << (log.empty() ? "no log given" : "no output given (-o OUT.png)") << "\n" << kUsage;
    return 2;
  }
  try {
    const TrainingLog tl = read_training_log(log);
    render_training_log(tl, out);
    std::cerr << "strata plot: wrote " << out << " (" << tl.steps.size() << " steps, " << tl.eval_loss.size()
              << " eval points)\n";
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "strata plot: " << e.what() << "\n";
    return 1;
  }
}

}  // namespace strata::cli
