#include <dlfcn.h>
#include <fmt/format.h>

#include <cstdlib>
#include <type_traits>
#include <vector>

#include "runtime/nccl_internal.h"

namespace strata::internal {
namespace {

// The NCCL the build found (CMake: NCCL_LIBRARY), the last place looked in.
#ifndef STRATA_NCCL_LIBRARY
#define STRATA_NCCL_LIBRARY ""
#endif

struct Loaded {
  NcclApi api{};
  Status status;
};

// The functions of the NCCL at `name` (a soname or a path), or why not.
Result<NcclApi> Open(const std::string& name) {
  void* handle = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (handle == nullptr) {
    const char* why = dlerror();
    return NotFoundError(why != nullptr ? why : "dlopen failed");
  }
  NcclApi api;
  std::vector<std::string> missing;
  auto bind = [&](auto& fn, const char* symbol) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(handle, symbol));
    if (fn == nullptr) missing.emplace_back(symbol);
  };
  bind(api.GetVersion, "ncclGetVersion");
  bind(api.GetUniqueId, "ncclGetUniqueId");
  bind(api.CommInitRank, "ncclCommInitRank");
  bind(api.CommDestroy, "ncclCommDestroy");
  bind(api.CommAbort, "ncclCommAbort");
  bind(api.CommGetAsyncError, "ncclCommGetAsyncError");
  bind(api.GetErrorString, "ncclGetErrorString");
  bind(api.GetLastError, "ncclGetLastError");
  bind(api.AllReduce, "ncclAllReduce");
  bind(api.ReduceScatter, "ncclReduceScatter");
  bind(api.AllGather, "ncclAllGather");
  Dl_info info;
  api.path = api.GetVersion != nullptr && dladdr(reinterpret_cast<void*>(api.GetVersion), &info) &&
                     info.dli_fname != nullptr
                 ? info.dli_fname
                 : name;
  if (!missing.empty()) {
    dlclose(handle);
    if (api.GetVersion == nullptr) {
      return FailedPreconditionError(fmt::format("{} is not NCCL (no ncclGetVersion)", name));
    }
    return FailedPreconditionError(
        fmt::format("{} lacks {} (an NCCL older than 2.13?)", api.path, fmt::join(missing, ", ")));
  }
  if (api.GetVersion(&api.version) != ncclSuccess || api.version / 10000 != NCCL_MAJOR) {
    const int version = api.version;
    dlclose(handle);
    return FailedPreconditionError(fmt::format(
        "{} is NCCL version code {}; this build needs NCCL {}", api.path, version, NCCL_MAJOR));
  }
  return api;  // the handle stays open for the life of the process
}

Loaded Load() {
  std::vector<std::string> places;
  const char* chosen = std::getenv("STRATA_NCCL_LIBRARY");
  const bool user_chose = chosen != nullptr && *chosen != '\0';
  if (user_chose) {
    places.push_back(chosen);  // the user's choice, alone
  } else {
    places.push_back("libnccl.so.2");
    if (const std::string built = STRATA_NCCL_LIBRARY; !built.empty()) places.push_back(built);
  }
  std::vector<std::string> tried;
  for (const std::string& place : places) {
    Result<NcclApi> api = Open(place);
    if (api.ok()) return {.api = *std::move(api), .status = OkStatus()};
    tried.push_back(std::string(api.status().message()));
  }
  if (user_chose) {
    return {.status = UnavailableError(
                fmt::format("load NCCL from STRATA_NCCL_LIBRARY: {}; name the file libnccl.so.2, "
                            "or unset the variable to let the loader find it",
                            tried[0]))};
  }
  return {.status = UnavailableError(fmt::format(
              "load NCCL: {}; install NCCL {} (the nvidia-nccl-cu13 wheel torch uses, or the CUDA "
              "toolkit's) and put its directory in LD_LIBRARY_PATH or name the file in "
              "STRATA_NCCL_LIBRARY, or train without NCCL (one GPU, or a gloo process group)",
              fmt::join(tried, "; "), NCCL_MAJOR))};
}

}  // namespace

Result<const NcclApi*> LoadNccl() {
  static const Loaded* loaded = new Loaded(Load());  // never freed: callers keep the pointer
  if (!loaded->status.ok()) return loaded->status;
  return &loaded->api;
}

Status NcclError(ncclResult_t result, std::string_view op) {
  if (result == ncclSuccess) return OkStatus();
  std::string_view name = "ncclError";
  switch (result) {
    case ncclUnhandledCudaError:
      name = "ncclUnhandledCudaError";
      break;
    case ncclSystemError:
      name = "ncclSystemError";
      break;
    case ncclInternalError:
      name = "ncclInternalError";
      break;
    case ncclInvalidArgument:
      name = "ncclInvalidArgument";
      break;
    case ncclInvalidUsage:
      name = "ncclInvalidUsage";
      break;
    case ncclRemoteError:
      name = "ncclRemoteError";
      break;
    case ncclInProgress:
      name = "ncclInProgress";
      break;
    default:
      break;
  }
  // A result comes from a loaded NCCL, so this is the loaded one's text.
  Result<const NcclApi*> nccl = LoadNccl();
  std::string m = nccl.ok() ? fmt::format("{}: {} ({})", op, name, (*nccl)->GetErrorString(result))
                            : fmt::format("{}: {}", op, name);
  switch (result) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return InvalidArgumentError(std::move(m));
    case ncclSystemError:
    case ncclRemoteError:
      return UnavailableError(std::move(m));
    default:
      return InternalError(std::move(m));
  }
}

}  // namespace strata::internal
