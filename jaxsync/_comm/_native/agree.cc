// jaxsync_agree, jaxsync_step: every synchronisation's header, checked by the
// processes before its first message (see mpi_ffi.h).

#include "mpi_ffi.h"

#include <tuple>

namespace jaxsync {
namespace {

// The header. A synchronisation's first call (jaxsync_agree) carries
// (agreement communicator, 63-bit id of its plan) as attributes and a step
// count as an operand: how many times this process reached the
// synchronisation since it last ran. Every run of it exchanges the pair (one
// MPI_Allgather of 16 bytes, on a communicator used for nothing else) and every
// process reads the same gathered table, so a difference fails the step on
// every process with the same message, before any data moves:
//   * ids differ: the processes are about to run different synchronisations
//     (another tree, dtype, strategy, option or root; one rank's other step
//     function; a rank that skipped a synchronisation and runs the next one).
//     Every process calls back into Python for the full message (it exchanges
//     the texts and names what differs);
//   * counts differ: the same synchronisation, but one process skipped it (a
//     lax.cond whose predicate differs: apply_if_finite, MultiSteps'
//     should_skip_update_fn on one rank's NaN) and would pair its calls with
//     the others' of another step.
// A synchronisation outside control flow is reached exactly when it runs (its
// count is 1). One inside a lax.cond or loop is reached at the top of the
// traced step, whichever branch then runs: jaxsync_step counts it there, per
// (agreement communicator, plan id, site: the how-manieth synchronisation of
// that plan in its traced step, local device); jaxsync_agree sends the count
// since that device's previous check, so a step traced again, or an error that
// stopped one step, leaves no offset behind.
// A process that never calls again is not a header's to find: the stall
// watchdog (timeout=) is.
// JAXSYNC_AGREE=once (read once) exchanges only the id, the first time each
// traced synchronisation runs on a process (the behaviour before the header).
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
std::condition_variable g_agree_cv;
std::map<int64_t, std::unique_ptr<std::mutex>> g_exchange_mu;  // per communicator
using Key = std::pair<int64_t, int64_t>;                         // (communicator, instance)
std::map<Key, std::string> g_agreed;                              // JAXSYNC_AGREE=once
std::map<Key, int64_t> g_arrivals;  // devices of this process that reached the check
struct Pending {
  bool known = false;
  std::string verdict;  // "" agreed
  int64_t left = 0;     // local devices of this run still to read it
};
std::map<std::pair<Key, int64_t>, Pending> g_pending;  // per (key, run)
// Steps reached (jaxsync_step), and their count at each device's last check:
// (communicator, id, site, device) -> count.
using Site = std::tuple<int64_t, int64_t, int64_t, int64_t>;
std::map<Site, int32_t> g_steps, g_checked;

// The header's exchange is tested with the core yielded between tests for 1 ms,
// then with sleeps of an eighth of the time waited, at most kAgreePollUs: a
// process whose peer waits for a core (more processes than cores) lets it run
// instead of spinning its time slice away (a blocking allgather made a small
// step 4-11x slower at load 19 on 2 cores), and a peer that comes late (still
// compiling) costs no core. Its own loop, not Poll's (mpi_ffi.cc), so the
// data calls' counts of yields and sleeps stay theirs.
constexpr int64_t kAgreePollUs = 50;

int WaitHeader(MPI_Request* req) {
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    int done = 0;
    const int rc = MPI_Test(req, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS || done) return rc;
    const auto waited = std::chrono::duration_cast<std::chrono::microseconds>(
                            std::chrono::steady_clock::now() - t0)
                            .count();
    if (waited < 1000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(
          std::chrono::microseconds(std::min<int64_t>(waited / 8, kAgreePollUs)));
    }
  }
}

bool Once() {
  static const bool once = [] {
    const char* v = std::getenv("JAXSYNC_AGREE");
    return v != nullptr && std::string(v) == "once";
  }();
  return once;
}

// The steps since this device's previous check, where jaxsync_step counted
// them (`count` >= 0); else 1 (the synchronisation runs where it is reached).
int64_t SinceLast(int64_t comm, int64_t id, int64_t site, int32_t device, int32_t count) {
  if (count < 0) return 1;
  std::lock_guard<std::mutex> lock(g_agree_mu);
  int32_t& last = g_checked[std::make_tuple(comm, id, site, device)];
  const int64_t since = static_cast<int64_t>(count) - last;
  last = count;
  return since;
}

std::string Times(int64_t n) { return n == 1 ? "once" : std::to_string(n) + " times"; }

// The exchange of one run: "" when every process sent (id, step), else the
// error, the same on every process (each reads the same gathered table).
std::string Exchange(int64_t agree_comm, int64_t id, int64_t instance, int64_t step) {
  MPI_Comm c = MPI_Comm_f2c(static_cast<MPI_Fint>(agree_comm));
  int size = 0;
  int rc = MPI_Comm_size(c, &size);
  if (rc != MPI_SUCCESS) return "jaxsync: MPI_Comm_size failed (agreement)";
  const int64_t mine[2] = {id, Once() ? 0 : step};
  std::vector<int64_t> all(2 * static_cast<size_t>(size));
  MPI_Request req;
  rc = MPI_Iallgather(mine, 2, MPI_INT64_T, all.data(), 2, MPI_INT64_T, c, &req);
  if (rc == MPI_SUCCESS) rc = WaitHeader(&req);
  if (rc != MPI_SUCCESS) {
    char err[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, err, &len);
    return std::string("jaxsync: MPI_Allgather (agreement) failed: ") + std::string(err, len);
  }
  int other_id = -1, other_step = -1;
  for (int r = 1; r < size; ++r) {
    if (other_id < 0 && all[2 * r] != all[0]) other_id = r;
    if (other_step < 0 && all[2 * r + 1] != all[1]) other_step = r;
  }
  if (other_id >= 0) {
    std::string verdict =
        "jaxsync: the processes would issue different collectives (their "
        "synchronised trees or options differ)";
    if (g_mismatch != nullptr) {
      std::vector<char> buf(16384, 0);
      if (g_mismatch(instance, id, buf.data(), static_cast<int>(buf.size())) > 0) {
        verdict = buf.data();
      }
    }
    return verdict;
  }
  if (other_step >= 0) {
    return "jaxsync: since this synchronisation last ran, rank 0 reached it " + Times(all[1]) +
           " and rank " + std::to_string(other_step) + " " + Times(all[2 * other_step + 1]) +
           ": a rank skipped it, and its calls would pair with the others' of another step "
           "(a hang or wrong sums). A lax.cond whose predicate differs between ranks does "
           "this: optax.apply_if_finite, or optax.MultiSteps' should_skip_update_fn, seeing "
           "a non-finite gradient on one rank only.\nFix: decide on values that are the same "
           "on every rank (the synchronised gradient, check_finite=True's all_finite flag), "
           "never on one rank's own values.";
  }
  return "";
}

// `devices` local devices run each check; the first of each run exchanges, the
// others take its verdict.
ffi::Error Agree(int64_t agree_comm, int64_t id, int64_t instance, int64_t devices,
                 int64_t step) {
  if (agree_comm == 0) return ffi::Error::Success();
  const Key key = std::make_pair(agree_comm, instance);
  std::mutex* exchange_mu = nullptr;
  int64_t run = 0;
  {
    std::unique_lock<std::mutex> lock(g_agree_mu);
    if (Once() && g_agreed.count(key)) return ffi::Error::Success();
    int64_t arrival = g_arrivals[key]++;
    run = arrival / std::max<int64_t>(devices, 1);
    if (devices > 1 && arrival % devices != 0) {
      auto slot = std::make_pair(key, run);
      g_agree_cv.wait(lock, [&] { return g_pending[slot].known; });
      Pending& p = g_pending[slot];
      std::string verdict = p.verdict;
      if (--p.left <= 0) g_pending.erase(slot);
      if (verdict.empty()) return ffi::Error::Success();
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition, verdict);
    }
    auto& mu = g_exchange_mu[agree_comm];
    if (!mu) mu = std::make_unique<std::mutex>();
    exchange_mu = mu.get();
  }
  std::string verdict;
  {
    std::lock_guard<std::mutex> exchange(*exchange_mu);
    verdict = Exchange(agree_comm, id, instance, step);
  }
  {
    std::lock_guard<std::mutex> lock(g_agree_mu);
    if (Once() && verdict.empty()) g_agreed.emplace(key, "");
    if (devices > 1) {
      Pending& p = g_pending[std::make_pair(key, run)];
      p.known = true;
      p.verdict = verdict;
      p.left = devices - 1;
    }
  }
  if (devices > 1) g_agree_cv.notify_all();
  if (verdict.empty()) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition, verdict);
}

// The header's check, first thing in a synchronisation: it returns one zero
// byte (everything the synchronisation does is tied to it). Its int32[2]
// operand: (local device, count from jaxsync_step or -1).
ffi::Error AgreeImpl(ffi::Token, CommArg, ActiveArg, ffi::AnyBuffer, ffi::Buffer<ffi::S32> reach,
                     ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> out,
                     ffi::Result<ffi::Buffer<ffi::S32>> reach_out, int64_t agree_comm,
                     int64_t agree_id, int64_t agree_instance, int64_t agree_devices,
                     int64_t agree_site) {
  Counted counted;
  Span span(kAgree, agree_comm, 0);
  std::memset(out->untyped_data(), 0, out->size_bytes());
  const int32_t* r = reach.typed_data();
  std::memcpy(reach_out->typed_data(), r, 2 * sizeof(int32_t));
  if (agree_comm == 0) return ffi::Error::Success();
  const int64_t since = SinceLast(agree_comm, agree_id, agree_site, r[0], r[1]);
  return Agree(agree_comm, agree_id, agree_instance, agree_devices, since);
}

// A synchronisation inside control flow is reached here, at the top of the
// step: its operand is the local device, its result the count (no MPI).
ffi::Error StepImpl(ffi::Token, CommArg, ActiveArg, ffi::BufferR0<ffi::S32> device,
                    ffi::Result<ffi::Token>, ffi::ResultBufferR0<ffi::S32> out,
                    int64_t agree_comm, int64_t agree_id, int64_t agree_instance,
                    int64_t agree_devices, int64_t agree_site) {
  (void)agree_instance;
  (void)agree_devices;
  std::lock_guard<std::mutex> lock(g_agree_mu);
  out->typed_data()[0] =
      ++g_steps[std::make_tuple(agree_comm, agree_id, agree_site, device.typed_data()[0])];
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jaxsync

#define JAXSYNC_AGREE_ATTRS                \
  .Attr<int64_t>("agree_comm")             \
      .Attr<int64_t>("agree_id")           \
      .Attr<int64_t>("agree_instance")     \
      .Attr<int64_t>("agree_devices")      \
      .Attr<int64_t>("agree_site")

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsync_agree, jaxsync::AgreeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<CommArg>()
                                  .Arg<ActiveArg>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>() JAXSYNC_AGREE_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsync_step, jaxsync::StepImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<CommArg>()
                                  .Arg<ActiveArg>()
                                  .Arg<ffi::BufferR0<ffi::S32>>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::BufferR0<ffi::S32>>() JAXSYNC_AGREE_ATTRS);

extern "C" void jaxsync_set_mismatch_callback(jaxsync::MismatchFn fn) { jaxsync::g_mismatch = fn; }
