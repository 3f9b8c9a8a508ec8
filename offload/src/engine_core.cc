#include "engine_core.h"

#include <cerrno>
#include <stdexcept>
#include <string>

#include "strata/offload/fault_injection.h"

namespace strata::offload {

namespace detail {

EngineCore::EngineCore(const IoEngineConfig& config) : config_(config) {}

IoEngineStats EngineCore::stats() const {
  IoEngineStats s;
  s.bytes_read = bytes_read_;
  s.bytes_written = bytes_written_;
  s.requests = requests_;
  s.blocks = blocks_;
  s.resubmits = resubmits_;
  s.retries = retries_;
  s.buffered_ops = buffered_ops_;
  s.failures = failures_;
  s.peak_in_flight = peak_in_flight_;
  return s;
}

void EngineCore::plan(const IoRequest& r, const std::shared_ptr<Request>& req,
                      std::vector<Op*>& ops) {
  const File& f = *r.file;
  const uint64_t oa = f.offset_align(), ma = f.memory_align();
  auto add = [&](uint64_t off, std::byte* data, uint64_t len, bool direct) {
    ops.push_back(new Op{req, r.kind, &f, direct, off, data, len});
    if (!direct) ++buffered_ops_;
  };
  uint64_t done = 0;
  while (done < r.length) {
    const uint64_t off = r.offset + done;
    // Cut at multiples of block_bytes in file offset space so blocks stay aligned.
    const uint64_t block_end = (off / config_.block_bytes + 1) * config_.block_bytes;
    const uint64_t len = std::min<uint64_t>(r.length - done, block_end - off);
    std::byte* data = r.data + done;
    const bool aligned = f.direct() && off % oa == 0 &&
                         reinterpret_cast<uintptr_t>(data) % ma == 0;
    const uint64_t body = aligned ? len / oa * oa : 0;
    if (body > 0) add(off, data, body, true);
    if (len > body) add(off + body, data + body, len - body, false);
    done += len;
  }
}

std::vector<IoFuture> EngineCore::submit(std::span<const IoRequest> requests) {
  std::vector<IoFuture> futures;
  futures.reserve(requests.size());
  for (const IoRequest& r : requests) {  // all checked before anything is planned or queued
    if (r.file == nullptr || !r.file->is_open()) {
      throw std::invalid_argument("I/O request on a file that is not open");
    }
    if (r.data == nullptr && r.length > 0) {
      throw std::invalid_argument("I/O request with a null buffer on " + r.file->path());
    }
  }
  std::vector<Op*> ops;
  for (const IoRequest& r : requests) {
    ++requests_;
    auto req = std::make_shared<Request>();
    req->bytes = r.length;
    req->kind = r.kind;
    futures.push_back(req->promise.future());
    const size_t first = ops.size();
    plan(r, req, ops);
    req->remaining_ops = ops.size() - first;
    if (ops.size() == first) req->promise.complete({});  // zero-length request
  }
  if (ops.empty()) return futures;
  {
    std::lock_guard lock(idle_mu_);
    outstanding_ += ops.size();
  }
  blocks_ += ops.size();
  enqueue(ops);
  return futures;
}

void EngineCore::complete_op(Op* op, int64_t result) {
  const bool is_read = op->kind == IoRequest::Kind::kRead;
  const char* name = is_read ? "read" : "write";
  if (config_.fault_injector) {
    result = config_.fault_injector->on_complete(
        IoOpView{op->kind, op->file->path(), op->offset, op->remaining, op->direct}, result);
  }
  if (result < 0) {
    const int err = static_cast<int>(-result);
    if (err == EINVAL && op->direct) {
      // The file system refused this direct transfer after all: same bytes, buffered.
      op->direct = false;
      ++buffered_ops_;
      std::vector<Op*> again{op};
      return enqueue(again);
    }
    if (IoStatus::is_transient(err) && op->retries < config_.max_retries) {
      ++op->retries;
      ++retries_;
      std::vector<Op*> again{op};
      return enqueue(again);
    }
    std::string detail = op->direct ? "O_DIRECT" : "buffered";
    if (IoStatus::is_transient(err)) {
      detail += ", gave up after " + std::to_string(op->retries) + " retries";
    }
    return finish_op(op, IoStatus::from_errno(err, name, op->file->path(), op->offset,
                                              op->remaining, detail));
  }
  if (result == 0 && op->remaining > 0) {
    if (is_read) {
      std::string detail = "end of file";
      try {
        detail += ": file is " + std::to_string(op->file->size()) +
                  " bytes; it shrank or was never written this far";
      } catch (const std::exception&) {
      }
      return finish_op(op, IoStatus::from_errno(ENODATA, name, op->file->path(), op->offset,
                                                op->remaining, detail));
    }
    return finish_op(op, IoStatus::from_errno(EIO, name, op->file->path(), op->offset,
                                              op->remaining, "write made no progress"));
  }
  if (static_cast<uint64_t>(result) > op->remaining) {
    return finish_op(op, IoStatus::from_errno(EIO, name, op->file->path(), op->offset,
                                              op->remaining, "kernel reported more bytes"));
  }
  (is_read ? bytes_read_ : bytes_written_) += static_cast<uint64_t>(result);
  op->offset += static_cast<uint64_t>(result);
  op->data += result;
  op->remaining -= static_cast<uint64_t>(result);
  if (op->remaining == 0) return finish_op(op, {});
  // Short transfer: continue with the remainder, buffered if it is no longer aligned.
  ++resubmits_;
  ++blocks_;
  op->retries = 0;
  if (op->direct) {
    const File& f = *op->file;
    op->direct = op->offset % f.offset_align() == 0 && op->remaining % f.offset_align() == 0 &&
                 reinterpret_cast<uintptr_t>(op->data) % f.memory_align() == 0;
    if (!op->direct) ++buffered_ops_;
  }
  std::vector<Op*> again{op};
  enqueue(again);
}

void EngineCore::finish_op(Op* op, IoStatus status) {
  std::shared_ptr<Request> req = std::move(op->request);
  delete op;
  if (!status.ok()) {
    std::lock_guard lock(req->mu);
    if (req->first_error.ok()) req->first_error = std::move(status);
  }
  if (req->remaining_ops.fetch_sub(1) == 1) {
    IoStatus final_status;
    {
      std::lock_guard lock(req->mu);
      final_status = req->first_error;
    }
    if (!final_status.ok()) ++failures_;
    req->promise.complete(std::move(final_status));
  }
  std::lock_guard lock(idle_mu_);
  if (--outstanding_ == 0) idle_cv_.notify_all();
}

void EngineCore::wait_idle() {
  std::unique_lock lock(idle_mu_);
  idle_cv_.wait(lock, [&] { return outstanding_ == 0; });
}

}  // namespace detail

IoFuture IoEngine::read(const File& file, uint64_t offset, std::span<std::byte> dst) {
  IoRequest r{IoRequest::Kind::kRead, &file, offset, dst.data(), dst.size()};
  return submit({&r, 1})[0];
}

IoFuture IoEngine::write(const File& file, uint64_t offset, std::span<const std::byte> src) {
  IoRequest r{IoRequest::Kind::kWrite, &file, offset, const_cast<std::byte*>(src.data()),
              src.size()};
  return submit({&r, 1})[0];
}

IoBackend parse_io_backend(std::string_view name) {
  if (name == "auto") return IoBackend::kAuto;
  if (name == "io_uring" || name == "uring") return IoBackend::kIoUring;
  if (name == "threads" || name == "thread_pool") return IoBackend::kThreadPool;
  throw std::invalid_argument("unknown I/O backend '" + std::string(name) +
                              "' (expected auto, io_uring or threads)");
}

std::string_view to_string(IoBackend backend) {
  switch (backend) {
    case IoBackend::kAuto: return "auto";
    case IoBackend::kIoUring: return "io_uring";
    case IoBackend::kThreadPool: return "threads";
  }
  return "?";
}

std::unique_ptr<IoEngine> IoEngine::create(const IoEngineConfig& config) {
  if (config.queue_depth == 0 || config.queue_depth > 4096) {
    throw std::invalid_argument("io queue_depth must be in [1, 4096], got " +
                                std::to_string(config.queue_depth));
  }
  if (config.block_bytes < 4096 || config.block_bytes % 4096 != 0 ||
      config.block_bytes > (1ull << 30)) {
    throw std::invalid_argument("io block_bytes must be a multiple of 4096 in [4 KiB, 1 GiB], got " +
                                std::to_string(config.block_bytes));
  }
  switch (config.backend) {
    case IoBackend::kIoUring: return detail::make_uring_engine(config);
    case IoBackend::kThreadPool: return detail::make_thread_pool_engine(config);
    case IoBackend::kAuto:
      if (io_uring_available()) return detail::make_uring_engine(config);
      return detail::make_thread_pool_engine(config);
  }
  throw std::invalid_argument("bad I/O backend");
}

}  // namespace strata::offload
