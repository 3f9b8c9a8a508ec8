// `strata train`: the steps and the evaluation passes (train_parts.h).
#include "train_parts.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <chrono>
#include <iterator>
#include <limits>

#include "strata/engine/lr_schedule.h"

namespace strata::cli::train {
namespace {

// Collective: the evaluation pass, every sample of the evaluation data once, through the
// engine's forward; rank 0 reports its loss. `ids` gives the shape of a batch's token ids.
void evaluate(const Run& run, RunLog& log, const at::Tensor& ids, int64_t after_step) {
  if (!run.data.eval) return;
  const auto t0 = std::chrono::steady_clock::now();
  const models::EvalBatches batches(run.data.eval, run.global_batch, run.comm.rank(), run.comm.world_size());
  at::Tensor eval_ids = at::empty_like(ids);
  at::Tensor eval_mask = at::empty({int64_t(batches.local_batch()), run.ec.seq_len}, at::kByte);
  at::Tensor eval_segments;  // packed examples: which example each token is of
  if (run.data.eval->packed()) eval_segments = at::empty({int64_t(batches.local_batch()), run.ec.seq_len}, at::kLong);
  double loss_sum = 0;
  uint64_t tokens = 0;
  for (uint64_t b = 0; b < batches.batches(); ++b) {
    batches.batch(b, eval_ids.data_ptr<int64_t>(), eval_mask.data_ptr<uint8_t>(),
                  eval_segments.defined() ? eval_segments.data_ptr<int64_t>() : nullptr);
    const engine::Engine::EvalResult r = run.eng.evaluate(eval_ids, eval_mask, eval_segments);
    loss_sum += r.loss_sum;
    tokens += r.tokens;
  }
  const double loss = tokens > 0 ? loss_sum / double(tokens) : std::numeric_limits<double>::quiet_NaN();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!run.lead) return;
  log.eval(after_step, loss, tokens, secs);
}

}  // namespace

StepsDone train_steps(const Run& run, Checkpoints& checkpoints, RunLog& log, Exporter& exporter, at::Tensor& ids,
                      int64_t first_step) {
  const engine::TrainConfig& tc = run.tc;
  // Supervised examples: which targets count (engine.h train_step).
  at::Tensor loss_mask;
  if (run.data.train->masked()) loss_mask = at::empty({int64_t(run.loader.local_batch()), run.ec.seq_len}, at::kByte);
  // Packed examples: which example each input token is of; supervised ones: which are padding
  // (engine.h train_step).
  at::Tensor segments;
  if (run.data.train->packed() || run.data.train->masked()) segments = at::empty({int64_t(run.loader.local_batch()), run.ec.seq_len}, at::kLong);
  StepsDone done;
  done.steps = first_step;
  const engine::LrSchedule schedule = tc.schedule();  // a function of the step: resumes exactly
  NodeTrafficSum node_traffic(run.comm, run.env);
  for (int64_t s = first_step; s < tc.steps; ++s) {
    if ((done.stopped_by = agreed_stop_signal(run.comm)) != 0) break;
    run.loader.next(ids.data_ptr<int64_t>(), loss_mask.defined() ? loss_mask.data_ptr<uint8_t>() : nullptr,
                    segments.defined() ? segments.data_ptr<int64_t>() : nullptr);
    const double lr = engine::scheduled_lr(schedule, run.ec.lr, s);
    run.eng.set_learning_rate(lr);
    const engine::StepResult r = run.eng.train_step(ids, loss_mask, segments);
    const engine::MemoryReport mem = run.eng.memory();
    const std::vector<NodeTraffic> traffic = node_traffic(r.timeline);
    done.tokens_total += double(r.tokens);
    done.seconds_total += r.seconds;
    done.steps = s + 1;
    checkpoints.after_step(s + 1);
    if (run.ec.profile) {
      auto spans = run.eng.take_trace();
      done.trace.insert(done.trace.end(), std::make_move_iterator(spans.begin()), std::make_move_iterator(spans.end()));
    }
    // The evaluation after the step's log line (every rank takes part: it is collective).
    const bool eval_now = run.data.eval && ((tc.eval_every > 0 && (s + 1) % tc.eval_every == 0) || s + 1 == tc.steps);
    // Periodic exports (the last step's is run.export itself, after the loop).
    const bool export_now = exporter.periodic_due(s + 1);
    if (run.lead) log.step(s + 1, lr, r, mem, traffic);
    if (eval_now) evaluate(run, log, ids, s + 1);
    if (export_now) exporter.export_periodic(s + 1);
  }
  return done;
}

}  // namespace strata::cli::train
