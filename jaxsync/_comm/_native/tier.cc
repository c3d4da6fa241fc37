// The host tier's steps among the processes of one host: jaxsync_reduce,
// jaxsync_bcast, jaxsync_reduce_scatter (see mpi_ffi.h).

#include "mpi_ffi.h"

namespace jaxsync {

bool TierTypeOf(ffi::DataType t, TierType* out) {
  if (IsLow(t)) {
    *out = {t, MPI_FLOAT, 4, 2, true};
    return true;
  }
  MPI_Datatype d;
  if (!SumType(t, &d)) return false;
  *out = {t, d, ffi::ByteWidth(t), ffi::ByteWidth(t), false};
  return true;
}

namespace {

// ---- The host tier: the processes of one host (shared memory) ------------
// jaxsync_reduce sums every buffer onto rank 0 of `comm` (in place there; the
// other ranks' buffers are left as they are), jaxsync_bcast copies rank 0's
// buffers to the other ranks (in place), jaxsync_reduce_scatter sums buffer i
// and leaves each rank r its slice [r m, (r + 1) m) of m = ceil(n_i / size)
// elements (zeros beyond n_i). float16/bfloat16 are summed in float32 (widened
// into scratch, summed by MPI as float32, rounded once where the sum lands).
// Buffers under `group_bytes` of one dtype travel together through a reused
// scratch arena (one message of at most max(group_bytes, 4 MiB)). Every MPI
// call here moves at most kTierChunk elements (MPI's count is an int).

struct TierBuf {
  TierType type;
  void* src;
  void* dst;
  size_t n;  // elements
};

// The bytes a tier call moves, as summed (16-bit floats widened to float32).
int64_t TierBytes(const std::vector<TierBuf>& bufs) {
  int64_t bytes = 0;
  for (const TierBuf& b : bufs) bytes += static_cast<int64_t>(b.n * b.type.width);
  return bytes;
}

// The operands and results of a tier call, checked; results not aliased to
// their inputs start as copies of them.
ffi::Error TierBufs(ffi::RemainingArgs& args, ffi::RemainingRets& rets, const char* what,
                    bool need_sum, std::vector<TierBuf>* out) {
  if (args.size() != rets.size()) {
    return ffi::Error::InvalidArgument(std::string(what) +
                                       ": as many results as buffers expected");
  }
  for (size_t i = 0; i < args.size(); ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    auto res = rets.get<ffi::AnyBuffer>(i);
    if (!in.has_value()) return in.error();
    if (!res.has_value()) return res.error();
    const size_t w = ffi::ByteWidth(in->element_type());
    TierType tt{in->element_type(), MPI_BYTE, w, w, false};
    if (need_sum && !TierTypeOf(in->element_type(), &tt)) {
      return Unsupported(what, in->element_type());
    }
    void* src = in->untyped_data();
    void* dst = (*res)->untyped_data();
    if (src != dst) std::memcpy(dst, src, in->size_bytes());
    out->push_back({tt, dst, dst, in->element_count()});
  }
  return ffi::Error::Success();
}

std::vector<char>& TierArena(size_t bytes) {
  static thread_local std::vector<char> arena;
  if (arena.size() < bytes) arena.resize(bytes);
  return arena;
}

// Sum `n` elements of `type` at `at` onto rank 0 (in place there).
ffi::Error ReduceChunks(MPI_Comm c, bool root, const TierType& type, char* at, size_t n) {
  for (size_t o = 0; o < n; o += kTierChunk) {
    const int k = static_cast<int>(std::min(kTierChunk, n - o));
    char* p = at + o * type.width;
    int rc = MPI_Reduce(root ? MPI_IN_PLACE : p, root ? p : nullptr, k, type.mpi, MPI_SUM, 0, c);
    if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Reduce");
  }
  return ffi::Error::Success();
}

ffi::Error ReduceImpl(ffi::Token, CommArg comm, ActiveArg active, ffi::RemainingArgs args,
                      ffi::Result<ffi::Token>, ffi::RemainingRets rets, int64_t group_bytes) {
  Counted counted;
  std::vector<TierBuf> bufs;
  if (auto e = TierBufs(args, rets, "jaxsync_reduce", true, &bufs); e.failure()) return e;
  if (active.typed_data()[0] == 0) return ffi::Error::Success();
  Span span(kReduce, comm.typed_data()[0], TierBytes(bufs));
  MPI_Comm c = CommOf(comm);
  int rank = 0;
  if (int rc = MPI_Comm_rank(c, &rank); rc != MPI_SUCCESS) return MpiError(rc, "MPI_Comm_rank");
  const bool root = rank == 0;
  const size_t small = group_bytes > 0 ? static_cast<size_t>(group_bytes) : kSmallBytes;
  const size_t cap = std::max(small, kGroupBytes);
  // A group: consecutive buffers of one dtype, copied (widened) into the arena.
  std::vector<const TierBuf*> group;
  size_t group_n = 0;
  auto flush = [&]() -> ffi::Error {
    if (group.empty()) return ffi::Error::Success();
    const TierType& type = group[0]->type;
    std::vector<char>& arena = TierArena(group_n * type.width);
    char* at = arena.data();
    size_t off = 0;
    for (const TierBuf* b : group) {
      if (type.low) {
        Widen(static_cast<uint16_t*>(b->src), reinterpret_cast<float*>(at) + off, b->n,
              type.t == ffi::DataType::BF16);
      } else {
        std::memcpy(at + off * type.width, b->src, b->n * type.width);
      }
      off += b->n;
    }
    if (auto e = ReduceChunks(c, root, type, at, group_n); e.failure()) return e;
    if (root) {
      off = 0;
      for (const TierBuf* b : group) {
        if (type.low) {
          Narrow(reinterpret_cast<float*>(at) + off, static_cast<uint16_t*>(b->dst), b->n,
                 type.t == ffi::DataType::BF16);
        } else {
          std::memcpy(b->dst, at + off * type.width, b->n * type.width);
        }
        off += b->n;
      }
    }
    group.clear();
    group_n = 0;
    return ffi::Error::Success();
  };
  for (const TierBuf& b : bufs) {
    if (b.n == 0) continue;
    const size_t bytes = b.n * b.type.width;
    if (!b.type.low && bytes >= small) {  // large 32/64-bit: summed where it is
      if (auto e = ReduceChunks(c, root, b.type, static_cast<char*>(b.dst), b.n); e.failure()) {
        return e;
      }
      continue;
    }
    if (b.type.low && bytes >= small) {  // large 16-bit: in float32 chunks
      if (auto e = flush(); e.failure()) return e;
      const size_t step = kLowChunk;
      for (size_t o = 0; o < b.n; o += step) {
        TierBuf part{b.type, static_cast<uint16_t*>(b.src) + o, static_cast<uint16_t*>(b.dst) + o,
                     std::min(step, b.n - o)};
        group.push_back(&part);
        group_n = part.n;
        if (auto e = flush(); e.failure()) return e;
      }
      continue;
    }
    if (!group.empty() && (group[0]->type.t != b.type.t || (group_n + b.n) * b.type.width > cap)) {
      if (auto e = flush(); e.failure()) return e;
    }
    group.push_back(&b);
    group_n += b.n;
  }
  return flush();
}

ffi::Error BcastImpl(ffi::Token, CommArg comm, ActiveArg active, ffi::RemainingArgs args,
                     ffi::Result<ffi::Token>, ffi::RemainingRets rets, int64_t group_bytes) {
  Counted counted;
  std::vector<TierBuf> bufs;
  if (auto e = TierBufs(args, rets, "jaxsync_bcast", false, &bufs); e.failure()) return e;
  if (active.typed_data()[0] == 0) return ffi::Error::Success();
  Span span(kBcast, comm.typed_data()[0], TierBytes(bufs));
  MPI_Comm c = CommOf(comm);
  int rank = 0;
  if (int rc = MPI_Comm_rank(c, &rank); rc != MPI_SUCCESS) return MpiError(rc, "MPI_Comm_rank");
  const bool root = rank == 0;
  const size_t small = group_bytes > 0 ? static_cast<size_t>(group_bytes) : kSmallBytes;
  const size_t cap = std::max(small, kGroupBytes);
  auto send = [&](char* at, size_t bytes) -> ffi::Error {
    for (size_t o = 0; o < bytes; o += kTierChunk) {
      const int k = static_cast<int>(std::min(kTierChunk, bytes - o));
      int rc = MPI_Bcast(at + o, k, MPI_BYTE, 0, c);
      if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Bcast");
    }
    return ffi::Error::Success();
  };
  // Small buffers of any dtype travel together: a broadcast moves bytes.
  std::vector<const TierBuf*> group;
  size_t group_bytes_now = 0;
  auto flush = [&]() -> ffi::Error {
    if (group.empty()) return ffi::Error::Success();
    if (group.size() == 1) {
      const TierBuf* b = group[0];
      group.clear();
      group_bytes_now = 0;
      return send(static_cast<char*>(b->dst), b->n * b->type.width);
    }
    char* at = TierArena(group_bytes_now).data();
    size_t off = 0;
    if (root) {
      for (const TierBuf* b : group) {
        std::memcpy(at + off, b->dst, b->n * b->type.width);
        off += b->n * b->type.width;
      }
    }
    if (auto e = send(at, group_bytes_now); e.failure()) return e;
    if (!root) {
      off = 0;
      for (const TierBuf* b : group) {
        std::memcpy(b->dst, at + off, b->n * b->type.width);
        off += b->n * b->type.width;
      }
    }
    group.clear();
    group_bytes_now = 0;
    return ffi::Error::Success();
  };
  for (const TierBuf& b : bufs) {
    const size_t bytes = b.n * b.type.width;
    if (bytes == 0) continue;
    if (bytes >= small) {
      if (auto e = send(static_cast<char*>(b.dst), bytes); e.failure()) return e;
      continue;
    }
    if (group_bytes_now + bytes > cap) {
      if (auto e = flush(); e.failure()) return e;
    }
    group.push_back(&b);
    group_bytes_now += bytes;
  }
  return flush();
}

// Buffer i (n elements) -> this rank's slice of m = ceil(n / size) elements.
// In place (the result aliased to the buffer, n elements): the slice is left
// in the buffer's first m elements (MPI_IN_PLACE), the rest undefined; no
// result buffer of its own (sharded's gradients: one copy fewer per step).
ffi::Error ReduceScatterImpl(ffi::Token, CommArg comm, ActiveArg active, ffi::RemainingArgs args,
                             ffi::Result<ffi::Token>, ffi::RemainingRets rets,
                             int64_t poll_us) {
  Counted counted;
  PollScope poll(poll_us);
  if (args.size() != rets.size()) {
    return ffi::Error::InvalidArgument(
        "jaxsync_reduce_scatter: as many results as buffers expected");
  }
  const bool on = active.typed_data()[0] != 0;
  int64_t in_bytes = 0;
  for (size_t i = 0; i < args.size(); ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    if (in.has_value()) in_bytes += static_cast<int64_t>(in->size_bytes());
  }
  Span span(kReduceScatter, comm.typed_data()[0], on ? in_bytes : 0);
  MPI_Comm c = CommOf(comm);
  int size = 1;
  if (on) {
    if (int rc = MPI_Comm_size(c, &size); rc != MPI_SUCCESS) return MpiError(rc, "MPI_Comm_size");
  }
  const size_t p = static_cast<size_t>(size);
  for (size_t i = 0; i < args.size(); ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    auto res = rets.get<ffi::AnyBuffer>(i);
    if (!in.has_value()) return in.error();
    if (!res.has_value()) return res.error();
    char* out = static_cast<char*>((*res)->untyped_data());
    if (!on) {  // discarded by the caller
      std::memset(out, 0, (*res)->size_bytes());
      continue;
    }
    TierType type;
    if (!TierTypeOf(in->element_type(), &type)) {
      return Unsupported("jaxsync_reduce_scatter", in->element_type());
    }
    const size_t n = in->element_count();
    const size_t m = (n + p - 1) / p;
    const size_t item = type.item;
    const char* src = static_cast<const char*>(in->untyped_data());
    // In place: every chunk below reads its columns of every row before it
    // writes them to the first row's place, so the rows still to read stay.
    const bool in_place = out == src && (*res)->element_count() == n;
    if ((*res)->element_count() != m && !in_place) {
      return ffi::Error::InvalidArgument(
          "jaxsync_reduce_scatter: the result must hold ceil(n / size) elements");
    }
    if (!type.low && n == m * p && m <= kTierChunk) {  // summed from where it is
      if (m == 0) continue;
      int rc = ReduceScatterBlock(in_place ? MPI_IN_PLACE : src, out,
                                        static_cast<int>(m), type.mpi, MPI_SUM, c);
      if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Reduce_scatter_block");
      continue;
    }
    // Columns [a, a + k) of every rank's slice, laid out rank after rank in
    // scratch (widened to float32 for 16-bit data; zeros beyond n).
    const size_t step = std::max<size_t>(std::min(kLowChunk, kTierChunk) / p, 1);
    for (size_t a = 0; a < m; a += step) {
      const size_t k = std::min(step, m - a);
      std::vector<char>& arena = TierArena((p + 1) * k * type.width);
      char* send = arena.data();
      char* mine = send + p * k * type.width;
      for (size_t j = 0; j < p; ++j) {
        const size_t lo = std::min(n, j * m + a), hi = std::min(n, j * m + a + k);
        char* row = send + j * k * type.width;
        if (type.low) {
          Widen(reinterpret_cast<const uint16_t*>(src) + lo, reinterpret_cast<float*>(row),
                hi - lo, type.t == ffi::DataType::BF16);
        } else {
          std::memcpy(row, src + lo * item, (hi - lo) * item);
        }
        std::memset(row + (hi - lo) * type.width, 0, (k - (hi - lo)) * type.width);
      }
      int rc = ReduceScatterBlock(send, mine, static_cast<int>(k), type.mpi, MPI_SUM, c);
      if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Reduce_scatter_block");
      if (type.low) {
        Narrow(reinterpret_cast<float*>(mine), reinterpret_cast<uint16_t*>(out) + a, k,
               type.t == ffi::DataType::BF16);
      } else {
        std::memcpy(out + a * item, mine, k * item);
      }
    }
  }
  return ffi::Error::Success();
}


}  // namespace
}  // namespace jaxsync

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsync_reduce, jaxsync::ReduceImpl,
                              jaxsync::BindCollective().Attr<int64_t>("group_bytes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsync_bcast, jaxsync::BcastImpl,
                              jaxsync::BindCollective().Attr<int64_t>("group_bytes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsync_reduce_scatter, jaxsync::ReduceScatterImpl,
                              jaxsync::BindCollective().Attr<int64_t>("poll_us"));
