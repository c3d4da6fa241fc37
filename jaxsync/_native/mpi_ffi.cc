// jaxsync's XLA FFI targets for MPI collectives on the CPU platform.
//
// Every handler takes (token, comm, active, buffers...) and returns
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
// Buffers under 64 KiB of one dtype are summed together through a per-thread
// scratch buffer (at most 4 MiB): one MPI call instead of one each.
// jaxsync_allgather / jaxsync_alltoall move one buffer each.
//
// MPI failures come back as ffi::Error carrying MPI's error string (the
// communicators need MPI_ERRORS_RETURN, mpi4py's default).

#include <mpi.h>

#include <climits>
#include <cstdint>
#include <atomic>
#include <map>
#include <mutex>
#include <cstring>
#include <string>
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
      DtypeName(t) + "; expected float32, float64 or an integer type" +
      (std::string(what) == "MPI_Allreduce"
           ? std::string(" (16-bit floats are summed by jaxsync in float32)")
           : std::string(", float16 or bfloat16")));
}

ffi::Error CountOf(size_t n, const char* what, int* out) {
  if (n > static_cast<size_t>(INT_MAX)) {
    return ffi::Error::InvalidArgument(
        std::string("jaxsync: ") + what + " of " + std::to_string(n) +
        " elements exceeds MPI's int count; use smaller buckets (bucket_bytes)");
  }
  *out = static_cast<int>(n);
  return ffi::Error::Success();
}

MPI_Comm CommOf(const CommArg& comm) {
  return MPI_Comm_f2c(static_cast<MPI_Fint>(comm.typed_data()[0]));
}

// Buffers below this size are summed in groups through a scratch buffer of at
// most kScratchBytes (per thread, reused across calls).
constexpr size_t kSmallBytes = 64 << 10;
constexpr size_t kScratchBytes = 4 << 20;

class Group {
 public:
  bool Fits(MPI_Datatype dtype, size_t bytes) const {
    return parts_.empty() || (dtype == dtype_ && used_ + bytes <= kScratchBytes);
  }

  void Add(MPI_Datatype dtype, size_t width, void* src, void* dst, size_t bytes) {
    dtype_ = dtype;
    width_ = width;
    parts_.push_back({src, dst, bytes});
    used_ += bytes;
  }

  ffi::Error Flush(MPI_Comm c) {
    if (parts_.empty()) return ffi::Error::Success();
    ffi::Error result = ffi::Error::Success();
    if (parts_.size() == 1) {
      Part& p = parts_[0];
      int rc = MPI_Allreduce(p.src == p.dst ? MPI_IN_PLACE : p.src, p.dst,
                             static_cast<int>(p.bytes / width_), dtype_, MPI_SUM, c);
      if (rc != MPI_SUCCESS) result = MpiError(rc, "MPI_Allreduce");
    } else {
      static thread_local std::vector<char> scratch;
      if (scratch.size() < used_) scratch.resize(used_);
      size_t off = 0;
      for (const Part& p : parts_) {
        std::memcpy(scratch.data() + off, p.src, p.bytes);
        off += p.bytes;
      }
      int rc = MPI_Allreduce(MPI_IN_PLACE, scratch.data(),
                             static_cast<int>(used_ / width_), dtype_, MPI_SUM, c);
      if (rc != MPI_SUCCESS) {
        result = MpiError(rc, "MPI_Allreduce");
      } else {
        off = 0;
        for (const Part& p : parts_) {
          std::memcpy(p.dst, scratch.data() + off, p.bytes);
          off += p.bytes;
        }
      }
    }
    parts_.clear();
    used_ = 0;
    return result;
  }

 private:
  struct Part {
    void* src;
    void* dst;
    size_t bytes;
  };
  std::vector<Part> parts_;
  MPI_Datatype dtype_ = MPI_DATATYPE_NULL;
  size_t width_ = 1;
  size_t used_ = 0;
};

// Calls begun and finished, for the drain at exit: Python waits until no call
// is running and none has started or finished for a while, so no step is still
// running (and calling back into Python) while the interpreter shuts down.
std::atomic<int64_t> g_started{0};
std::atomic<int64_t> g_finished{0};

struct Counted {
  Counted() { g_started.fetch_add(1, std::memory_order_relaxed); }
  ~Counted() { g_finished.fetch_add(1, std::memory_order_release); }
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
std::mutex g_agree_mu;
std::map<std::pair<int64_t, int64_t>, std::string> g_verdicts;  // agreed

struct Pending {
  std::string verdict;
  int64_t left;  // local devices of this run still to report it
};
std::map<std::pair<int64_t, int64_t>, Pending> g_pending;

// Only agreement is remembered: every process remembers it alike. A process
// whose plan failed before exchanges again on its next run (the others may
// run a new plan and wait for it); within one run, the local devices after
// the first take the verdict it got (`devices` of them run the check).
ffi::Error Agree(int64_t agree_comm, int64_t id, int64_t instance, int64_t devices) {
  if (agree_comm == 0) return ffi::Error::Success();
  std::lock_guard<std::mutex> lock(g_agree_mu);
  // Remembered per traced synchronisation (instance), not per plan: a process
  // that compiles a step again exchanges again, as the others do.
  auto key = std::make_pair(agree_comm, instance);
  if (g_verdicts.count(key)) return ffi::Error::Success();
  auto pending = g_pending.find(key);
  if (pending != g_pending.end()) {
    std::string verdict = pending->second.verdict;
    if (--pending->second.left <= 0) g_pending.erase(pending);
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, verdict);
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
  if (devices > 1) g_pending[key] = Pending{verdict, devices - 1};
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, verdict);
}

// The agreement alone, first thing in a synchronisation: it returns one zero
// byte, and everything the synchronisation does is tied to it.
ffi::Error AgreeImpl(ffi::Token, CommArg, ActiveArg, ffi::AnyBuffer,
                     ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> out,
                     int64_t agree_comm, int64_t agree_id, int64_t agree_instance,
                     int64_t agree_devices) {
  Counted counted;
  std::memset(out->untyped_data(), 0, out->size_bytes());
  return Agree(agree_comm, agree_id, agree_instance, agree_devices);
}

ffi::Error AllreduceImpl(ffi::Token, CommArg comm,
                         ActiveArg active, ffi::RemainingArgs args,
                         ffi::Result<ffi::Token>, ffi::RemainingRets rets) {
  Counted counted;
  if (args.size() != rets.size()) {
    return ffi::Error::InvalidArgument(
        "jaxsync_allreduce: as many results as buffers expected");
  }
  if (active.typed_data()[0] == 0) {  // results alias the inputs: untouched
    for (size_t i = 0; i < args.size(); ++i) {
      auto in = args.get<ffi::AnyBuffer>(i);
      auto out = rets.get<ffi::AnyBuffer>(i);
      if (!in.has_value()) return in.error();
      if (!out.has_value()) return out.error();
      if (in->untyped_data() != (*out)->untyped_data()) {  // not aliased after all
        std::memcpy((*out)->untyped_data(), in->untyped_data(), in->size_bytes());
      }
    }
    return ffi::Error::Success();
  }
  MPI_Comm c = CommOf(comm);
  // Small buffers of one dtype are summed together: copied into a scratch
  // buffer, one MPI_Allreduce in place, copied back (memcpy of a few KiB costs
  // far less than an MPI call each, or than packing them in XLA).
  Group group;
  for (size_t i = 0; i < args.size(); ++i) {
    auto in = args.get<ffi::AnyBuffer>(i);
    auto out = rets.get<ffi::AnyBuffer>(i);
    if (!in.has_value()) return in.error();
    if (!out.has_value()) return out.error();
    ffi::DataType t = in->element_type();
    MPI_Datatype dtype;
    if (!SumType(t, &dtype)) return Unsupported("MPI_Allreduce", t);
    size_t bytes = in->size_bytes();
    if (bytes == 0) continue;
    void* src = in->untyped_data();
    void* dst = (*out)->untyped_data();
    if (bytes < kSmallBytes) {
      if (!group.Fits(dtype, bytes)) {
        if (auto e = group.Flush(c); e.failure()) return e;
      }
      group.Add(dtype, ffi::ByteWidth(t), src, dst, bytes);
      continue;
    }
    int count = 0;
    if (auto e = CountOf(in->element_count(), "MPI_Allreduce", &count);
        e.failure()) {
      return e;
    }
    int rc = MPI_Allreduce(src == dst ? MPI_IN_PLACE : src, dst, count, dtype,
                           MPI_SUM, c);
    if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Allreduce");
  }
  return group.Flush(c);
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
  MPI_Comm c = CommOf(comm);
  MPI_Datatype dtype;
  if (!MoveType(x.element_type(), &dtype)) return Unsupported(what, x.element_type());
  int size = 0;
  int rc = MPI_Comm_size(c, &size);
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Comm_size");
  size_t n = x.element_count();
  if (kAlltoall) {
    if (size == 0 || n % size != 0) {
      return ffi::Error::InvalidArgument(
          "jaxsync_alltoall: the leading axis must have the communicator's size");
    }
    n /= size;
  }
  int count = 0;  // the received total must fit MPI's int count too
  if (auto e = CountOf(n * static_cast<size_t>(size), what, &count); e.failure()) {
    return e;
  }
  count = static_cast<int>(n);
  if (n == 0) return ffi::Error::Success();
  if (kAlltoall) {
    rc = MPI_Alltoall(x.untyped_data(), count, dtype, y->untyped_data(), count, dtype, c);
  } else {
    rc = MPI_Allgather(x.untyped_data(), count, dtype, y->untyped_data(), count, dtype, c);
  }
  if (rc != MPI_SUCCESS) return MpiError(rc, what);
  return ffi::Error::Success();
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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsync_allreduce, AllreduceImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<CommArg>()
                                  .Arg<ActiveArg>()
                                  .RemainingArgs()
                                  .Ret<ffi::Token>()
                                  .RemainingRets());

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

// What the library was built against (header) and what it runs on (library).
extern "C" void jaxsync_set_mismatch_callback(MismatchFn fn) { g_mismatch = fn; }

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
