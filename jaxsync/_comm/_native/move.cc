// jaxsync_allgather and jaxsync_alltoall: any number of buffers, one after
// another, in one call (see mpi_ffi.h); their _async forms run on the
// communicator's lane.

#include "mpi_ffi.h"

namespace jaxsync {
namespace {

// The shape of `x` as "(a, b, ...)", for error messages.
std::string ShapeOf(const ffi::AnyBuffer& x) {
  std::string out = "(";
  const auto dims = x.dimensions();
  for (size_t i = 0; i < dims.size(); ++i) {
    out += (i ? ", " : "") + std::to_string(dims[i]);
  }
  return out + (dims.size() == 1 ? ",)" : ")");
}

// One MPI_Allgather or MPI_Alltoall of rows of `n` elements (allgather: this
// process's row; alltoall: row j to peer j), in column chunks of at most
// MaxCount() elements: a chunk's rows are one derived datatype, `k` elements
// with the extent of a whole row, so every row's chunk lands in place.
template <bool kAlltoall>
ffi::Error MoveRows(MPI_Comm c, MPI_Datatype dtype, size_t width, const char* src, char* dst,
                    size_t n) {
  const char* what = kAlltoall ? "MPI_Alltoall" : "MPI_Allgather";
  auto call = [&](const void* s, int scount, MPI_Datatype st, void* d, int dcount,
                  MPI_Datatype dt) {
    return kAlltoall ? Alltoall(s, scount, st, d, dcount, dt, c)
                     : Allgather(s, scount, st, d, dcount, dt, c);
  };
  const size_t most = MaxCount();
  if (n <= most) {  // the usual case: one call, no derived type
    const int k = static_cast<int>(n);
    int rc = call(src, k, dtype, dst, k, dtype);
    return rc == MPI_SUCCESS ? ffi::Error::Success() : MpiError(rc, what);
  }
  for (size_t o = 0; o < n; o += most) {
    const size_t k = std::min(most, n - o);
    MPI_Datatype block, row;
    int rc = MPI_Type_contiguous(static_cast<int>(k), dtype, &block);
    if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Type_contiguous");
    rc = MPI_Type_create_resized(block, 0, static_cast<MPI_Aint>(n * width), &row);
    MPI_Type_free(&block);
    if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Type_create_resized");
    rc = MPI_Type_commit(&row);
    if (rc == MPI_SUCCESS) {
      // allgather sends k plain elements; alltoall one (strided) row chunk per peer
      rc = kAlltoall ? call(src + o * width, 1, row, dst + o * width, 1, row)
                     : call(src + o * width, static_cast<int>(k), dtype, dst + o * width, 1,
                            row);
    }
    MPI_Type_free(&row);
    if (rc != MPI_SUCCESS) return MpiError(rc, what);
  }
  return ffi::Error::Success();
}

// One buffer of a move, as the call (or a lane's job: the FFI's views of the
// buffers end with the call, their memory lives until the future is set) keeps it.
struct MoveRef {
  ffi::DataType type;
  const char* src;
  char* dst;
  size_t count;   // elements
  int64_t lead;   // the leading axis (alltoall: one row per peer)
  std::string shape;
  size_t bytes;   // of the result
};

template <bool kAlltoall>
ffi::Error Refs(ffi::RemainingArgs& args, ffi::RemainingRets& rets, std::vector<MoveRef>* out,
                int64_t* bytes) {
  const char* name = kAlltoall ? "jaxsync_alltoall" : "jaxsync_allgather";
  if (args.size() != rets.size()) {
    return ffi::Error::InvalidArgument(std::string(name) + ": as many results as buffers expected");
  }
  for (size_t i = 0; i < args.size(); ++i) {
    auto x = args.get<ffi::AnyBuffer>(i);
    auto y = rets.get<ffi::AnyBuffer>(i);
    if (!x.has_value()) return x.error();
    if (!y.has_value()) return y.error();
    const auto dims = x->dimensions();
    out->push_back({x->element_type(), static_cast<const char*>(x->untyped_data()),
                    static_cast<char*>((*y)->untyped_data()), x->element_count(),
                    dims.size() ? static_cast<int64_t>(dims[0]) : -1, ShapeOf(*x),
                    (*y)->size_bytes()});
    *bytes += static_cast<int64_t>(x->size_bytes());
  }
  return ffi::Error::Success();
}

// One buffer. allgather: x of n elements -> (size, n). alltoall: x of shape
// (size, m) -> (size, m), row j to peer j.
template <bool kAlltoall>
ffi::Error MoveOne(MPI_Comm c, int size, const MoveRef& x) {
  const char* what = kAlltoall ? "MPI_Alltoall" : "MPI_Allgather";
  MPI_Datatype dtype;
  if (!MoveType(x.type, &dtype)) return Unsupported(what, x.type);
  size_t n = x.count;
  if (kAlltoall) {
    if (x.lead != size) {
      return ffi::Error::InvalidArgument(
          "jaxsync_alltoall: the operand's leading axis must have the communicator's "
          "size " + std::to_string(size) + " (one row per process), got shape " +
          x.shape + ". Fix: reshape it to (" + std::to_string(size) + ", ...)");
    }
    n /= static_cast<size_t>(size);
  }
  if (n == 0) return ffi::Error::Success();
  return MoveRows<kAlltoall>(c, dtype, ffi::ByteWidth(x.type), x.src, x.dst, n);
}

// Every buffer of the call, one after another; `on` false: zeros (discarded by
// the caller: the devices that do not talk to the other processes).
template <bool kAlltoall>
ffi::Error MoveAll(MPI_Comm c, bool on, const std::vector<MoveRef>& refs) {
  int size = 0;
  if (on) {
    if (int rc = MPI_Comm_size(c, &size); rc != MPI_SUCCESS) return MpiError(rc, "MPI_Comm_size");
  }
  for (const MoveRef& x : refs) {
    if (!on) {
      std::memset(x.dst, 0, x.bytes);
      continue;
    }
    if (auto e = MoveOne<kAlltoall>(c, size, x); e.failure()) return e;
  }
  return ffi::Error::Success();
}

// (sharded gathers its updates leaf by leaf, one call each: with one call for
// all of them every gathered leaf is live at once, and the ResNet-like tree's
// step took 33 MB of temporaries instead of 22, past glibc's 32 MiB mmap ceiling.)
template <bool kAlltoall>
ffi::Error MoveImpl(ffi::Token, CommArg comm, ActiveArg active, ffi::RemainingArgs args,
                    ffi::Result<ffi::Token>, ffi::RemainingRets rets, int64_t poll_us) {
  Counted counted;
  std::vector<MoveRef> refs;
  int64_t bytes = 0;
  if (auto e = Refs<kAlltoall>(args, rets, &refs, &bytes); e.failure()) return e;
  const bool on = active.typed_data()[0] != 0;
  Span span(kAlltoall ? kAlltoall_ : kAllgather, comm.typed_data()[0], on ? bytes : 0);
  PollScope poll(poll_us);
  return MoveAll<kAlltoall>(CommOf(comm), on, refs);
}

// jaxsync_alltoall_async / jaxsync_allgather_async: the same moves on the
// communicator's lane (sums.cc's Lane: after the jobs queued there before, as
// the token chain orders them), returning a future at once; XLA runs the rest
// of the step until a result is read (overlap with a quantized wire).
template <bool kAlltoall>
ffi::Future MoveAsyncImpl(ffi::Token, CommArg comm, ActiveArg active, ffi::RemainingArgs args,
                          ffi::Result<ffi::Token>, ffi::RemainingRets rets, int64_t poll_us) {
  ffi::Promise promise;
  ffi::Future future(promise);
  std::vector<MoveRef> refs;
  int64_t bytes = 0;
  if (auto e = Refs<kAlltoall>(args, rets, &refs, &bytes); e.failure()) {
    promise.SetError(std::move(e));
    return future;
  }
  if (active.typed_data()[0] == 0) {
    MoveAll<kAlltoall>(MPI_COMM_NULL, false, refs);
    promise.SetAvailable();
    return future;
  }
  const MPI_Fint handle = static_cast<MPI_Fint>(comm.typed_data()[0]);
  g_started.fetch_add(1, std::memory_order_relaxed);
  poll_us = PollUs(poll_us);
  const int64_t queued = NowNs();
  const bool timeline = g_timeline.load(std::memory_order_relaxed);
  PushLane(handle, [promise, handle, poll_us, queued, timeline, bytes,
                    refs = std::move(refs)]() mutable {
    const int64_t began = NowNs();
    t_poll_us = poll_us;  // this lane's thread, for this job's waits
    ffi::Error e = MoveAll<kAlltoall>(MPI_Comm_f2c(handle), true, refs);
    if (timeline) {
      Record(kAlltoall ? kAlltoall_ : kAllgather, handle, bytes, queued, began, NowNs(), true);
    }
    Settle(promise, std::move(e));
  });
  return future;
}

ffi::Future AllgatherAsyncImpl(ffi::Token t, CommArg comm, ActiveArg active,
                               ffi::RemainingArgs args, ffi::Result<ffi::Token> t_out,
                               ffi::RemainingRets rets, int64_t poll_us) {
  return MoveAsyncImpl<false>(t, comm, active, args, t_out, rets, poll_us);
}

ffi::Future AlltoallAsyncImpl(ffi::Token t, CommArg comm, ActiveArg active,
                              ffi::RemainingArgs args, ffi::Result<ffi::Token> t_out,
                              ffi::RemainingRets rets, int64_t poll_us) {
  return MoveAsyncImpl<true>(t, comm, active, args, t_out, rets, poll_us);
}

ffi::Error AllgatherImpl(ffi::Token t, CommArg comm, ActiveArg active, ffi::RemainingArgs args,
                         ffi::Result<ffi::Token> t_out, ffi::RemainingRets rets,
                         int64_t poll_us) {
  return MoveImpl<false>(t, comm, active, args, t_out, rets, poll_us);
}

ffi::Error AlltoallImpl(ffi::Token t, CommArg comm, ActiveArg active, ffi::RemainingArgs args,
                        ffi::Result<ffi::Token> t_out, ffi::RemainingRets rets,
                        int64_t poll_us) {
  return MoveImpl<true>(t, comm, active, args, t_out, rets, poll_us);
}


}  // namespace
}  // namespace jaxsync

// The four moves take the same operands: (token, comm, active, buffers...) ->
// (token, results...), and how their waits poll.
#define JAXSYNC_MOVE_HANDLER(name, impl) \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl, jaxsync::BindCollective().Attr<int64_t>("poll_us"))

JAXSYNC_MOVE_HANDLER(jaxsync_allgather, jaxsync::AllgatherImpl);
JAXSYNC_MOVE_HANDLER(jaxsync_alltoall, jaxsync::AlltoallImpl);
JAXSYNC_MOVE_HANDLER(jaxsync_allgather_async, jaxsync::AllgatherAsyncImpl);
JAXSYNC_MOVE_HANDLER(jaxsync_alltoall_async, jaxsync::AlltoallAsyncImpl);
