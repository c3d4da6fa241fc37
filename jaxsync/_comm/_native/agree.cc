// jaxsync_agree: the processes compare what they are about to do before
// their first message (see mpi_ffi.h).

#include "mpi_ffi.h"

namespace jaxsync {
namespace {

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


}  // namespace
}  // namespace jaxsync

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsync_agree, jaxsync::AgreeImpl,
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

extern "C" void jaxsync_set_mismatch_callback(jaxsync::MismatchFn fn) { jaxsync::g_mismatch = fn; }
