// The engine's public API over Engine::Impl (engine_impl.h).
#include "engine_impl.h"
#include "runtime/quant4_record.h"
#include "strata/kernels/quant4.h"
#include "runtime/step_inputs.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace strata::engine {
namespace {
// The state accessors serve the kinds a checkpoint saves (master and moments), nothing else.
int saved_kind(state::Kind kind) {
  if (int(kind) < 0 || int(kind) >= state::kSavedKinds)
    throw std::invalid_argument("state kind " + std::to_string(int(kind)) + " is not saved: master, exp_avg or exp_avg_sq");
  return int(kind);
}
}  // namespace

Engine::Engine(std::unique_ptr<models::Decoder> model, const EngineConfig& config,
               Communicator& comm, Device& device)
    : impl_(std::make_unique<Impl>(std::move(model), config, comm, device)) {
  impl_->prof.tracing = config.profile;
}

const EngineConfig& Engine::config() const { return impl_->effective; }
const std::string& Engine::placement_report() const { return impl_->placement_report; }
size_t Engine::optimizer_device_units() const { return impl_->state->plan().device_units; }
size_t Engine::optimizer_host_units() const { return impl_->state->plan().host_units; }
bool Engine::gradients_stored() const { return !impl_->state->plan().grads_transient; }

std::vector<TraceSpan> Engine::take_trace() {
  std::lock_guard<std::mutex> lock(impl_->prof.mu);
  return std::exchange(impl_->prof.spans, {});
}

Engine::~Engine() {
  if (!impl_) return;
  impl_->abort_update();
  impl_->holds->wait_all();  // a snapshot still copying the state out (from swap files that go with us)
  // Activation checkpoint writes (a step that failed half way) must finish before their buffers go.
  // (Only those whose host function ran: a failed CUDA stream may never run the others.)
  for (Stream* st : {&impl_->dev.h2d_stream(), &impl_->dev.d2h_stream()}) try {
      impl_->dev.synchronize(*st);
    } catch (...) {
    }
  impl_->activations.reset();
  impl_->reducer.reset();  // waits for its swap writes
  impl_->params.reset();  // gathers in flight finish before their buffers go
}

StepResult Engine::train_step(const at::Tensor& ids) { return train_step(ids, at::Tensor()); }

StepResult Engine::train_step(const at::Tensor& ids, const at::Tensor& loss_mask) {
  return train_step(ids, loss_mask, at::Tensor());
}

StepResult Engine::train_step(const at::Tensor& ids, const at::Tensor& loss_mask, const at::Tensor& segments) {
  if (impl_->cfg.plan_only) throw std::logic_error("Engine: constructed with plan_only: it holds no state to train");
  impl_->check_usable();
  // Rejected before anything changes.
  runtime::check_step_inputs(ids, loss_mask, segments, impl_->cfg.grad_accum * impl_->cfg.micro_batch, impl_->cfg.seq_len);
  try {
    return impl_->train_step(ids, loss_mask, segments);
  } catch (...) {
    impl_->fail_step();
    throw;
  }
}

Engine::EvalResult Engine::evaluate(const at::Tensor& ids, const at::Tensor& loss_mask, const at::Tensor& segments) {
  if (impl_->cfg.plan_only) throw std::logic_error("Engine: constructed with plan_only: it holds no state to evaluate");
  impl_->check_usable();
  if (ids.dim() != 2 || ids.size(0) == 0 || ids.size(0) % impl_->cfg.micro_batch != 0)
    throw std::invalid_argument("evaluate: ids must have a positive multiple of micro_batch = " +
                                std::to_string(impl_->cfg.micro_batch) + " rows");
  runtime::check_step_inputs(ids, loss_mask, segments, ids.size(0), impl_->cfg.seq_len);
  try {
    return impl_->evaluate(ids, loss_mask, segments);
  } catch (...) {
    impl_->fail_step();  // gathers may be half done
    throw;
  }
}

void Engine::set_learning_rate(double lr) {
  if (!(lr >= 0) || !std::isfinite(lr))
    throw std::invalid_argument("Engine::set_learning_rate: " + std::to_string(lr) + " is not a finite rate >= 0");
  impl_->lr = lr;
}

std::vector<std::pair<std::string, at::Tensor>> Engine::gather_parameters() {
  std::vector<std::pair<std::string, at::Tensor>> out;
  std::map<std::string, size_t> whole;  // a tiled tensor's place in `out`
  Impl& I = *impl_;
  I.finish_update();
  // Read, not written: a checkpoint's hold need not be waited for (read_state), only the device
  // update queued on the compute stream.
  if (!I.units_where(true).empty()) I.dev.synchronize(I.dev.compute_stream());
  for (size_t u = 0; u < I.partition->num_units(); ++u) {
    const UnitLayout& L = I.partition->unit(u);
    // A unit holding 4-bit records (model.quantize) is gathered as its compute copy's bytes, each
    // record dequantized as a binding does it (then fp32).
    const bool records = std::any_of(L.tensors.begin(), L.tensors.end(), [](const TensorSlot& t) { return t.quantized; });
    const at::ScalarType gathered = records ? I.cdt : at::kFloat;
    at::Tensor full = at::empty({int64_t(L.padded_numel())}, at::TensorOptions().dtype(gathered));
    at::Tensor mine = I.host_buffer(L.shard_numel, gathered);  // aligned: swap reads go direct
    if (records) I.state->read(u, state::kCompute, 0, mine).get();
    else read_state(u, state::kMaster, 0, L.shard_numel, mine.data_ptr<float>());
    I.comm.all_gather(full, mine)->wait();
    for (const TensorSlot& s : L.tensors) {
      const at::Tensor slot = full.narrow(0, int64_t(s.offset), int64_t(s.numel));
      at::Tensor part;
      if (s.quantized) {
        const models::QuantizedBase& q = I.model->config().quantize;
        part = at::empty(s.shape, at::TensorOptions().dtype(I.cdt));
        Device::dequantize_4bit_on_host(runtime::quant4_view(slot, uint64_t(part.numel()), q),
                                        kernels::quant4_from_string(q.quant_type), q.blocksize, part);
        part = part.to(at::kFloat);
      } else {
        part = slot.view(s.shape).to(at::kFloat);
      }
      if (!s.origin.is_part()) {
        out.emplace_back(s.name, part.clone());
        continue;
      }
      auto it = whole.find(s.origin.whole);
      if (it == whole.end()) {
        it = whole.emplace(s.origin.whole, out.size()).first;
        out.emplace_back(s.origin.whole, at::empty(s.origin.whole_shape, at::kFloat));
      }
      out[it->second].second.narrow(s.origin.dim, s.origin.begin, s.shape[size_t(s.origin.dim)]).copy_(part);
    }
  }
  return out;
}

Engine::Counters Engine::counters() const {
  return {impl_->step, impl_->loss_scaler.scale(), impl_->loss_scaler.good_steps()};
}

void Engine::set_counters(const Counters& c) {
  impl_->step = c.step;
  impl_->loss_scaler.restore(c.loss_scale, c.good_steps);
}

at::Tensor Engine::state_slice(size_t unit, state::Kind kind) {
  Impl& I = *impl_;
  I.finish_update();
  I.holds->wait_all();  // the caller may write into it
  const int k = saved_kind(kind);
  if (I.placement(unit, k) != Placement::kNvme) return I.tensor(unit, k);
  at::Tensor copy = I.host_buffer(I.partition->unit(unit).shard_numel, at::kFloat);
  I.state->read(unit, k, 0, copy).get();
  return copy;
}

std::shared_future<void> Engine::update_finished() const {
  if (impl_->updater) {
    std::shared_future<void> over = impl_->updater->over();
    if (over.valid()) return over;
  }
  std::promise<void> done;
  done.set_value();
  return done.get_future().share();
}

bool Engine::state_copies_to_file(size_t unit, state::Kind kind) const {
  const int k = saved_kind(kind);
  return impl_->state->copies_to_file(unit, k);
}

void Engine::copy_state_to_file(size_t unit, state::Kind kind, uint64_t begin, uint64_t numel, const offload::File& dst,
                                uint64_t offset) {
  const int k = saved_kind(kind);
  impl_->state->copy_to_file(unit, k, begin, numel, dst, offset);
}

void Engine::hold_state(std::shared_ptr<StateHold> hold) {
  Impl& I = *impl_;
  I.holds->wait_all();  // one snapshot at a time
  // read_state copies device-resident state on a stream of its caller's own: whatever updates
  // the compute stream has queued (the device's share of the optimizer) must be done first.
  if (!I.units_where(true).empty()) I.dev.synchronize(I.dev.compute_stream());
  I.holds->set(std::move(hold));
}

std::vector<size_t> Engine::update_order() const {
  const Impl& I = *impl_;
  std::vector<size_t> device = I.units_where(true), rest = I.units_where(false);
  if (I.updates_in_backward()) {
    // The CPU's units as their gradients become final, then the device's at the step's end.
    rest = I.schedule->in_final_gradient_order(std::move(rest));
    rest.insert(rest.end(), device.begin(), device.end());
    return rest;
  }
  device.insert(device.end(), rest.begin(), rest.end());  // one launch on the device, then forward order
  return device;
}

void Engine::read_state(size_t unit, state::Kind kind, uint64_t begin, uint64_t numel, float* dst) {
  Impl& I = *impl_;
  const int k = saved_kind(kind);
  const uint64_t n = I.partition->unit(unit).shard_numel;
  if (begin > n || numel > n - begin)
    throw std::out_of_range("read_state: elements " + std::to_string(begin) + "+" + std::to_string(numel) +
                            " outside unit " + I.partition->unit(unit).name + "'s slice of " + std::to_string(n));
  const at::Tensor out = at::from_blob(dst, {int64_t(numel)}, at::TensorOptions().dtype(at::kFloat));
  if (I.partition->frozen(unit)) {
    // A frozen unit's weights are its compute copy (nothing else of it exists), unless it holds
    // 4-bit records, whose bytes are no values (gather_parameters dequantizes them).
    const std::vector<TensorSlot>& slots = I.partition->unit(unit).tensors;
    if (std::any_of(slots.begin(), slots.end(), [](const TensorSlot& t) { return t.quantized; }))
      throw std::logic_error("read_state: unit " + I.partition->unit(unit).name +
                             " holds 4-bit records (model.quantize), not values");
    if (k != state::kMaster)
      throw std::logic_error("read_state: unit " + I.partition->unit(unit).name + " is frozen: it has no " +
                             state::kind_name(k));
    if (I.cdt == at::kFloat) {
      I.state->read(unit, state::kCompute, begin, out).get();
    } else {
      at::Tensor c = I.host_buffer(numel, I.cdt);
      I.state->read(unit, state::kCompute, begin, c).get();
      out.copy_(c);
    }
    return;
  }
  // Swap: a read through the I/O engine; device: a blocking copy on a stream of this thread's
  // own (ordered after the training's work by hold_state's synchronize); host: one memcpy here.
  I.state->read(unit, k, begin, out).get();
}

void Engine::store_state_slice(size_t unit, state::Kind kind, const at::Tensor& data) {
  Impl& I = *impl_;
  I.finish_update();
  I.holds->wait_all();
  const int k = saved_kind(kind);
  if (I.placement(unit, k) == Placement::kNvme) {
    TORCH_CHECK(data.is_cpu() && data.is_contiguous() && data.scalar_type() == at::kFloat &&
                    uint64_t(data.numel()) == I.partition->unit(unit).shard_numel,
                "store_state_slice: expects the fp32 host slice state_slice returned");
    I.state->write(unit, k, 0, data).get();
    return;
  }
  at::Tensor& slot = I.tensor(unit, k);
  if (!data.is_same(slot)) slot.copy_(data);
}

void Engine::refresh_compute_copies() {
  impl_->finish_update();
  impl_->optimizer->refresh_compute_copies();
}

const layout::MemoryModel& Engine::memory_model() const { return *impl_->memory; }
const layout::Choices& Engine::working_set_choices() const { return impl_->choice(); }
uint64_t Engine::device_state_bytes() const { return impl_->base_bytes; }
const Partition& Engine::partition() const { return *impl_->partition; }
const Partition& Engine::checkpoint_partition() const {
  return impl_->saved_partition ? *impl_->saved_partition : *impl_->partition;
}
const std::vector<size_t>& Engine::checkpoint_units() const { return impl_->saved_units; }
const models::ModelConfig& Engine::model_config() const { return impl_->model->config(); }
double Engine::flops_per_token() const { return impl_->flops_per_token(); }

MemoryReport Engine::memory() const {
  MemoryReport r;
  r.device_used = impl_->dev.used();
  r.device_peak = impl_->dev.peak();
  r.device_budget = impl_->dev.budget();
  r.host_state = impl_->host.state_bytes();
  r.nvme_state = impl_->state ? impl_->state->nvme_bytes() : 0;
  r.host_activations = impl_->activations ? impl_->activations->host_peak() : 0;
  return r;
}

}  // namespace strata::engine
