// jaxsync_allreduce, jaxsync_allreduce_async (the communication lanes) and
// jaxsync_tie (see mpi_ffi.h).

#include "mpi_ffi.h"

namespace jaxsync {
namespace {

// The 32/64-bit sums of one call. Every MPI_Iallreduce is started before any
// is waited for, so MPI overlaps their latencies (one blocking call per
// buffer waits for the slowest process once per buffer); grouped buffers are
// copied into the arena, summed in place there and copied back. `piece`
// bytes > 0 (a communicator that spans hosts): no MPI call sums more than that
// (a buffer is cut into pieces) and at most kPiecesInFlight sums are in flight,
// each new one waiting for the oldest: see PIECE_BYTES in _mpi_ops.py.
class Sums {
 public:
  Sums(MPI_Comm c, size_t small, size_t grouped_bytes, size_t piece = 0)
      : c_(c), small_(small), group_cap_(std::max(small, kGroupBytes)), piece_(piece) {
    static thread_local std::vector<char> arena;
    const size_t want = std::min(grouped_bytes, std::max(kArenaBytes, group_cap_));
    if (arena.size() < want) {
      arena.clear();
      arena.shrink_to_fit();
      arena.resize(want);
    }
    arena_ = arena.data();
    arena_size_ = arena.size();
  }

  ~Sums() {  // an error left sums in flight: their buffers must outlive them
    if (!reqs_.empty()) {
      MPI_Waitall(static_cast<int>(reqs_.size()), reqs_.data(), MPI_STATUSES_IGNORE);
    }
  }

  size_t small() const { return small_; }

  ffi::Error Add(MPI_Datatype dtype, size_t width, void* src, void* dst, size_t bytes,
                 MPI_Op op = MPI_SUM) {
    if (bytes >= small_) {
      return Start(src == dst ? MPI_IN_PLACE : src, dst, bytes / width, width, dtype, op);
    }
    if (!open_.empty() &&
        (dtype != dtype_ || op != op_ || open_bytes_ + bytes > group_cap_)) {
      if (auto e = Close(); e.failure()) return e;
    }
    dtype_ = dtype;
    op_ = op;
    width_ = width;
    open_.push_back({src, dst, bytes});
    open_bytes_ += bytes;
    return ffi::Error::Success();
  }

  ffi::Error Finish() {
    if (auto e = Close(); e.failure()) return e;
    return Drain();
  }

 private:
  struct Part {
    void* src;
    void* dst;
    size_t bytes;
  };
  struct Sent {
    char* at;
    std::vector<Part> parts;
  };

  // One MPI_Iallreduce per MaxCount() elements, or per piece_ bytes where set
  // (one for any buffer below it).
  ffi::Error Start(const void* src, void* dst, size_t count, size_t width,
                   MPI_Datatype dtype, MPI_Op op) {
    const size_t most =
        piece_ > 0 ? std::min(MaxCount(), std::max<size_t>(piece_ / width, 1)) : MaxCount();
    for (size_t o = 0; o < count; o += most) {
      const int n = static_cast<int>(std::min(most, count - o));
      const void* s = src == MPI_IN_PLACE ? MPI_IN_PLACE
                                          : static_cast<const char*>(src) + o * width;
      while (piece_ > 0 && reqs_.size() - waited_ >= kPiecesInFlight) {
        int rc = WaitOne(&reqs_[waited_]);
        if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Iallreduce");
        ++waited_;
      }
      MPI_Request req;
      int rc = MPI_Iallreduce(s, static_cast<char*>(dst) + o * width, n, dtype, op, c_, &req);
      if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Iallreduce");
      reqs_.push_back(req);
    }
    return ffi::Error::Success();
  }

  ffi::Error Close() {
    if (open_.empty()) return ffi::Error::Success();
    std::vector<Part> parts;
    parts.swap(open_);
    const size_t bytes = open_bytes_;
    open_bytes_ = 0;
    if (parts.size() == 1) {  // alone: summed where it is
      const Part& p = parts[0];
      return Start(p.src == p.dst ? MPI_IN_PLACE : p.src, p.dst, p.bytes / width_, width_,
                   dtype_, op_);
    }
    if (used_ + bytes > arena_size_) {  // reuse the arena: finish what is in flight
      if (auto e = Drain(); e.failure()) return e;
    }
    char* at = arena_ + used_;
    used_ += bytes;
    size_t off = 0;
    for (const Part& p : parts) {
      std::memcpy(at + off, p.src, p.bytes);
      off += p.bytes;
    }
    sent_.push_back({at, std::move(parts)});
    return Start(MPI_IN_PLACE, at, bytes / width_, width_, dtype_, op_);
  }

  ffi::Error Drain() {
    if (!reqs_.empty()) {
      std::vector<MPI_Status> st(reqs_.size());
      int rc = WaitAll(reqs_, st);
      reqs_.clear();
      waited_ = 0;
      if (rc != MPI_SUCCESS) {
        sent_.clear();
        if (rc == MPI_ERR_IN_STATUS) {
          for (const MPI_Status& x : st) {
            if (x.MPI_ERROR != MPI_SUCCESS) return MpiError(x.MPI_ERROR, "MPI_Iallreduce");
          }
        }
        return MpiError(rc, "MPI_Waitall");
      }
    }
    for (const Sent& g : sent_) {
      size_t off = 0;
      for (const Part& p : g.parts) {
        std::memcpy(p.dst, g.at + off, p.bytes);
        off += p.bytes;
      }
    }
    sent_.clear();
    used_ = 0;
    return ffi::Error::Success();
  }

  MPI_Comm c_;
  size_t small_, group_cap_, piece_;
  size_t waited_ = 0;  // reqs_[:waited_] are done (MPI_REQUEST_NULL)
  char* arena_ = nullptr;
  size_t arena_size_ = 0, used_ = 0;
  std::vector<MPI_Request> reqs_;
  std::vector<Sent> sent_;
  std::vector<Part> open_;
  size_t open_bytes_ = 0;
  MPI_Datatype dtype_ = MPI_DATATYPE_NULL;
  MPI_Op op_ = MPI_SUM;
  size_t width_ = 1;
};


// One buffer of an allreduce: what SumParts needs, copied out of XLA's
// argument structures (which live only for the handler call), so the work can
// run later on a communication thread.
struct BufRef {
  ffi::DataType type;
  void* src;
  void* dst;
  size_t bytes;
  size_t count;
};

// The buffers of an allreduce call, checked (as many results as buffers).
ffi::Error Collect(ffi::RemainingArgs& args, ffi::RemainingRets& rets,
                   std::vector<BufRef>* out) {
  if (args.size() != rets.size()) {
    return ffi::Error::InvalidArgument(
        "jaxsync_allreduce: as many results as buffers expected");
  }
  out->reserve(args.size());
  for (size_t i = 0; i < args.size(); ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    auto res = rets.get<ffi::AnyBuffer>(i);
    if (!in.has_value()) return in.error();
    if (!res.has_value()) return res.error();
    out->push_back({in->element_type(), in->untyped_data(), (*res)->untyped_data(),
                    in->size_bytes(), in->element_count()});
  }
  return ffi::Error::Success();
}

int64_t PartsBytes(const std::vector<BufRef>& parts) {
  int64_t bytes = 0;
  for (const BufRef& b : parts) bytes += static_cast<int64_t>(b.bytes);
  return bytes;
}

// active == 0: results alias the inputs and stay untouched (copied where XLA
// did not alias them).
void Untouched(const std::vector<BufRef>& parts) {
  for (const BufRef& b : parts) {
    if (b.src != b.dst) std::memcpy(b.dst, b.src, b.bytes);
  }
}

// Sums every buffer of `parts` over `c` (see the top of this file).
ffi::Error SumParts(MPI_Comm c, const std::vector<BufRef>& parts, int64_t group_bytes,
                    int64_t piece_bytes) {
  // Small buffers of one dtype are summed together: copied into a scratch
  // arena, one MPI call in place, copied back (memcpy of a few KiB costs far
  // less than an MPI call each, or than packing them in XLA).
  const size_t small = group_bytes > 0 ? static_cast<size_t>(group_bytes) : kSmallBytes;
  int procs = 0;
  if (int rc = MPI_Comm_size(c, &procs); rc != MPI_SUCCESS) {
    return MpiError(rc, "MPI_Comm_size");
  }
  size_t grouped = 0;
  for (const BufRef& b : parts) {
    if ((procs == 2 || !IsLow(b.type)) && b.bytes < small) grouped += b.bytes;
  }
  Sums sums(c, small, grouped, piece_bytes > 0 ? static_cast<size_t>(piece_bytes) : 0);
  Low16 bf16, f16;
  for (const BufRef& b : parts) {
    const ffi::DataType t = b.type;
    if (IsLow(t) && procs == 2) {
      if (b.bytes == 0) continue;
      MPI_Op op;
      if (auto e = Sum16Op(t == ffi::DataType::BF16, &op); e.failure()) return e;
      if (auto e = sums.Add(MPI_UINT16_T, 2, b.src, b.dst, b.bytes, op); e.failure()) return e;
      continue;
    }
    if (IsLow(t)) {
      (t == ffi::DataType::BF16 ? bf16 : f16)
          .Add(static_cast<uint16_t*>(b.src), static_cast<uint16_t*>(b.dst), b.count);
      continue;
    }
    MPI_Datatype dtype;
    if (!SumType(t, &dtype)) return Unsupported("MPI_Allreduce", t);
    if (b.bytes == 0) continue;
    if (auto e = sums.Add(dtype, ffi::ByteWidth(t), b.src, b.dst, b.bytes); e.failure()) {
      return e;
    }
  }
  if (auto e = sums.Finish(); e.failure()) return e;
  if (auto e = bf16.Run(c, true); e.failure()) return e;
  return f16.Run(c, false);
}

ffi::Error AllreduceImpl(ffi::Token, CommArg comm,
                         ActiveArg active, ffi::RemainingArgs args,
                         ffi::Result<ffi::Token>, ffi::RemainingRets rets,
                         int64_t group_bytes, int64_t piece_bytes, int64_t poll_us) {
  Counted counted;
  PollScope poll(poll_us);
  std::vector<BufRef> parts;
  if (auto e = Collect(args, rets, &parts); e.failure()) return e;
  if (active.typed_data()[0] == 0) {
    Untouched(parts);
    return ffi::Error::Success();
  }
  Span span(kAllreduce, comm.typed_data()[0], PartsBytes(parts));
  return SumParts(CommOf(comm), parts, group_bytes, piece_bytes);
}

// ---- jaxsync_tie: an ordering point XLA:CPU keeps --------------------------
// Takes any number of buffers and returns the first ones (as many as it has
// results), each result aliased to its operand: nothing moves; the other
// operands are only read. Every result depends on every operand, so what reads
// a result waits for all of them, and each operand's buffer stays live until
// the tie. lax.optimization_barrier means the same, but XLA:CPU removes it
// before it schedules and assigns buffers (jax 0.10), so the order is lost:
// an optimizer update then ran before the backward and a backward temporary
// reused the memory of a sum still in flight (the step waited for it).
ffi::Error TieImpl(ffi::RemainingArgs args, ffi::RemainingRets rets) {
  if (rets.size() > args.size()) {
    return ffi::Error::InvalidArgument("jaxsync_tie: more results than operands");
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    auto res = rets.get<ffi::AnyBuffer>(i);
    if (!in.has_value()) return in.error();
    if (!res.has_value()) return res.error();
    // A copy only where XLA did not alias a result to its operand.
    if (in->untyped_data() != (*res)->untyped_data()) {
      std::memcpy((*res)->untyped_data(), in->untyped_data(), in->size_bytes());
    }
  }
  return ffi::Error::Success();
}

// ---- Overlap: the allreduce on a communication thread ---------------------
// jaxsync_allreduce_async does what jaxsync_allreduce does, but returns a
// future at once: the sums run on the communicator's own thread (a Lane) and
// complete the future, so XLA keeps running the rest of the step meanwhile
// (XLA:CPU holds back only the thunks that read the results or reuse their
// memory). One lane per communicator runs its jobs in the order they were
// queued, and calls are queued in the order of the step's token chain (the
// token result, like every result, is ready once the job is done), so every
// process issues the same collectives in the same order; no two threads ever
// call collectives on one communicator at once. Lanes live until the process
// ends (their threads are detached, idle on a condition variable); at exit
// Python waits for the counted calls to finish before MPI_Finalize.
class Lane {
 public:
  Lane() { std::thread([this] { Loop(); }).detach(); }

  void Push(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_one();
  }

 private:
  void Loop() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return !jobs_.empty(); });
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
};

Lane& LaneOf(MPI_Fint handle) {
  static std::mutex mu;
  static auto* lanes = new std::map<MPI_Fint, std::unique_ptr<Lane>>();  // never freed
  std::lock_guard<std::mutex> lock(mu);
  auto& lane = (*lanes)[handle];
  if (!lane) lane = std::make_unique<Lane>();
  return *lane;
}

ffi::Future AllreduceAsyncImpl(ffi::Token, CommArg comm, ActiveArg active,
                               ffi::RemainingArgs args, ffi::Result<ffi::Token>,
                               ffi::RemainingRets rets, int64_t group_bytes,
                               int64_t poll_us, int64_t piece_bytes) {
  ffi::Promise promise;
  ffi::Future future(promise);
  std::vector<BufRef> parts;
  if (auto e = Collect(args, rets, &parts); e.failure()) {
    promise.SetError(std::move(e));
    return future;
  }
  if (active.typed_data()[0] == 0) {
    Untouched(parts);
    promise.SetAvailable();
    return future;
  }
  const MPI_Fint handle = static_cast<MPI_Fint>(comm.typed_data()[0]);
  g_started.fetch_add(1, std::memory_order_relaxed);
  static const bool trace = std::getenv("JAXSYNC_TESTING_TRACE_LANES") != nullptr;
  poll_us = PollUs(poll_us);
  const auto queued = std::chrono::steady_clock::now();
  const bool timeline = g_timeline.load(std::memory_order_relaxed);
  LaneOf(handle).Push([promise, handle, group_bytes, poll_us, piece_bytes, queued, timeline,
                       parts = std::move(parts)]() mutable {
    const auto began = std::chrono::steady_clock::now();
    t_poll_us = poll_us;  // this lane's thread, for this job's waits
    ffi::Error e = SumParts(MPI_Comm_f2c(handle), parts, group_bytes, piece_bytes);
    if (timeline) {
      auto ns = [](auto t) {
        return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch())
            .count();
      };
      Record(kAllreduceAsync, handle, PartsBytes(parts), ns(queued), ns(began), NowNs(), true);
    }
    if (trace) {  // private: when each job was queued, began and ended (us)
      auto us = [](auto t) {
        return std::chrono::duration_cast<std::chrono::microseconds>(t.time_since_epoch())
            .count();
      };
      size_t bytes = 0;
      for (const BufRef& b : parts) bytes += b.bytes;
      std::fprintf(stderr, "jaxsync-lane %lld %lld %lld %zu\n",
                   static_cast<long long>(us(queued)), static_cast<long long>(us(began)),
                   static_cast<long long>(us(std::chrono::steady_clock::now())), bytes);
    }
    Settle(promise, std::move(e));
  });
  return future;
}


}  // namespace

void PushLane(MPI_Fint handle, std::function<void()> job) { LaneOf(handle).Push(std::move(job)); }

ffi::Error SumBuffer(MPI_Comm c, ffi::DataType t, void* data, size_t count, int64_t piece_bytes) {
  const std::vector<BufRef> parts{{t, data, data, count * ffi::ByteWidth(t), count}};
  return SumParts(c, parts, 0, piece_bytes);
}

}  // namespace jaxsync

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsync_allreduce, jaxsync::AllreduceImpl,
                              jaxsync::BindCollective()
                                  .Attr<int64_t>("group_bytes")
                                  .Attr<int64_t>("piece_bytes")
                                  .Attr<int64_t>("poll_us"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsync_allreduce_async, jaxsync::AllreduceAsyncImpl,
                              jaxsync::BindCollective()
                                  .Attr<int64_t>("group_bytes")
                                  .Attr<int64_t>("poll_us")
                                  .Attr<int64_t>("piece_bytes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsync_tie, jaxsync::TieImpl,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets());
