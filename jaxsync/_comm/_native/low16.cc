// 16-bit floats summed in float32: Low16 (ChainerMN's all-to-all, more than
// two processes) and the user-defined MPI sum of two processes (see mpi_ffi.h).

#include "mpi_ffi.h"

namespace jaxsync {

namespace {

template <typename Up, typename Down>
void SumRows(const uint16_t* rows, size_t p, size_t m, uint16_t* out, Up up, Down down) {
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

// k elements (a multiple of p) summed where they are.
ffi::Error Direct(MPI_Comm c, size_t p, size_t rank, const uint16_t* src, uint16_t* dst,
                  size_t k, bool bf16) {
  static thread_local std::vector<uint16_t> recv;
  const size_t m = k / p;
  if (recv.size() < k) recv.resize(k);
  int rc = Alltoall(src, static_cast<int>(m), MPI_UINT16_T, recv.data(),
                    static_cast<int>(m), MPI_UINT16_T, c);
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Alltoall");
  if (bf16) {
    SumRows(recv.data(), p, m, dst + rank * m, Bf16ToF32, F32ToBf16);
  } else {
    SumRows(recv.data(), p, m, dst + rank * m, F16ToF32, F32ToF16);
  }
  rc = Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, dst, static_cast<int>(m),
                 MPI_UINT16_T, c);
  if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Allgather");
  return ffi::Error::Success();
}

}  // namespace

void SumRows16(const uint16_t* rows, size_t p, size_t m, uint16_t* out, bool bf16) {
  if (bf16) {
    SumRows(rows, p, m, out, Bf16ToF32, F32ToBf16);
  } else {
    SumRows(rows, p, m, out, F16ToF32, F32ToF16);
  }
}

ffi::Error Low16::Run(MPI_Comm c, bool bf16) {
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
    rc = Alltoall(send.data(), static_cast<int>(m), MPI_UINT16_T, recv.data(),
                  static_cast<int>(m), MPI_UINT16_T, c);
    if (rc != MPI_SUCCESS) return MpiError(rc, "MPI_Alltoall");
    if (bf16) {
      SumRows(recv.data(), p, m, mine.data(), Bf16ToF32, F32ToBf16);
    } else {
      SumRows(recv.data(), p, m, mine.data(), F16ToF32, F32ToF16);
    }
    rc = Allgather(mine.data(), static_cast<int>(m), MPI_UINT16_T, send.data(),
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

namespace {

// Two processes: one float32 add and one rounding per element (see mpi_ffi.h).

template <float (*Up)(uint16_t), uint16_t (*Down)(float)>
void Sum16(void* in, void* inout, int* len, MPI_Datatype*) {
  const uint16_t* a = static_cast<const uint16_t*>(in);
  uint16_t* b = static_cast<uint16_t*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = Down(Up(a[i]) + Up(b[i]));
}

}  // namespace

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

}  // namespace jaxsync
