// jaxsync_tier: the host tier's three stages in one call, pipelined over chunks.
//
// Takes (token, comms, active, buffers...) and returns (token, results...),
// each result aliased to its buffer (in place). comms is int32[2]: the Fortran
// handles of this host's processes (rank 0 the leader) and of this local rank's
// processes on every host; active is int32[2]: whether this device takes part
// at all (0: the buffers are returned untouched) and whether it talks to the
// other hosts.
//
// leader_only (flat, hierarchical): the host's sum onto its leader, the
// leaders' allreduce, the leader's result broadcast on the host. Otherwise
// (two_dimensional): a reduce-scatter over the host, each local rank's slice
// allreduced with the same local rank of the other hosts, an all-gather over
// the host.
//
// The buffers are cut into chunks of at most `chunk_bytes` (leader_only:
// consecutive buffers of one dtype share chunks, a chunk boundary may fall
// inside a buffer; two_dimensional: each buffer's slice in column chunks), and
// the three stages run at once over consecutive chunks with nonblocking MPI:
// while chunk t is summed on the host, chunk t - 1 crosses the hosts and chunk
// t - 2 is broadcast (gathered) on the host. Every process starts its
// collectives on each communicator in the same order (chunk order, one fixed
// schedule), so they match whatever the timing.
//
// The sums are those of jaxsync_reduce / jaxsync_allreduce / jaxsync_bcast
// (jaxsync_reduce_scatter / jaxsync_allreduce / jaxsync_allgather) one after
// the other: float16/bfloat16 summed on the host in float32 and rounded once,
// the rounded values summed across the hosts in float32 and rounded once more
// (two hosts: MPI's sum with jaxsync's 16-bit operation; more: an all-to-all
// of the 16-bit payload, float32 sums in host order, an all-gather).
//
// Waits poll (poll_us > 0: MPI_Test, then sleep) rather than spin: see Pipe::Wait.

#include "mpi_ffi.h"

namespace jaxsync {
namespace {

using Pair = ffi::BufferR1<ffi::S32>;

struct Piece {
  char* at;  // in the result buffer
  size_t n;  // elements
};

// One chunk: leader_only, `pieces` of one dtype (n elements in all);
// two_dimensional, columns [a, a + n) of every rank's slice (m elements) of
// the buffer at pieces[0] (total elements `len`).
struct Chunk {
  TierType type;
  std::vector<Piece> pieces;
  size_t n = 0;
  size_t m = 0, a = 0, len = 0;
};

// One chunk in flight: its requests and its scratch (reused round-robin).
struct Slot {
  MPI_Request host = MPI_REQUEST_NULL, cross = MPI_REQUEST_NULL, last = MPI_REQUEST_NULL;
  std::vector<char> sum;       // host stage, as summed (leader_only: the chunk packed)
  std::vector<char> mine;      // two_dimensional: this rank's summed columns
  std::vector<uint16_t> wire;  // 16-bit: the rounded chunk as it crosses (padded)
  std::vector<uint16_t> recv;  // 16-bit over more than two hosts: the all-to-all's rows
  std::vector<char> gather;    // two_dimensional: every rank's columns
  char* data = nullptr;        // what crosses and is broadcast
};

constexpr size_t kSlots = 4;  // chunk t is in flight from step t to step t + 3

class Pipe {
 public:
  Pipe(MPI_Comm host, MPI_Comm cross, bool lead, bool leader_only, int64_t poll_us)
      : host_(host), cross_(cross), lead_(lead), leader_only_(leader_only), poll_us_(poll_us) {
    static thread_local Slot slots[kSlots];  // scratch reused by the calls of a thread
    slots_ = slots;
  }

  ~Pipe() {  // an error left requests in flight: their buffers must outlive them
    for (size_t i = 0; i < kSlots; ++i) {
      Slot& s = slots_[i];
      MPI_Request r[3] = {s.host, s.cross, s.last};
      MPI_Waitall(3, r, MPI_STATUSES_IGNORE);
      s.host = s.cross = s.last = MPI_REQUEST_NULL;
    }
  }

  ffi::Error Init() {
    int rc = MPI_Comm_rank(host_, &rank_);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_size(host_, &size_);
    if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Comm_rank (host tier)");
    if (lead_) {
      rc = MPI_Comm_size(cross_, &hosts_);
      if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Comm_size (host tier)");
    }
    return ffi::Error::Success();
  }

  int size() const { return size_; }

  ffi::Error Run(std::vector<Chunk>& chunks) {
    const size_t c = chunks.size();
    for (size_t t = 0; t < c + 3; ++t) {
      if (t < c) {
        if (auto e = StartHost(chunks[t], slots_[t % kSlots]); e.failure()) return e;
      }
      if (t >= 1 && t - 1 < c) {
        if (auto e = StartCross(chunks[t - 1], slots_[(t - 1) % kSlots]); e.failure()) return e;
      }
      if (t >= 2 && t - 2 < c) {
        if (auto e = StartLast(chunks[t - 2], slots_[(t - 2) % kSlots]); e.failure()) return e;
      }
      if (t >= 3 && t - 3 < c) {
        if (auto e = Finish(chunks[t - 3], slots_[(t - 3) % kSlots]); e.failure()) return e;
      }
    }
    return ffi::Error::Success();
  }

 private:
  // poll_us_ > 0: test, then sleep (the call spans hosts: the wire sets its pace,
  // and every process of a host spinning in MPI_Wait took the cores from the
  // kernel's network work and the leaders' sums); MPI_Test drives every request
  // in flight, so the host stages progress in each test too.
  ffi::Error Wait(MPI_Request* r, const char* what) const {
    int rc = WaitOne(r, poll_us_);
    return rc == MPI_SUCCESS ? ffi::Error::Success() : MpiError(rc, what);
  }

  bool root() const { return rank_ == 0; }
  bool low2() const { return hosts_ == 2; }

  // Stage 1: the host's sum (onto the leader, or scattered).
  ffi::Error StartHost(const Chunk& ch, Slot& s) {
    const TierType& ty = ch.type;
    const bool bf16 = ty.t == ffi::DataType::BF16;
    if (leader_only_) {
      char* at;
      if (!ty.low && ch.pieces.size() == 1) {
        at = ch.pieces[0].at;  // summed where it is
      } else {
        if (s.sum.size() < ch.n * ty.width) s.sum.resize(ch.n * ty.width);
        at = s.sum.data();
        size_t off = 0;
        for (const Piece& p : ch.pieces) {
          if (ty.low) {
            Widen(reinterpret_cast<uint16_t*>(p.at), reinterpret_cast<float*>(at) + off, p.n,
                    bf16);
          } else {
            std::memcpy(at + off * ty.width, p.at, p.n * ty.width);
          }
          off += p.n;
        }
      }
      s.data = at;
      int rc = MPI_Ireduce(root() ? MPI_IN_PLACE : at, root() ? at : nullptr,
                           static_cast<int>(ch.n), ty.mpi, MPI_SUM, 0, host_, &s.host);
      return rc == MPI_SUCCESS ? ffi::Error::Success() : MpiError(rc, "MPI_Ireduce");
    }
    // Columns [a, a + n) of every rank's slice, rank after rank (zeros past len).
    const size_t p = static_cast<size_t>(size_), k = ch.n;
    if (s.sum.size() < p * k * ty.width) s.sum.resize(p * k * ty.width);
    if (s.mine.size() < k * ty.width) s.mine.resize(k * ty.width);
    const char* src = ch.pieces[0].at;
    for (size_t j = 0; j < p; ++j) {
      const size_t lo = std::min(ch.len, j * ch.m + ch.a);
      const size_t hi = std::min(ch.len, j * ch.m + ch.a + k);
      char* row = s.sum.data() + j * k * ty.width;
      if (ty.low) {
        Widen(reinterpret_cast<const uint16_t*>(src) + lo, reinterpret_cast<float*>(row),
                hi - lo, bf16);
      } else {
        std::memcpy(row, src + lo * ty.item, (hi - lo) * ty.item);
      }
      std::memset(row + (hi - lo) * ty.width, 0, (k - (hi - lo)) * ty.width);
    }
    int rc = MPI_Ireduce_scatter_block(s.sum.data(), s.mine.data(), static_cast<int>(k), ty.mpi,
                                       MPI_SUM, host_, &s.host);
    return rc == MPI_SUCCESS ? ffi::Error::Success() : MpiError(rc, "MPI_Ireduce_scatter_block");
  }

  // Stage 2: the hosts' sum of what stage 1 left (on the leader, or each slice).
  ffi::Error StartCross(const Chunk& ch, Slot& s) {
    if (auto e = Wait(&s.host, leader_only_ ? "MPI_Ireduce" : "MPI_Ireduce_scatter_block");
        e.failure()) {
      return e;
    }
    const bool mine = leader_only_ ? root() : true;  // this rank holds a summed chunk
    if (!mine) return ffi::Error::Success();
    const TierType& ty = ch.type;
    const size_t k = ch.n;
    char* summed = leader_only_ ? s.data : s.mine.data();
    if (ty.low) {  // rounded once here, as jaxsync_reduce / _reduce_scatter do
      const size_t hp = hosts_ > 2 ? static_cast<size_t>(hosts_) : 1;
      const size_t padded = (k + hp - 1) / hp * hp;
      if (s.wire.size() < padded) s.wire.resize(padded);
      Narrow(reinterpret_cast<float*>(summed), s.wire.data(), k,
               ty.t == ffi::DataType::BF16);
      std::fill(s.wire.begin() + k, s.wire.begin() + padded, uint16_t{0});
      s.data = reinterpret_cast<char*>(s.wire.data());
    } else {
      s.data = summed;
    }
    if (!lead_ || hosts_ <= 1) return ffi::Error::Success();
    int rc;
    if (!ty.low) {
      rc = MPI_Iallreduce(MPI_IN_PLACE, s.data, static_cast<int>(k), ty.mpi, MPI_SUM, cross_,
                          &s.cross);
      return rc == MPI_SUCCESS ? ffi::Error::Success() : MpiError(rc, "MPI_Iallreduce");
    }
    if (low2()) {
      MPI_Op op;
      if (auto e = Sum16Op(ty.t == ffi::DataType::BF16, &op); e.failure()) return e;
      rc = MPI_Iallreduce(MPI_IN_PLACE, s.data, static_cast<int>(k), MPI_UINT16_T, op, cross_,
                          &s.cross);
      return rc == MPI_SUCCESS ? ffi::Error::Success() : MpiError(rc, "MPI_Iallreduce");
    }
    const size_t hp = static_cast<size_t>(hosts_);
    const size_t m = (k + hp - 1) / hp;
    if (s.recv.size() < m * hp) s.recv.resize(m * hp);
    rc = MPI_Ialltoall(s.wire.data(), static_cast<int>(m), MPI_UINT16_T, s.recv.data(),
                       static_cast<int>(m), MPI_UINT16_T, cross_, &s.cross);
    return rc == MPI_SUCCESS ? ffi::Error::Success() : MpiError(rc, "MPI_Ialltoall");
  }

  // Stage 3: the hosts' sum back to every process of the host.
  ffi::Error StartLast(const Chunk& ch, Slot& s) {
    const TierType& ty = ch.type;
    const size_t k = ch.n;
    const bool mine = leader_only_ ? root() : true;
    if (mine && lead_ && hosts_ > 1) {
      if (auto e = Wait(&s.cross, "the hosts' sum"); e.failure()) return e;
      if (ty.low && !low2()) {  // this host's columns summed, then every host's
        const size_t hp = static_cast<size_t>(hosts_);
        const size_t m = (k + hp - 1) / hp;
        int r = 0;
        if (int rc = MPI_Comm_rank(cross_, &r); rc != MPI_SUCCESS) {
          return MpiError(rc, "MPI_Comm_rank");
        }
        SumRows16(s.recv.data(), hp, m, s.wire.data() + static_cast<size_t>(r) * m,
                  ty.t == ffi::DataType::BF16);
        int rc = MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, s.wire.data(),
                                static_cast<int>(m), MPI_UINT16_T, cross_, &s.cross);
        if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Iallgather");
        if (auto e = Wait(&s.cross, "MPI_Iallgather"); e.failure()) return e;
      }
    }
    const size_t item = ty.item;
    if (leader_only_) {
      if (!root() && (ty.low || ch.pieces.size() > 1)) {  // received into scratch
        if (ty.low) {
          if (s.wire.size() < k) s.wire.resize(k);
          s.data = reinterpret_cast<char*>(s.wire.data());
        } else {
          s.data = s.sum.data();
        }
      }
      int rc = MPI_Ibcast(s.data, static_cast<int>(k * item), MPI_BYTE, 0, host_, &s.last);
      return rc == MPI_SUCCESS ? ffi::Error::Success() : MpiError(rc, "MPI_Ibcast");
    }
    const size_t p = static_cast<size_t>(size_);
    if (s.gather.size() < p * k * item) s.gather.resize(p * k * item);
    MPI_Datatype move = ty.low ? MPI_UINT16_T : ty.mpi;
    int rc = MPI_Iallgather(s.data, static_cast<int>(k), move, s.gather.data(),
                            static_cast<int>(k), move, host_, &s.last);
    return rc == MPI_SUCCESS ? ffi::Error::Success() : MpiError(rc, "MPI_Iallgather");
  }

  // The chunk's results into the buffers.
  ffi::Error Finish(const Chunk& ch, Slot& s) {
    if (auto e = Wait(&s.last, leader_only_ ? "MPI_Ibcast" : "MPI_Iallgather"); e.failure()) {
      return e;
    }
    const size_t item = ch.type.item;
    if (leader_only_) {
      if (!ch.type.low && ch.pieces.size() == 1) return ffi::Error::Success();  // in place
      size_t off = 0;
      for (const Piece& p : ch.pieces) {
        std::memcpy(p.at, s.data + off * item, p.n * item);
        off += p.n;
      }
      return ffi::Error::Success();
    }
    const size_t p = static_cast<size_t>(size_), k = ch.n;
    char* dst = ch.pieces[0].at;
    for (size_t j = 0; j < p; ++j) {
      const size_t lo = std::min(ch.len, j * ch.m + ch.a);
      const size_t hi = std::min(ch.len, j * ch.m + ch.a + k);
      std::memcpy(dst + lo * item, s.gather.data() + j * k * item, (hi - lo) * item);
    }
    return ffi::Error::Success();
  }

  MPI_Comm host_, cross_;
  bool lead_, leader_only_;
  int64_t poll_us_;
  int rank_ = 0, size_ = 1, hosts_ = 1;
  Slot* slots_;
};

// The most elements of a chunk: `chunk_bytes` of the buffer's elements, within
// MPI's int counts (two_dimensional: per rank's slice, p of them per message).
size_t ChunkElems(int64_t chunk_bytes, size_t item, size_t p) {
  const size_t bytes = chunk_bytes > 0 ? static_cast<size_t>(chunk_bytes) : 1;
  size_t cap = std::max<size_t>(bytes / item, 1);
  cap = std::min(cap, std::min(MaxCount(), kTierChunk) / 4);  // bytes of a broadcast too
  return std::max<size_t>(cap / p, 1);
}

ffi::Error TierImpl(ffi::Token, Pair comms, Pair active, ffi::RemainingArgs args,
                    ffi::Result<ffi::Token>, ffi::RemainingRets rets, int64_t chunk_bytes,
                    int64_t leader_only, int64_t poll_us) {
  Counted counted;
  if (args.size() != rets.size()) {
    return ffi::Error::InvalidArgument("jaxsync_tier: as many results as buffers expected");
  }
  if (comms.element_count() != 2 || active.element_count() != 2) {
    return ffi::Error::InvalidArgument("jaxsync_tier: comms and active hold 2 values each");
  }
  struct Buf {
    TierType type;
    char* at;
    size_t n;
  };
  std::vector<Buf> bufs;
  int64_t bytes = 0;
  for (size_t i = 0; i < args.size(); ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    auto res = rets.get<ffi::AnyBuffer>(i);
    if (!in.has_value()) return in.error();
    if (!res.has_value()) return res.error();
    TierType ty;
    if (!TierTypeOf(in->element_type(), &ty)) return Unsupported("jaxsync_tier", in->element_type());
    char* src = static_cast<char*>(in->untyped_data());
    char* dst = static_cast<char*>((*res)->untyped_data());
    if (src != dst) std::memcpy(dst, src, in->size_bytes());
    bufs.push_back({ty, dst, in->element_count()});
    bytes += static_cast<int64_t>(in->size_bytes());
  }
  if (active.typed_data()[0] == 0) return ffi::Error::Success();
  const int32_t* h = comms.typed_data();
  Span span(kTier, h[0], bytes);
  Pipe pipe(MPI_Comm_f2c(static_cast<MPI_Fint>(h[0])), MPI_Comm_f2c(static_cast<MPI_Fint>(h[1])),
            active.typed_data()[1] != 0, leader_only != 0, PollUs(poll_us));
  if (auto e = pipe.Init(); e.failure()) return e;
  std::vector<Chunk> chunks;
  if (leader_only) {  // consecutive buffers of one dtype share chunks
    for (const Buf& b : bufs) {
      const size_t cap = ChunkElems(chunk_bytes, b.type.item, 1);
      for (size_t o = 0; o < b.n;) {
        if (chunks.empty() || chunks.back().type.t != b.type.t || chunks.back().n == cap) {
          chunks.push_back(Chunk{b.type, {}, 0});
        }
        Chunk& ch = chunks.back();
        const size_t take = std::min(cap - ch.n, b.n - o);
        ch.pieces.push_back({b.at + o * b.type.item, take});
        ch.n += take;
        o += take;
      }
    }
  } else {  // each buffer's slices in column chunks
    const size_t p = static_cast<size_t>(pipe.size());
    for (const Buf& b : bufs) {
      const size_t m = (b.n + p - 1) / p;
      const size_t cap = ChunkElems(chunk_bytes, b.type.item, p);
      for (size_t a = 0; a < m; a += cap) {
        Chunk ch{b.type, {{b.at, 0}}, std::min(cap, m - a)};
        ch.m = m;
        ch.a = a;
        ch.len = b.n;
        chunks.push_back(std::move(ch));
      }
    }
  }
  return pipe.Run(chunks);
}

}  // namespace
}  // namespace jaxsync

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsync_tier, jaxsync::TierImpl,
                              (jaxsync::BindCollective<jaxsync::Pair, jaxsync::Pair>())
                                  .Attr<int64_t>("chunk_bytes")
                                  .Attr<int64_t>("leader_only")
                                  .Attr<int64_t>("poll_us"));
