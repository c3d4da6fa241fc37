// jaxsync_allgather and jaxsync_alltoall: one buffer each (see mpi_ffi.h).

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


}  // namespace
}  // namespace jaxsync

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsync_allgather, jaxsync::AllgatherImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<CommArg>()
                                  .Arg<ActiveArg>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(jaxsync_alltoall, jaxsync::AlltoallImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Token>()
                                  .Arg<CommArg>()
                                  .Arg<ActiveArg>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::AnyBuffer>());
