// jaxsync_inflight_start / jaxsync_inflight_finish: a sum over a communicator
// that stays in flight across separate jitted calls (the outer mean of
// jaxsync.local's streaming with overlap=True).
//
// start(x: T[n]) -> handle: s32[]   (attributes: comm, poll_us, piece_bytes, post)
//   copies x into a buffer this library owns (the snapshot: never an XLA
//   buffer, so nothing the caller donates or reuses lies under the transfer),
//   queues its sum (as jaxsync_allreduce sums: float32 in pieces of piece_bytes,
//   at most kPiecesInFlight at once; 16-bit floats in float32, rounded once) on
//   the communicator's lane (the thread that runs
//   overlap's sums, in the order they were queued: the step order, the same on
//   every process), and returns at once with a handle (a number of this
//   process) that the optimizer state carries to a later step.
// finish(handle: s32[]) -> (T[n], f32[])
//   returns a future that the lane completes with the sum and the divisor that
//   makes it a mean (`post`, given at the start: the sum's world's, so a sum
//   resumed in a smaller world after a recovery is still divided by its own)
//   (at once if it is
//   already done) and forgets the handle; an unknown handle (a state restored
//   from a checkpoint taken while a sum was in flight, in another process) is
//   an error that says so. MPI failures (a revoked communicator after a lost
//   process: MPI_ERR_REVOKED / MPI_ERR_PROC_FAILED) come back as the error.
// Neither takes the token chain: a stream of such sums is ordered by the
// lane, and a step has at most one start (the schedule checks it in Python).
//
// C entry points for checkpoints (jaxsync.local.in_flight / resume_in_flight),
// in bytes: jaxsync_inflight_size(h) (-1: unknown), jaxsync_inflight_wait(h,
// out, n, err, cap, post) waits for h's sum and copies it (and its divisor) out
// without forgetting h, jaxsync_inflight_put(data, n, post) registers a finished
// sum and returns its handle,
// jaxsync_inflight_fail_all(text) fails every sum not yet taken (elastic
// recovery: nothing waits on a dead world), jaxsync_inflight_pending() counts
// handles not yet taken.

#include "mpi_ffi.h"

namespace jaxsync {
namespace {

struct Slot {
  std::vector<char> data;  // the sum's bytes
  ffi::DataType type = ffi::DataType::F32;
  float post = 1.0f;  // the divisor that makes the sum a mean
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::string error;                          // non-empty: the sum failed
  std::vector<std::function<void()>> waiters;  // run (without mu) when done
};

std::mutex g_mu;
std::map<int32_t, std::shared_ptr<Slot>>* g_slots =
    new std::map<int32_t, std::shared_ptr<Slot>>();  // never freed
int32_t g_next = 0;

int32_t Register(std::shared_ptr<Slot> slot) {
  std::lock_guard<std::mutex> lock(g_mu);
  const int32_t h = g_next++;
  (*g_slots)[h] = std::move(slot);
  return h;
}

std::shared_ptr<Slot> Find(int32_t h, bool take) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto it = g_slots->find(h);
  if (it == g_slots->end()) return nullptr;
  auto slot = it->second;
  if (take) g_slots->erase(it);
  return slot;
}

// Marks `slot` done (with `error` if non-empty) and runs its waiters.
void Complete(Slot& slot, std::string error) {
  std::vector<std::function<void()>> waiters;
  {
    std::lock_guard<std::mutex> lock(slot.mu);
    if (slot.done) return;
    slot.done = true;
    slot.error = std::move(error);
    waiters.swap(slot.waiters);
  }
  slot.cv.notify_all();
  for (auto& w : waiters) w();
}

ffi::Error StartImpl(ffi::AnyBuffer x, ffi::Result<ffi::BufferR0<ffi::S32>> handle,
                     int64_t comm, int64_t poll_us, int64_t piece_bytes, float post) {
  auto slot = std::make_shared<Slot>();
  slot->post = post;
  const size_t n = x.element_count();
  const char* src = static_cast<const char*>(x.untyped_data());
  slot->data.assign(src, src + x.size_bytes());
  slot->type = x.element_type();
  const int32_t h = Register(slot);
  handle->typed_data()[0] = h;
  g_started.fetch_add(1, std::memory_order_relaxed);
  const MPI_Fint fh = static_cast<MPI_Fint>(comm);
  const int64_t poll = PollUs(poll_us);
  const bool timeline = g_timeline.load(std::memory_order_relaxed);
  const int64_t queued = timeline ? NowNs() : 0;
  PushLane(fh, [slot, fh, poll, piece_bytes, timeline, queued, n] {
    const int64_t began = timeline ? NowNs() : 0;
    t_poll_us = poll;
    std::string error;
    {
      std::lock_guard<std::mutex> lock(slot->mu);
      if (slot->done) error = "failed before it started";  // fail_all came first
    }
    if (error.empty()) {
      ffi::Error e = SumBuffer(MPI_Comm_f2c(fh), slot->type, slot->data.data(), n, piece_bytes);
      if (e.failure()) error = e.message();
    }
    if (timeline) {
      Record(kAllreduceAsync, fh, static_cast<int64_t>(slot->data.size()), queued, began,
             NowNs(), true);
    }
    Complete(*slot, std::move(error));
    g_finished.fetch_add(1, std::memory_order_release);
  });
  return ffi::Error::Success();
}

ffi::Error Unknown(int32_t h) {
  return ffi::Error::InvalidArgument(
      "jaxsync.diloco(overlap=True): no transfer in flight with handle " + std::to_string(h) +
      " in this process (a state restored from a checkpoint taken while a fragment was in "
      "flight?). Fix: save jaxsync.local.in_flight(state) with the checkpoint and resume "
      "with jaxsync.local.resume_in_flight(state, saved), or checkpoint after a fragment's "
      "apply step.");
}

ffi::Future FinishImpl(ffi::BufferR0<ffi::S32> handle, ffi::Result<ffi::AnyBuffer> out,
                       ffi::Result<ffi::BufferR0<ffi::F32>> post) {
  ffi::Promise promise;
  ffi::Future future(promise);
  const int32_t h = handle.typed_data()[0];
  auto slot = Find(h, /*take=*/true);
  if (!slot) {
    promise.SetError(Unknown(h));
    return future;
  }
  void* dst = out->untyped_data();
  float* divisor = post->typed_data();
  const size_t n = out->size_bytes();
  auto deliver = [slot, dst, divisor, n, promise]() mutable {
    if (!slot->error.empty()) {
      promise.SetError(ffi::Error::Internal(slot->error));
    } else if (slot->data.size() != n) {
      promise.SetError(ffi::Error::InvalidArgument(
          "jaxsync_inflight_finish: the sum has " + std::to_string(slot->data.size()) +
          " bytes, the result " + std::to_string(n)));
    } else {
      std::memcpy(dst, slot->data.data(), n);
      *divisor = slot->post;
      promise.SetAvailable();
    }
  };
  {
    std::lock_guard<std::mutex> lock(slot->mu);
    if (!slot->done) {
      slot->waiters.push_back(std::move(deliver));
      return future;
    }
  }
  deliver();
  return future;
}

}  // namespace
}  // namespace jaxsync

using namespace jaxsync;  // NOLINT: the C entry points below

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsync_inflight_start, jaxsync::StartImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::BufferR0<ffi::S32>>()
                                  .Attr<int64_t>("comm")
                                  .Attr<int64_t>("poll_us")
                                  .Attr<int64_t>("piece_bytes")
                                  .Attr<float>("post"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsync_inflight_finish, jaxsync::FinishImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::BufferR0<ffi::F32>>());

extern "C" int64_t jaxsync_inflight_size(int32_t h) {
  auto slot = Find(h, false);
  return slot ? static_cast<int64_t>(slot->data.size()) : -1;
}

// Waits for h's sum and copies its n bytes to out: 0, or -1 (unknown handle or
// another size) / -2 (the sum failed; its error text in err, at most cap bytes).
extern "C" int jaxsync_inflight_wait(int32_t h, char* out, int64_t n, char* err, int64_t cap,
                                     float* post) {
  auto slot = Find(h, false);
  if (!slot || static_cast<int64_t>(slot->data.size()) != n) return -1;
  std::unique_lock<std::mutex> lock(slot->mu);
  slot->cv.wait(lock, [&] { return slot->done; });
  if (!slot->error.empty()) {
    std::snprintf(err, static_cast<size_t>(cap), "%s", slot->error.c_str());
    return -2;
  }
  std::memcpy(out, slot->data.data(), static_cast<size_t>(n));
  *post = slot->post;
  return 0;
}

extern "C" int32_t jaxsync_inflight_put(const char* data, int64_t n, float post) {
  auto slot = std::make_shared<Slot>();
  slot->post = post;
  slot->data.assign(data, data + n);
  slot->done = true;
  return Register(std::move(slot));
}

// Fails every sum not yet taken with `text` (their waiters get it at once); a sum
// still running on its lane keeps its buffer until its MPI calls return.
extern "C" int64_t jaxsync_inflight_fail_all(const char* text) {
  std::vector<std::shared_ptr<Slot>> slots;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    for (auto& kv : *g_slots) slots.push_back(kv.second);
  }
  for (auto& s : slots) Complete(*s, text);
  return static_cast<int64_t>(slots.size());
}

extern "C" int64_t jaxsync_inflight_pending() {
  std::lock_guard<std::mutex> lock(g_mu);
  return static_cast<int64_t>(g_slots->size());
}
