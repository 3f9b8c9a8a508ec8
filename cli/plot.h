// `strata plot`: a PNG of a training run from its JSONL log (`strata train --log`), with no
// plotting library: four panels (loss and eval loss, learning rate, tokens/s, memory per tier)
// rasterized here with an embedded bitmap font and encoded with libpng.
//
// Contract
//   - The log: one JSON object per line; {"event":"start",...} lines (one per run or resume),
//     step lines {"step":N,"loss":..,"lr":..,"tokens_per_s":..,"device_peak":..,"host_state":..,
//     "nvme_state":.. (bytes),"skipped":..} and {"event":"eval","step":N,"eval_loss":x}. A
//     resumed run appends to the log, so a step may appear twice: the later line wins. Other
//     events and unknown keys are ignored; a missing or null value (JSON has no NaN) leaves a
//     gap in its series. Blank lines are skipped.
//   - Errors throw std::runtime_error: a log that cannot be read or has no step lines (naming
//     its path), a line that is not a JSON object or has a value of the wrong type (naming the
//     path and the line number), an output that cannot be written (naming its path).
//   - Stateless functions; safe to call from several threads on different files.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace strata::cli {

// The values of one step; NaN where the log had none.
struct StepPoint {
  double loss, lr, tokens_per_s;
  double device_peak, host_state, nvme_state;  // bytes
  bool skipped = false;
};

struct TrainingLog {
  std::map<int64_t, StepPoint> steps;  // by step, the last line for each
  std::map<int64_t, double> eval_loss;  // by step, the last eval line for each
  int starts = 0;  // start lines: 1 + the number of resumes
};

TrainingLog read_training_log(const std::filesystem::path& jsonl);

// Draws `log` (which must have at least one step) into a 1200 x 900 RGB PNG at `png`. A regular
// file is replaced atomically (written to `png`.tmp<pid> beside it, then renamed): when the write
// fails, the previous file is left as it was. A pipe or device is written in place.
void render_training_log(const TrainingLog& log, const std::filesystem::path& png);

// read_training_log + render_training_log.
void plot_training_log(const std::filesystem::path& jsonl, const std::filesystem::path& png);

// `strata plot LOG.jsonl -o OUT.png` (arguments after "plot"). Returns the exit status: 0, 1 on
// an error (reported on stderr), 2 on bad arguments (with the usage).
int plot_main(const std::vector<std::string>& args);

inline constexpr int kPlotWidth = 1200;
inline constexpr int kPlotHeight = 900;

}  // namespace strata::cli
