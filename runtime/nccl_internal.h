// NCCL, opened at first use rather than linked (compiled only when
// STRATA_HAVE_NCCL). A process that never creates an NCCL communicator (the
// host device, one GPU, a gloo process group) never loads libnccl.so.2, so
// the library, the Python module and the tool start on machines without
// NCCL, and a process that has NCCL loaded already (torch's) shares that
// copy instead of bringing a second one.
//
//   STRATA_ASSIGN_OR_RETURN(const NcclApi* nccl, LoadNccl());
//   STRATA_RETURN_IF_ERROR(NcclError(nccl->GetUniqueId(&id), "new nccl unique id"));
//
// Where it is looked for: the file the environment variable
// STRATA_NCCL_LIBRARY names, alone, when it is set; otherwise libnccl.so.2 as
// the dynamic loader finds it (a copy already in the process first, then
// LD_LIBRARY_PATH and the system's paths), then the file the build found.
// The first load is remembered, its failure too. Thread-safe.
#pragma once

#include <nccl.h>

#include <string>
#include <string_view>

#include "runtime/status.h"

namespace strata::internal {

struct NcclApi {
  std::string path;  // the file the functions come from
  int version = 0;   // ncclGetVersion, e.g. 22809

  decltype(&::ncclGetVersion) GetVersion = nullptr;
  decltype(&::ncclGetUniqueId) GetUniqueId = nullptr;
  decltype(&::ncclCommInitRank) CommInitRank = nullptr;
  decltype(&::ncclCommDestroy) CommDestroy = nullptr;
  decltype(&::ncclCommAbort) CommAbort = nullptr;
  decltype(&::ncclCommGetAsyncError) CommGetAsyncError = nullptr;
  decltype(&::ncclGetErrorString) GetErrorString = nullptr;
  decltype(&::ncclGetLastError) GetLastError = nullptr;
  decltype(&::ncclAllReduce) AllReduce = nullptr;
  decltype(&::ncclReduceScatter) ReduceScatter = nullptr;
  decltype(&::ncclAllGather) AllGather = nullptr;
};

// The process's NCCL. Unavailable naming every place looked in and what each
// said (not found, not NCCL, a function missing), with what to install.
Result<const NcclApi*> LoadNccl();

// OK for ncclSuccess. Otherwise "<op>: ncclXxx (ncclGetErrorString)";
// ncclInvalidArgument/ncclInvalidUsage -> InvalidArgument,
// ncclSystemError/ncclRemoteError -> Unavailable, the rest -> Internal.
Status NcclError(ncclResult_t result, std::string_view op);

}  // namespace strata::internal
