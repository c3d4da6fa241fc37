// jaxsync's XLA FFI targets for MPI collectives on the CPU platform.
//
// Every handler but jaxsync_tie takes (token, comm, active, buffers...) and returns
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
// the communicator while XLA runs on (overlap; see "Overlap" below).
// jaxsync_allgather / jaxsync_alltoall move one buffer each.
// jaxsync_tie (no token, no communicator) returns its buffers: an ordering
// point that XLA keeps (see "jaxsync_tie" below).
// MPI's counts are int: every call is given at most MaxCount() (INT_MAX)
// elements, longer buffers are split into several calls, so a buffer of any
// size travels.
// jaxsync_reduce / jaxsync_bcast / jaxsync_reduce_scatter are the host tier's
// steps among the processes of one host (see "The host tier" below).
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

namespace {

const char* DtypeName(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::PRED: return "bool";
    case ffi::DataType::S8: return "int8";
    case ffi::DataType::S16: return "int16";
    case ffi::DataType::S32: return "int32";
    case ffi::DataType::S64: return "int64";
    case ffi::DataType::U8: return "uint8";
    case ffi::DataType::U16: return "uint16";
    case ffi::DataType::U32: return "uint32";
    case ffi::DataType::U64: return "uint64";
    case ffi::DataType::F16: return "float16";
    case ffi::DataType::BF16: return "bfloat16";
    case ffi::DataType::F32: return "float32";
    case ffi::DataType::F64: return "float64";
    case ffi::DataType::C64: return "complex64";
    case ffi::DataType::C128: return "complex128";
    default: return "an unsupported element type";
  }
}

// MPI datatype for summing `t`; false if summing it is not supported.
bool SumType(ffi::DataType t, MPI_Datatype* out) {
  switch (t) {
    case ffi::DataType::F32: *out = MPI_FLOAT; return true;
    case ffi::DataType::F64: *out = MPI_DOUBLE; return true;
    case ffi::DataType::S8: *out = MPI_INT8_T; return true;
    case ffi::DataType::S16: *out = MPI_INT16_T; return true;
    case ffi::DataType::S32: *out = MPI_INT32_T; return true;
    case ffi::DataType::S64: *out = MPI_INT64_T; return true;
    case ffi::DataType::U8: *out = MPI_UINT8_T; return true;
    case ffi::DataType::U16: *out = MPI_UINT16_T; return true;
    case ffi::DataType::U32: *out = MPI_UINT32_T; return true;
    case ffi::DataType::U64: *out = MPI_UINT64_T; return true;
    default: return false;  // f16/bf16: MPI has no 16-bit float sum
  }
}

// MPI datatype for moving `t` unchanged; 16-bit floats travel as uint16 bits.
bool MoveType(ffi::DataType t, MPI_Datatype* out) {
  switch (t) {
    case ffi::DataType::F16:
    case ffi::DataType::BF16:
    case ffi::DataType::U16: *out = MPI_UINT16_T; return true;
    case ffi::DataType::PRED:
    case ffi::DataType::U8: *out = MPI_UINT8_T; return true;
    default: return SumType(t, out);
  }
}

ffi::Error MpiError(int code, const char* what) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) {
    len = 0;
  }
  return ffi::Error::Internal(std::string("jaxsync: ") + what + " failed: " +
                              std::string(text, len) + " (MPI error code " +
                              std::to_string(code) + ")");
}

ffi::Error Unsupported(const char* what, ffi::DataType t) {
  return ffi::Error::InvalidArgument(
      std::string("jaxsync: ") + what + " does not support dtype " +
      DtypeName(t) + "; expected float16, bfloat16, float32, float64 or an "
      "integer type");
}

// The most elements one MPI call is given (MPI's counts are int): every call
// whose count could be larger is split into calls of at most this many, so a
// buffer of any size travels (2^31 bfloat16 elements and more). The private
// knob JAXSYNC_TESTING_MAX_COUNT lowers it (read once), so that the tests can
// cross it without 4 GiB buffers; it is not a tuning parameter.
size_t MaxCount() {
  static const size_t limit = [] {
    size_t v = static_cast<size_t>(INT_MAX);
    if (const char* s = std::getenv("JAXSYNC_TESTING_MAX_COUNT")) {
      char* end = nullptr;
      const unsigned long long n = std::strtoull(s, &end, 10);
      if (end != s && *end == '\0' && n > 0 && n < v) v = static_cast<size_t>(n);
    }
    return v;
  }();
  return limit;
}

MPI_Comm CommOf(const CommArg& comm) {
  return MPI_Comm_f2c(static_cast<MPI_Fint>(comm.typed_data()[0]));
}

// Buffers below `small` bytes are summed in groups through a scratch arena;
// a group holds at most max(small, kGroupBytes) bytes of one dtype.
constexpr size_t kSmallBytes = 64 << 10;
constexpr size_t kGroupBytes = 4 << 20;
// The arena holds every group of a call at once up to this size; beyond it,
// the sums in flight are finished before the arena is reused.
constexpr size_t kArenaBytes = 64 << 20;

// How a communication thread waits for its sums (see Lane): 0 (always in XLA's
// own threads) MPI_Waitall, which spins; > 0: MPI_Testall, then sleep this many
// microseconds, which leaves the cores to the step's compute. Each async call
// says which (its poll_us attribute: jaxsync polls on communicators that span
// hosts, where the network, not the CPU, sets the pace; it spins within a host,
// where shared-memory copies need the CPU). The private knob
// JAXSYNC_TESTING_POLL_US overrides it for every lane, to profile.
thread_local int64_t t_poll_us = 0;

int WaitAll(std::vector<MPI_Request>& reqs, std::vector<MPI_Status>& st) {
  const int n = static_cast<int>(reqs.size());
  if (t_poll_us <= 0) return MPI_Waitall(n, reqs.data(), st.data());
  for (;;) {
    int done = 0;
    int rc = MPI_Testall(n, reqs.data(), &done, st.data());
    if (rc != MPI_SUCCESS || done) return rc;
    std::this_thread::sleep_for(std::chrono::microseconds(t_poll_us));
  }
}

// The 32/64-bit sums of one call. Every MPI_Iallreduce is started before any
// is waited for, so MPI overlaps their latencies (one blocking call per
// buffer waits for the slowest process once per buffer); grouped buffers are
// copied into the arena, summed in place there and copied back.
class Sums {
 public:
  Sums(MPI_Comm c, size_t small, size_t grouped_bytes)
      : c_(c), small_(small), group_cap_(std::max(small, kGroupBytes)) {
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

  // One MPI_Iallreduce per MaxCount() elements (one for any buffer below it).
  ffi::Error Start(const void* src, void* dst, size_t count, size_t width,
                   MPI_Datatype dtype, MPI_Op op) {
    const size_t most = MaxCount();
    for (size_t o = 0; o < count; o += most) {
      const int n = static_cast<int>(std::min(most, count - o));
      const void* s = src == MPI_IN_PLACE ? MPI_IN_PLACE
                                          : static_cast<const char*>(src) + o * width;
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
  size_t small_, group_cap_;
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

bool IsLow(ffi::DataType t) {
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

  ffi::Error Run(MPI_Comm c, bool bf16) {
    if (parts_.empty()) return ffi::Error::Success();
    int size = 0, rank = 0;
    int rc = MPI_Comm_size(c, &size);
    if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Comm_size");
    rc = MPI_Comm_rank(c, &rank);
    if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Comm_rank");
    const size_t p = static_cast<size_t>(size);
    // Large buffers travel from where they are: the all-to-all reads the
    // buffer, this process's float32 sums are rounded into its own slice of the
    // result, and an in-place all-gather fills the rest (no copies). What is
    // left (small buffers, the last n % p elements) is gathered into scratch.
    std::vector<Part> rest;
    size_t left = 0;
    for (const Part& q : parts_) {
      // Each MPI call moves m = chunk / p elements per process (m <= MaxCount()).
      const size_t chunk = std::max<size_t>(std::min(kLowChunk / p, MaxCount()), 1) * p;
      const size_t direct = q.n >= kLowDirect ? (q.n / p) * p : 0;
      for (size_t o = 0; o < direct; o += chunk) {
        const size_t k = std::min(chunk, direct - o);
        if (auto e = Direct(c, p, static_cast<size_t>(rank), q.src + o, q.dst + o, k, bf16);
            e.failure()) {
          return e;
        }
      }
      if (direct < q.n) {
        rest.push_back({q.src + direct, q.dst + direct, q.n - direct});
        left += q.n - direct;
      }
    }
    parts_.swap(rest);
    total_ = left;
    static thread_local std::vector<uint16_t> send, recv, mine;
    size_t part = 0, off = 0;  // cursor: element `off` of parts_[part]
    for (size_t done = 0; done < total_;) {
      const size_t k = std::min(std::min(kLowChunk, MaxCount()), total_ - done);
      const size_t m = (k + p - 1) / p;
      if (send.size() < m * p) send.resize(m * p);
      if (recv.size() < m * p) recv.resize(m * p);
      if (mine.size() < m) mine.resize(m);
      // Gather k elements from the buffers, pad with zeros.
      size_t got = 0, rp = part, ro = off;
      while (got < k) {
        const Part& q = parts_[rp];
        const size_t take = std::min(q.n - ro, k - got);
        std::memcpy(send.data() + got, q.src + ro, take * 2);
        got += take;
        ro += take;
        if (ro == q.n) { ++rp; ro = 0; }
      }
      std::memset(send.data() + k, 0, (m * p - k) * 2);
      rc = MPI_Alltoall(send.data(), static_cast<int>(m), MPI_UINT16_T, recv.data(),
                        static_cast<int>(m), MPI_UINT16_T, c);
      if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Alltoall");
      if (bf16) {
        SumRows(recv.data(), p, m, mine.data(), Bf16ToF32, F32ToBf16);
      } else {
        SumRows(recv.data(), p, m, mine.data(), F16ToF32, F32ToF16);
      }
      rc = MPI_Allgather(mine.data(), static_cast<int>(m), MPI_UINT16_T, send.data(),
                         static_cast<int>(m), MPI_UINT16_T, c);
      if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Allgather");
      // Scatter the k summed elements back.
      got = 0;
      while (got < k) {
        const Part& q = parts_[part];
        const size_t take = std::min(q.n - off, k - got);
        std::memcpy(q.dst + off, send.data() + got, take * 2);
        got += take;
        off += take;
        if (off == q.n) { ++part; off = 0; }
      }
      done += k;
    }
    return ffi::Error::Success();
  }

 private:
  // k elements (a multiple of p) summed where they are.
  static ffi::Error Direct(MPI_Comm c, size_t p, size_t rank, const uint16_t* src,
                           uint16_t* dst, size_t k, bool bf16) {
    static thread_local std::vector<uint16_t> recv;
    const size_t m = k / p;
    if (recv.size() < k) recv.resize(k);
    int rc = MPI_Alltoall(src, static_cast<int>(m), MPI_UINT16_T, recv.data(),
                          static_cast<int>(m), MPI_UINT16_T, c);
    if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Alltoall");
    if (bf16) {
      SumRows(recv.data(), p, m, dst + rank * m, Bf16ToF32, F32ToBf16);
    } else {
      SumRows(recv.data(), p, m, dst + rank * m, F16ToF32, F32ToF16);
    }
    rc = MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, dst, static_cast<int>(m),
                       MPI_UINT16_T, c);
    if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Allgather");
    return ffi::Error::Success();
  }

  template <typename Up, typename Down>
  static void SumRows(const uint16_t* rows, size_t p, size_t m, uint16_t* out, Up up,
                      Down down) {
    // Blocks of columns: the float32 accumulator stays in cache.
    constexpr size_t kBlock = 2048;
    float acc[kBlock];
    for (size_t a = 0; a < m; a += kBlock) {
      const size_t b = std::min(m, a + kBlock);
      for (size_t i = a; i < b; ++i) acc[i - a] = up(rows[i]);
      for (size_t r = 1; r < p; ++r) {
        const uint16_t* row = rows + r * m;
        for (size_t i = a; i < b; ++i) acc[i - a] += up(row[i]);
      }
      for (size_t i = a; i < b; ++i) out[i] = down(acc[i - a]);
    }
  }

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
template <float (*Up)(uint16_t), uint16_t (*Down)(float)>
void Sum16(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = Down(Up(a[i]) + Up(b[i]));
}

ffi::Error Sum16Op(bool bf16, MPI_Op* out) {
  static std::once_flag once;
  static MPI_Op ops[2] = {MPI_OP_NULL, MPI_OP_NULL};
  static int rc = MPI_SUCCESS;
  std::call_once(once, [] {
    rc = MPI_Op_create(&Sum16<Bf16ToF32, F32ToBf16>, 1, &ops[0]);
    if (rc == MPI_SUCCESS) rc = MPI_Op_create(&Sum16<F16ToF32, F32ToF16>, 1, &ops[1]);
  });
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Op_create");
  *out = ops[bf16 ? 0 : 1];
  return ffi::Error::Success();
}

// Calls begun and finished, for the drain at exit: Python waits until no call
// is running and none has started or finished for a while, so no step is still
// running (and calling back into Python) while the interpreter shuts down.
std::atomic<int64_t> g_started{0};
std::atomic<int64_t> g_finished{0};

struct Counted {
  Counted() { g_started.fetch_add(1, std::memory_order_relaxed); }
  ~Counted() { g_finished.fetch_add(1, std::memory_order_release); }
};

// ---- The timeline (jaxsync.timeline, JAXSYNC_TIMELINE) -------------------
// While it is on, every call that talks MPI records what it did and when, on
// which thread: 8 int64 per event (kind, communicator handle, bytes, queued,
// started, ended in ns of CLOCK_MONOTONIC, Python's time.monotonic_ns; queued is
// -1 where the call runs where it was made; thread id; 1 on a communication
// lane). Off (the default) it costs one relaxed atomic load per call; nothing
// of it is in the lowered step. Python drains the events (jaxsync_timeline_drain).
enum TimelineKind : int64_t {
  kAllreduce = 0, kAllreduceAsync, kAllgather, kAlltoall_, kReduce, kBcast, kReduceScatter, kAgree
};
std::atomic<bool> g_timeline{false};
std::mutex g_timeline_mu;
std::vector<int64_t>* g_timeline_events = new std::vector<int64_t>();  // never freed

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

inline int64_t ThreadId() {
  return static_cast<int64_t>(std::hash<std::thread::id>()(std::this_thread::get_id()) >> 1);
}

void Record(int64_t kind, int64_t comm, int64_t bytes, int64_t queued, int64_t start,
            int64_t end, bool lane) {
  std::lock_guard<std::mutex> lock(g_timeline_mu);
  g_timeline_events->insert(g_timeline_events->end(),
                            {kind, comm, bytes, queued, start, end, ThreadId(), lane ? 1 : 0});
}

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

// Agreement: the processes compare what they are about to do before their
// first message. A synchronisation's calls carry (agreement communicator,
// 63-bit id of its plan); the first call of this process with a pair
// exchanges the ids (one MPI_Allgather of 8 bytes, on a communicator used for
// nothing else) and remembers the verdict, so later calls pay a look-up. On a
// mismatch every process calls back into Python for the full message (it
// exchanges the texts and names the first differing leaf).
using MismatchFn = int (*)(int64_t instance, int64_t id, char* out, int cap);
MismatchFn g_mismatch = nullptr;
// g_agree_mu guards the tables below and is never held across MPI or Python.
// The exchange itself is serialised per agreement communicator (two threads
// must not run collectives on one communicator at once), not globally: a
// global lock held across the blocking MPI_Allgather deadlocked two programs
// synchronised over different communicators that run at the same time - rank
// 0's program A holding it while waiting for rank 1's A, rank 1's program B
// holding it while waiting for rank 0's B, each process's other program
// waiting for the lock (tests/mpi/test_mpi_robust.py). Programs over one
// communicator that run at the same time must, like any collectives on it,
// start in the same order on every process. The Python callback on a
// mismatch runs under the communicator's lock only; it takes the GIL, which
// no thread waiting for that lock holds (XLA runs these calls with the GIL
// released).
std::mutex g_agree_mu;
std::map<int64_t, std::unique_ptr<std::mutex>> g_exchange_mu;  // per communicator
std::map<std::pair<int64_t, int64_t>, std::string> g_verdicts;  // agreed

struct Pending {
  std::string verdict;
  int64_t left;  // local devices of this run still to report it
};
std::map<std::pair<int64_t, int64_t>, Pending> g_pending;

// The verdict on `key` if this process has one (g_agree_mu held): true, and
// `out` set to the error (success: agreed) when one is known.
bool KnownVerdict(const std::pair<int64_t, int64_t>& key, ffi::Error* out) {
  if (g_verdicts.count(key)) {
    *out = ffi::Error::Success();
    return true;
  }
  auto pending = g_pending.find(key);
  if (pending == g_pending.end()) return false;
  std::string verdict = pending->second.verdict;
  if (--pending->second.left <= 0) g_pending.erase(pending);
  *out = ffi::Error(ffi::ErrorCode::kFailedPrecondition, verdict);
  return true;
}

// Only agreement is remembered: every process remembers it alike. A process
// whose plan failed before exchanges again on its next run (the others may
// run a new plan and wait for it); within one run, the local devices after
// the first take the verdict it got (`devices` of them run the check).
ffi::Error Agree(int64_t agree_comm, int64_t id, int64_t instance, int64_t devices) {
  if (agree_comm == 0) return ffi::Error::Success();
  // Remembered per traced synchronisation (instance), not per plan: a process
  // that compiles a step again exchanges again, as the others do.
  const auto key = std::make_pair(agree_comm, instance);
  std::mutex* exchange_mu = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_agree_mu);
    ffi::Error known = ffi::Error::Success();
    if (KnownVerdict(key, &known)) return known;
    auto& mu = g_exchange_mu[agree_comm];
    if (!mu) mu = std::make_unique<std::mutex>();
    exchange_mu = mu.get();
  }
  std::lock_guard<std::mutex> exchange(*exchange_mu);
  {
    std::lock_guard<std::mutex> lock(g_agree_mu);  // another device exchanged meanwhile
    ffi::Error known = ffi::Error::Success();
    if (KnownVerdict(key, &known)) return known;
  }
  MPI_Comm c = MPI_Comm_f2c(static_cast<MPI_Fint>(agree_comm));
  int size = 0;
  int rc = MPI_Comm_size(c, &size);
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Comm_size (agreement)");
  std::vector<int64_t> ids(static_cast<size_t>(size));
  rc = MPI_Allgather(&id, 1, MPI_INT64_T, ids.data(), 1, MPI_INT64_T, c);
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Allgather (agreement)");
  bool same = true;
  for (int64_t other : ids) same = same && other == id;
  if (same) {
    std::lock_guard<std::mutex> lock(g_agree_mu);
    g_verdicts.emplace(key, "");
    return ffi::Error::Success();
  }
  std::string verdict =
      "jaxsync: the processes would issue different collectives (their "
      "synchronised trees or options differ)";
  if (g_mismatch != nullptr) {
    std::vector<char> buf(16384, 0);
    if (g_mismatch(instance, id, buf.data(), static_cast<int>(buf.size())) > 0) {
      verdict = buf.data();
    }
  }
  if (devices > 1) {
    std::lock_guard<std::mutex> lock(g_agree_mu);
    g_pending[key] = Pending{verdict, devices - 1};
  }
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, verdict);
}

// The agreement alone, first thing in a synchronisation: it returns one zero
// byte, and everything the synchronisation does is tied to it.
ffi::Error AgreeImpl(ffi::Token, CommArg, ActiveArg, ffi::AnyBuffer,
                     ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> out,
                     int64_t agree_comm, int64_t agree_id, int64_t agree_instance,
                     int64_t agree_devices) {
  Counted counted;
  Span span(kAgree, agree_comm, 0);
  std::memset(out->untyped_data(), 0, out->size_bytes());
  return Agree(agree_comm, agree_id, agree_instance, agree_devices);
}

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
ffi::Error SumParts(MPI_Comm c, const std::vector<BufRef>& parts, int64_t group_bytes) {
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
  Sums sums(c, small, grouped);
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
                         int64_t group_bytes) {
  Counted counted;
  std::vector<BufRef> parts;
  if (auto e = Collect(args, rets, &parts); e.failure()) return e;
  if (active.typed_data()[0] == 0) {
    Untouched(parts);
    return ffi::Error::Success();
  }
  Span span(kAllreduce, comm.typed_data()[0], PartsBytes(parts));
  return SumParts(CommOf(comm), parts, group_bytes);
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
                               int64_t poll_us) {
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
  static const char* poll_env = std::getenv("JAXSYNC_TESTING_POLL_US");
  if (poll_env != nullptr) poll_us = std::atoll(poll_env);
  const auto queued = std::chrono::steady_clock::now();
  const bool timeline = g_timeline.load(std::memory_order_relaxed);
  LaneOf(handle).Push([promise, handle, group_bytes, poll_us, queued, timeline,
                       parts = std::move(parts)]() mutable {
    const auto began = std::chrono::steady_clock::now();
    t_poll_us = poll_us;  // this lane's thread, for this job's waits
    ffi::Error e = SumParts(MPI_Comm_f2c(handle), parts, group_bytes);
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
    g_finished.fetch_add(1, std::memory_order_release);
    if (e.failure()) {
      promise.SetError(std::move(e));
    } else {
      promise.SetAvailable();
    }
  });
  return future;
}

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
    return kAlltoall ? MPI_Alltoall(s, scount, st, d, dcount, dt, c)
                     : MPI_Allgather(s, scount, st, d, dcount, dt, c);
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

// allgather: x of n elements -> (size, n). alltoall: x of shape (size, m) ->
// (size, m), row j to peer j.
template <bool kAlltoall>
ffi::Error MoveImpl(ffi::Token, CommArg comm,
                    ActiveArg active, ffi::AnyBuffer x,
                    ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> y) {
  Counted counted;
  const char* what = kAlltoall ? "MPI_Alltoall" : "MPI_Allgather";
  if (active.typed_data()[0] == 0) {
    std::memset(y->untyped_data(), 0, y->size_bytes());  // discarded by the caller
    return ffi::Error::Success();
  }
  Span span(kAlltoall ? kAlltoall_ : kAllgather, comm.typed_data()[0],
            static_cast<int64_t>(x.size_bytes()));
  MPI_Comm c = CommOf(comm);
  MPI_Datatype dtype;
  if (!MoveType(x.element_type(), &dtype)) return Unsupported(what, x.element_type());
  int size = 0;
  int rc = MPI_Comm_size(c, &size);
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Comm_size");
  size_t n = x.element_count();
  if (kAlltoall) {
    const auto dims = x.dimensions();
    if (dims.size() == 0 || dims[0] != size) {
      return ffi::Error::InvalidArgument(
          "jaxsync_alltoall: the operand's leading axis must have the communicator's "
          "size " + std::to_string(size) + " (one row per process), got shape " +
          ShapeOf(x) + ". Fix: reshape it to (" + std::to_string(size) + ", ...)");
    }
    n /= static_cast<size_t>(size);
  }
  if (n == 0) return ffi::Error::Success();
  return MoveRows<kAlltoall>(c, dtype, ffi::ByteWidth(x.element_type()),
                             static_cast<const char*>(x.untyped_data()),
                             static_cast<char*>(y->untyped_data()), n);
}

ffi::Error AllgatherImpl(ffi::Token t, CommArg comm,
                         ActiveArg active, ffi::AnyBuffer x,
                         ffi::Result<ffi::Token> t_out, ffi::Result<ffi::AnyBuffer> y) {
  return MoveImpl<false>(t, comm, active, x, t_out, y);
}

ffi::Error AlltoallImpl(ffi::Token t, CommArg comm,
                        ActiveArg active, ffi::AnyBuffer x,
                        ffi::Result<ffi::Token> t_out, ffi::Result<ffi::AnyBuffer> y) {
  return MoveImpl<true>(t, comm, active, x, t_out, y);
}

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

constexpr size_t kTierChunk = size_t{1} << 28;

void Widen(const uint16_t* src, float* dst, size_t n, bool bf16) {
  if (bf16) {
    for (size_t i = 0; i < n; ++i) dst[i] = Bf16ToF32(src[i]);
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] = F16ToF32(src[i]);
  }
}

void Narrow(const float* src, uint16_t* dst, size_t n, bool bf16) {
  if (bf16) {
    for (size_t i = 0; i < n; ++i) dst[i] = F32ToBf16(src[i]);
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] = F32ToF16(src[i]);
  }
}

// How a buffer is summed on the host tier: its MPI type and element width
// there (16-bit floats: float32).
struct TierType {
  ffi::DataType t;
  MPI_Datatype mpi;
  size_t width;  // bytes per element as summed
  bool low;
};

bool TierTypeOf(ffi::DataType t, TierType* out) {
  if (IsLow(t)) {
    *out = {t, MPI_FLOAT, 4, true};
    return true;
  }
  MPI_Datatype d;
  if (!SumType(t, &d)) return false;
  *out = {t, d, ffi::ByteWidth(t), false};
  return true;
}

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
    TierType tt{in->element_type(), MPI_BYTE, ffi::ByteWidth(in->element_type()), false};
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
ffi::Error ReduceScatterImpl(ffi::Token, CommArg comm, ActiveArg active, ffi::RemainingArgs args,
                             ffi::Result<ffi::Token>, ffi::RemainingRets rets) {
  Counted counted;
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
    const size_t item = ffi::ByteWidth(type.t);
    if ((*res)->element_count() != m) {
      return ffi::Error::InvalidArgument(
          "jaxsync_reduce_scatter: the result must hold ceil(n / size) elements");
    }
    const char* src = static_cast<const char*>(in->untyped_data());
    if (!type.low && n == m * p && m <= kTierChunk) {  // summed from where it is
      if (m == 0) continue;
      int rc = MPI_Reduce_scatter_block(src, out, static_cast<int>(m), type.mpi, MPI_SUM, c);
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
      int rc = MPI_Reduce_scatter_block(send, mine, static_cast<int>(k), type.mpi, MPI_SUM, c);
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

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsync_allreduce, AllreduceImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<CommArg>()
                                  .Arg<ActiveArg>()
                                  .RemainingArgs()
                                  .Ret<ffi::Token>()
                                  .RemainingRets()
                                  .Attr<int64_t>("group_bytes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsync_allreduce_async, AllreduceAsyncImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<CommArg>()
                                  .Arg<ActiveArg>()
                                  .RemainingArgs()
                                  .Ret<ffi::Token>()
                                  .RemainingRets()
                                  .Attr<int64_t>("group_bytes")
                                  .Attr<int64_t>("poll_us"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsync_tie, TieImpl,
                              ffi::Ffi::Bind().RemainingArgs().RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsync_agree, AgreeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<CommArg>()
                                  .Arg<ActiveArg>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("agree_comm")
                                  .Attr<int64_t>("agree_id")
                                  .Attr<int64_t>("agree_instance")
                                  .Attr<int64_t>("agree_devices"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsync_allgather, AllgatherImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<CommArg>()
                                  .Arg<ActiveArg>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsync_alltoall, AlltoallImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<CommArg>()
                                  .Arg<ActiveArg>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsync_reduce, ReduceImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<CommArg>()
                                  .Arg<ActiveArg>()
                                  .RemainingArgs()
                                  .Ret<ffi::Token>()
                                  .RemainingRets()
                                  .Attr<int64_t>("group_bytes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsync_bcast, BcastImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<CommArg>()
                                  .Arg<ActiveArg>()
                                  .RemainingArgs()
                                  .Ret<ffi::Token>()
                                  .RemainingRets()
                                  .Attr<int64_t>("group_bytes"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsync_reduce_scatter, ReduceScatterImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<CommArg>()
                                  .Arg<ActiveArg>()
                                  .RemainingArgs()
                                  .Ret<ffi::Token>()
                                  .RemainingRets());

// What the library was built against (header) and what it runs on (library).
extern "C" void jaxsync_set_mismatch_callback(MismatchFn fn) { g_mismatch = fn; }

extern "C" void jaxsync_timeline_enable(int on) { g_timeline.store(on != 0); }

// Copies up to `cap` events (8 int64 each) into `out`, oldest first, removes them,
// and returns how many it copied.
extern "C" int64_t jaxsync_timeline_drain(int64_t* out, int64_t cap) {
  std::lock_guard<std::mutex> lock(g_timeline_mu);
  const int64_t have = static_cast<int64_t>(g_timeline_events->size() / 8);
  const int64_t n = std::min(have, cap);
  std::memcpy(out, g_timeline_events->data(), static_cast<size_t>(n) * 8 * sizeof(int64_t));
  g_timeline_events->erase(g_timeline_events->begin(), g_timeline_events->begin() + n * 8);
  return n;
}

extern "C" int64_t jaxsync_timeline_pending() {
  std::lock_guard<std::mutex> lock(g_timeline_mu);
  return static_cast<int64_t>(g_timeline_events->size() / 8);
}

extern "C" int64_t jaxsync_calls_started() { return g_started.load(); }
extern "C" int64_t jaxsync_calls_finished() { return g_finished.load(); }

extern "C" const char* jaxsync_mpi_header_version() {
#if defined(MPICH_VERSION)
  return "MPICH " MPICH_VERSION;
#elif defined(OMPI_MAJOR_VERSION)
#define JAXSYNC_STR2(x) #x
#define JAXSYNC_STR(x) JAXSYNC_STR2(x)
  return "Open MPI " JAXSYNC_STR(OMPI_MAJOR_VERSION) "." JAXSYNC_STR(
      OMPI_MINOR_VERSION) "." JAXSYNC_STR(OMPI_RELEASE_VERSION);
#else
  return "MPI (unknown implementation)";
#endif
}

extern "C" int jaxsync_mpi_library_version(char* out, int cap) {
  char text[MPI_MAX_LIBRARY_VERSION_STRING];
  int len = 0;
  if (MPI_Get_library_version(text, &len) != MPI_SUCCESS) return -1;
  int n = len < cap - 1 ? len : cap - 1;
  std::memcpy(out, text, n);
  out[n] = '\0';
  return n;
}
