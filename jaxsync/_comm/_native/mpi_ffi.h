#ifndef JAXSYNC_MPI_FFI_H_
#define JAXSYNC_MPI_FFI_H_

// jaxsync's XLA FFI targets for MPI collectives on the CPU platform: what
// their files share. One shared library (setup.py) of the files of this folder:
//   mpi_ffi.cc  dtypes, errors, MPI's count limit, waits, call counters, the
//               timeline, the C entry points Python reads
//   sums.cc     jaxsync_allreduce, jaxsync_allreduce_async (lanes), jaxsync_tie
//   low16.cc    float16/bfloat16 sums in float32 (all-to-all; two processes' op)
//   move.cc     jaxsync_allgather, jaxsync_alltoall
//   agree.cc    jaxsync_agree (every synchronisation's header), jaxsync_step
//   tier.cc     the host tier: jaxsync_reduce, jaxsync_bcast, jaxsync_reduce_scatter
//   tier_pipe.cc  jaxsync_tier: the host tier's three steps in one call,
//               pipelined over chunks with nonblocking MPI
//   inflight.cc jaxsync_inflight_start / _finish: a float32 sum that stays in
//               flight across separate jitted calls (jaxsync.local's streaming)
//
// Every handler but jaxsync_tie (and jaxsync_tier, below) takes (token, comm, active, buffers...) and returns
// (token, results...):
//   token   orders the calls: each call consumes the token of the previous one.
//   comm    int32 scalar: a Fortran handle of an MPI communicator
//           (mpi4py's comm.py2f()), turned into MPI_Comm by MPI_Comm_f2c. An
//           operand, not an attribute, so each local device of a multi-device
//           process can pick its own communicator at run time.
//   active  int32 scalar: 0 makes the call return at once without touching
//           MPI (in a multi-device process only local device 0 talks to the
//           other processes; the others leave their buffers as they are).
//
// jaxsync_allreduce sums any number of buffers in one call. The lowering
// aliases each result to its input, so result and input share memory and the
// sum is done with MPI_IN_PLACE (out of place when XLA did not alias them).
// Buffers under `group_bytes` (64 KiB by default; flat passes its bucket size)
// of one dtype are summed together through a per-thread scratch arena (groups
// of at most max(group_bytes, 4 MiB), reused): one MPI call instead of one
// each. All 32/64-bit sums of a call are started (MPI_Iallreduce) before any
// is waited for.
// float16/bfloat16 buffers are never summed in 16 bits (MPI has no such sum).
// Between two processes they join the other sums with a user-defined MPI
// operation (one float32 add, one rounding per element). With more processes
// all of them of one dtype go, in chunks, through ChainerMN's inter-node step:
// one MPI_Alltoall of the 16-bit payload, each process sums its slice of every
// process's data in float32 in rank order (((r0 + r1) + r2) + ...) and rounds
// once to nearest even, one MPI_Allgather of the rounded slices. The bits are
// those of jaxsync's XLA path for 16-bit data (_strategies._sum_low).
// jaxsync_allreduce_async is the same sum, done on a communication thread of
// the communicator while XLA runs on (overlap; see "Overlap" in sums.cc).
// jaxsync_allgather / jaxsync_alltoall move one buffer each.
// jaxsync_tie (no token, no communicator) returns its buffers: an ordering
// point that XLA keeps (see "jaxsync_tie" in sums.cc).
// MPI's counts are int: every call is given at most MaxCount() (INT_MAX)
// elements, longer buffers are split into several calls, so a buffer of any
// size travels.
// jaxsync_reduce / jaxsync_bcast / jaxsync_reduce_scatter are the host tier's
// steps among the processes of one host (see "The host tier" in tier.cc);
// jaxsync_tier (comm and active int32[2]) does the three in one call, pipelined
// over chunks (tier_pipe.cc).
//
// MPI failures come back as ffi::Error carrying MPI's error string (the
// communicators need MPI_ERRORS_RETURN, mpi4py's default).

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <condition_variable>
#include <deque>
#include <functional>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Scalar operands (aliases: a comma inside a macro argument would split it).
using CommArg = ffi::BufferR0<ffi::S32>;
using ActiveArg = ffi::BufferR0<ffi::S32>;

namespace jaxsync {

// The binding of a handler that takes (token, comm, active, buffers...) and
// returns (token, results...) (see the top of this file), before its
// attributes: comm of type Comm, active of type Active (jaxsync_tier's are
// int32[2]; in a handler's definition in parentheses, as the macro would split
// the template's arguments at their comma).
template <typename Comm, typename Active>
auto BindCollective() {
  return ffi::Ffi::Bind()
      .Arg<ffi::Token>()
      .Arg<Comm>()
      .template Arg<Active>()
      .RemainingArgs()
      .template Ret<ffi::Token>()
      .RemainingRets();
}

// The same with comm and active int32 scalars: every such handler but jaxsync_tier.
inline auto BindCollective() { return BindCollective<CommArg, ActiveArg>(); }

const char* DtypeName(ffi::DataType t);
// MPI datatype for summing `t`; false if summing it is not supported.
bool SumType(ffi::DataType t, MPI_Datatype* out);
// MPI datatype for moving `t` unchanged; 16-bit floats travel as uint16 bits.
bool MoveType(ffi::DataType t, MPI_Datatype* out);
ffi::Error MpiError(int code, const char* what);
ffi::Error Unsupported(const char* what, ffi::DataType t);

// The most elements one MPI call is given (MPI's counts are int): every call
// whose count could be larger is split into calls of at most this many, so a
// buffer of any size travels (2^31 bfloat16 elements and more). The private
// knob JAXSYNC_TESTING_MAX_COUNT lowers it (read once), so that the tests can
// cross it without 4 GiB buffers; it is not a tuning parameter.
size_t MaxCount();

MPI_Comm CommOf(const CommArg& comm);

// Buffers below `small` bytes are summed in groups through a scratch arena;
// a group holds at most max(small, kGroupBytes) bytes of one dtype.
constexpr size_t kSmallBytes = 64 << 10;
constexpr size_t kGroupBytes = 4 << 20;
// The arena holds every group of a call at once up to this size; beyond it,
// the sums in flight are finished before the arena is reused.
constexpr size_t kArenaBytes = 64 << 20;

// The most elements one host-tier MPI call moves (MPI's count is an int).
constexpr size_t kTierChunk = size_t{1} << 28;

// How a buffer is summed on the host tier (jaxsync_reduce, jaxsync_bcast,
// jaxsync_reduce_scatter and the pipelined jaxsync_tier): its MPI type and
// element width there (16-bit floats: float32).
struct TierType {
  ffi::DataType t;
  MPI_Datatype mpi;  // as summed on the host
  size_t width;      // bytes per element as summed on the host
  size_t item;       // bytes per element of the buffer
  bool low;
};

// The TierType of `t`; false if summing it is not supported (tier.cc).
bool TierTypeOf(ffi::DataType t, TierType* out);

// How a thread waits for its MPI calls: 0 MPI_Waitall, which spins; > 0:
// MPI_Testall in a loop, yielding the core between tests, for 1 ms (a call that
// ends within that, as on a fast network, is not held up), then test and sleep
// between tests an eighth of the time waited, at most poll_us microseconds (Poll
// in mpi_ffi.cc), which leaves the cores to the step's compute (the MPI progress
// of the other processes of the host, and on the emulated cluster the other
// hosts). Each call says which
// (its poll_us attribute, set for the call's own waits by PollScope, on XLA's
// thread or a lane's):
// jaxsync polls on communicators that span hosts, where the network, not the
// CPU, sets the pace; it spins within a host, where shared-memory copies need
// the CPU. The private knob JAXSYNC_TESTING_POLL_US overrides it, to profile.
extern thread_local int64_t t_poll_us;
int WaitAll(std::vector<MPI_Request>& reqs, std::vector<MPI_Status>& st);
// The same for one request (its status ignored), waiting as `poll_us` says.
int WaitOne(MPI_Request* req, int64_t poll_us = t_poll_us);
// A call's poll_us attribute, or JAXSYNC_TESTING_POLL_US where set.
int64_t PollUs(int64_t poll_us);

// t_poll_us for the lifetime of one call (the thread's previous value after).
class PollScope {
 public:
  explicit PollScope(int64_t poll_us) : prev_(t_poll_us) { t_poll_us = PollUs(poll_us); }
  ~PollScope() { t_poll_us = prev_; }

 private:
  int64_t prev_;
};

// The blocking collectives, waiting as t_poll_us says (> 0: the nonblocking
// call, then WaitOne; 0: the blocking call itself).
int Allgather(const void* s, int sc, MPI_Datatype st, void* d, int dc, MPI_Datatype dt,
              MPI_Comm c);
int Alltoall(const void* s, int sc, MPI_Datatype st, void* d, int dc, MPI_Datatype dt,
             MPI_Comm c);
int ReduceScatterBlock(const void* s, void* d, int count, MPI_Datatype t, MPI_Op op,
                       MPI_Comm c);

// Runs `job` on the communication thread (lane) of the communicator with
// Fortran handle `handle`, after the jobs queued there before it (sums.cc).
void PushLane(MPI_Fint handle, std::function<void()> job);

// The sum of one buffer of `count` elements of `t` over `c`, in place, as
// jaxsync_allreduce sums it (16-bit floats in float32, rounded once; pieces of
// at most piece_bytes where > 0).
ffi::Error SumBuffer(MPI_Comm c, ffi::DataType t, void* data, size_t count, int64_t piece_bytes);

// A communicator that spans hosts keeps at most this many sums in flight (see
// Sums in sums.cc; measured in _mpi_ops.py's PIECE_BYTES).
constexpr size_t kPiecesInFlight = 2;

// ---- 16-bit floats <-> float32, exact, round to nearest even -------------
// (bfloat16: the top half of a float32; float16: IEEE binary16, as in the FP16
// library of M. Dukhan; no compiler extension needed.)

inline float BitsToF32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t F32ToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float Bf16ToF32(uint16_t h) { return BitsToF32(static_cast<uint32_t>(h) << 16); }

inline uint16_t F32ToBf16(float f) {
  uint32_t u = F32ToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: a quiet NaN of the same sign
    return (u & 0x80000000u) ? 0xffc0 : 0x7fc0;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float F16ToF32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = BitsToF32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = BitsToF32((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t bits = two_w < (1u << 27) ? F32ToBits(denormalized) : F32ToBits(normalized);
  return BitsToF32(sign | bits);
}

inline uint16_t F32ToF16(float f) {
  float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = F32ToBits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = BitsToF32((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = F32ToBits(base);
  const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = bits & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

// n 16-bit floats widened to float32 (exact) / float32 rounded to nearest even.
inline void Widen(const uint16_t* src, float* dst, size_t n, bool bf16) {
  if (bf16) {
    for (size_t i = 0; i < n; ++i) dst[i] = Bf16ToF32(src[i]);
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] = F16ToF32(src[i]);
  }
}

inline void Narrow(const float* src, uint16_t* dst, size_t n, bool bf16) {
  if (bf16) {
    for (size_t i = 0; i < n; ++i) dst[i] = F32ToBf16(src[i]);
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] = F32ToF16(src[i]);
  }
}

inline bool IsLow(ffi::DataType t) {
  return t == ffi::DataType::F16 || t == ffi::DataType::BF16;
}

// The 16-bit buffers of one dtype in one call, summed in float32 (see the top
// of this file). Chunks of at most kLowChunk elements: scratch stays small and
// is reused (no fresh pages per call).
constexpr size_t kLowChunk = 1 << 20;
constexpr size_t kLowDirect = 16 << 10;  // elements; smaller buffers are grouped

class Low16 {
 public:
  void Add(uint16_t* src, uint16_t* dst, size_t n) {
    if (n) parts_.push_back({src, dst, n});
    total_ += n;
  }

  ffi::Error Run(MPI_Comm c, bool bf16);

 private:
  struct Part {
    uint16_t* src;
    uint16_t* dst;
    size_t n;
  };
  std::vector<Part> parts_;
  size_t total_ = 0;
};

// Two processes: a 16-bit sum with one float32 add and one rounding per
// element is what MPI computes with this commutative user operation, whatever
// its algorithm (each element is combined once: round(a + b) == round(b + a)),
// so the 16-bit buffers join the other sums (in place, no all-to-all, no
// copies). With more processes MPI would round after every partial sum, so
// they take Low16's all-to-all instead.
ffi::Error Sum16Op(bool bf16, MPI_Op* out);

// p rows of m 16-bit floats summed per column in float32, row after row, and
// rounded once into `out` (m elements): Low16's step, and the pipelined tier's.
void SumRows16(const uint16_t* rows, size_t p, size_t m, uint16_t* out, bool bf16);

// Calls begun and finished, for the drain at exit: Python waits until no call
// is running and none has started or finished for a while, so no step is still
// running (and calling back into Python) while the interpreter shuts down.
extern std::atomic<int64_t> g_started;
extern std::atomic<int64_t> g_finished;

struct Counted {
  Counted() { g_started.fetch_add(1, std::memory_order_relaxed); }
  ~Counted() { g_finished.fetch_add(1, std::memory_order_release); }
};

// A lane job's end: counted as finished, its future set (the error, or available).
inline void Settle(ffi::Promise& promise, ffi::Error e) {
  g_finished.fetch_add(1, std::memory_order_release);
  if (e.failure()) {
    promise.SetError(std::move(e));
  } else {
    promise.SetAvailable();
  }
}

// ---- The timeline (jaxsync.timeline, JAXSYNC_TIMELINE) -------------------
// While it is on, every call that talks MPI records what it did and when, on
// which thread: 8 int64 per event (kind, communicator handle, bytes, queued,
// started, ended in ns of CLOCK_MONOTONIC, Python's time.monotonic_ns; queued is
// -1 where the call runs where it was made; thread id; 1 on a communication
// lane). Off (the default) it costs one relaxed atomic load per call; nothing
// of it is in the lowered step. Python drains the events (jaxsync_timeline_drain).
enum TimelineKind : int64_t {
  kAllreduce = 0, kAllreduceAsync, kAllgather, kAlltoall_, kReduce, kBcast, kReduceScatter, kAgree,
  kTier  // jaxsync_tier: the host tier's three steps in one call (on the host's communicator)
};
extern std::atomic<bool> g_timeline;
extern std::mutex g_timeline_mu;
extern std::vector<int64_t>* g_timeline_events;

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline int64_t ThreadId() {
  return static_cast<int64_t>(std::hash<std::thread::id>()(std::this_thread::get_id()) >> 1);
}

void Record(int64_t kind, int64_t comm, int64_t bytes, int64_t queued, int64_t start,
            int64_t end, bool lane);

// One call's event, recorded when the call returns (if the timeline is on).
class Span {
 public:
  Span(int64_t kind, int64_t comm, int64_t bytes)
      : on_(g_timeline.load(std::memory_order_relaxed)), kind_(kind), comm_(comm),
        bytes_(bytes), start_(on_ ? NowNs() : 0) {}
  ~Span() {
    if (on_) Record(kind_, comm_, bytes_, -1, start_, NowNs(), false);
  }

 private:
  bool on_;
  int64_t kind_, comm_, bytes_, start_;
};

}  // namespace jaxsync

#endif  // JAXSYNC_MPI_FFI_H_
