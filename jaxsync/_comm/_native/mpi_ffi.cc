// jaxsync's native MPI target: what every part shares (dtypes, errors, MPI's
// count limit, the waits, the call counters, the timeline) and the plain C
// entry points Python reads (timeline, counters, MPI versions). See mpi_ffi.h.

#include "mpi_ffi.h"

#include <sched.h>

namespace jaxsync {

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

thread_local int64_t t_poll_us = 0;


namespace {

// Test (`test` returns MPI_Test's code and sets done) until done: giving the
// core away (sched_yield) between tests while the wait is young (kYieldUs), then
// sleeping an eighth of the time waited so far, at most poll_us, between tests.
// A call that ends within kYieldUs (a fast network) is not held up, and one that
// waits longer by about an eighth of its own time at most (with a fixed 100 us
// sleep from 200 us on, sharded's 256 small all-gathers took its step on 2
// emulated hosts at 1 Gb/s to 1.23x the chain's), while a long wait leaves the
// cores to the step's compute and the host's other processes. The young wait
// yields, not spins: where a host runs more processes than it has cores, the
// peer a call waits for may be on this core, and a nonblocking collective only
// moves when its processes test it. Spinning there for 400 us, then sleeping,
// took naive_mean's 500 small sums 375-456 ms on 2 emulated hosts x 2 processes
// at 1 Gb/s (2 cores), 971 ms at 2 x 4, against 23-37 / 64 ms for MPI's blocking
// MPI_Allreduce (which yields as it polls); yielding for 400 us 29-31 / 503 ms,
// for 1 ms 21-34 / 58-66 ms. Where nothing else is runnable, sched_yield
// returns at once: the young wait is a spin, as before.
constexpr int64_t kYieldUs = 1000;

std::atomic<int64_t> g_poll_yields{0};
std::atomic<int64_t> g_poll_sleeps{0};

template <typename Test>
int Poll(int64_t poll_us, Test test) {
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    int done = 0;
    int rc = test(&done);
    if (rc != MPI_SUCCESS || done) return rc;
    const int64_t waited = std::chrono::duration_cast<std::chrono::microseconds>(
                               std::chrono::steady_clock::now() - t0)
                               .count();
    if (waited < kYieldUs) {
      g_poll_yields.fetch_add(1, std::memory_order_relaxed);
      sched_yield();
    } else {
      g_poll_sleeps.fetch_add(1, std::memory_order_relaxed);
      std::this_thread::sleep_for(std::chrono::microseconds(std::min(poll_us, waited / 8)));
    }
  }
}

}  // namespace

int WaitAll(std::vector<MPI_Request>& reqs, std::vector<MPI_Status>& st) {
  const int n = static_cast<int>(reqs.size());
  if (t_poll_us <= 0) return MPI_Waitall(n, reqs.data(), st.data());
  return Poll(t_poll_us, [&](int* done) { return MPI_Testall(n, reqs.data(), done, st.data()); });
}

int WaitOne(MPI_Request* req, int64_t poll_us) {
  if (poll_us <= 0) return MPI_Wait(req, MPI_STATUS_IGNORE);
  return Poll(poll_us, [&](int* done) { return MPI_Test(req, done, MPI_STATUS_IGNORE); });
}

namespace {

// `blocking()` where t_poll_us is 0; else `start(&request)`, then WaitOne.
template <typename Blocking, typename Start>
int Polled(Blocking blocking, Start start) {
  if (t_poll_us <= 0) return blocking();
  MPI_Request r;
  int rc = start(&r);
  return rc != MPI_SUCCESS ? rc : WaitOne(&r);
}

}  // namespace

int Allgather(const void* s, int sc, MPI_Datatype st, void* d, int dc, MPI_Datatype dt,
              MPI_Comm c) {
  return Polled([&] { return MPI_Allgather(s, sc, st, d, dc, dt, c); },
                [&](MPI_Request* r) { return MPI_Iallgather(s, sc, st, d, dc, dt, c, r); });
}

int Alltoall(const void* s, int sc, MPI_Datatype st, void* d, int dc, MPI_Datatype dt,
             MPI_Comm c) {
  return Polled([&] { return MPI_Alltoall(s, sc, st, d, dc, dt, c); },
                [&](MPI_Request* r) { return MPI_Ialltoall(s, sc, st, d, dc, dt, c, r); });
}

int ReduceScatterBlock(const void* s, void* d, int count, MPI_Datatype t, MPI_Op op,
                       MPI_Comm c) {
  return Polled(
      [&] { return MPI_Reduce_scatter_block(s, d, count, t, op, c); },
      [&](MPI_Request* r) { return MPI_Ireduce_scatter_block(s, d, count, t, op, c, r); });
}

int64_t PollUs(int64_t poll_us) {
  static const char* env = std::getenv("JAXSYNC_TESTING_POLL_US");
  return env != nullptr ? std::atoll(env) : poll_us;
}


std::atomic<int64_t> g_started{0};
std::atomic<int64_t> g_finished{0};

std::atomic<bool> g_timeline{false};
std::mutex g_timeline_mu;
std::vector<int64_t>* g_timeline_events = new std::vector<int64_t>();  // never freed

void Record(int64_t kind, int64_t comm, int64_t bytes, int64_t queued, int64_t start,
            int64_t end, bool lane) {
  std::lock_guard<std::mutex> lock(g_timeline_mu);
  g_timeline_events->insert(g_timeline_events->end(),
                            {kind, comm, bytes, queued, start, end, ThreadId(), lane ? 1 : 0});
}

}  // namespace jaxsync

using namespace jaxsync;  // NOLINT: the C entry points below

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

// The polled waits' yields and sleeps so far (every thread), for the tests.
extern "C" int64_t jaxsync_poll_yields() { return g_poll_yields.load(); }
extern "C" int64_t jaxsync_poll_sleeps() { return g_poll_sleeps.load(); }

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
