# Finds Strata's dependencies. Everything comes from Debian packages
# (scripts/setup installs them); CUDA and NCCL from the toolkit in /usr/local/cuda.
include_guard(GLOBAL)

find_package(PkgConfig REQUIRED)
find_package(Threads REQUIRED)
find_package(hwy REQUIRED)          # libhwy-dev: hwy::hwy
find_package(TBB REQUIRED)          # libtbb-dev: TBB::tbb
find_package(fmt REQUIRED)          # libfmt-dev: fmt::fmt
find_package(nlohmann_json REQUIRED)  # nlohmann-json3-dev
find_package(CLI11 REQUIRED)        # libcli11-dev
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)

# Resolves an AUTO|ON|OFF option: sets OUT to TRUE/FALSE, and fails when ON
# was asked for but FOUND is false.
function(strata_resolve_option name found out)
  if(${name} STREQUAL "OFF")
    set(${out} FALSE PARENT_SCOPE)
  elseif(found)
    set(${out} TRUE PARENT_SCOPE)
  elseif(${name} STREQUAL "ON")
    message(FATAL_ERROR "${name}=ON but its dependency was not found; install it or set ${name}=AUTO")
  else()
    set(${out} FALSE PARENT_SCOPE)
  endif()
endfunction()

# io_uring (liburing-dev).
pkg_check_modules(URING IMPORTED_TARGET liburing)
strata_resolve_option(STRATA_URING "${URING_FOUND}" STRATA_HAVE_URING)

# CUDA: the toolkit is looked for in the usual places and in /usr/local/cuda.
set(_strata_cuda_found FALSE)
if(NOT STRATA_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # A user's -DCMAKE_CUDA_ARCHITECTURES (or CUDAARCHS in the environment,
    # which CMake reads itself) wins. The default gives sm_80 code, which also
    # runs on every 8.x GPU (A100, A10, L4, L40S), sm_90 code (H100, H200),
    # and compute_90 PTX that the driver compiles for newer GPUs. On a GPU
    # none of these cover, kernels fail with FailedPrecondition naming the
    # compute capability to build for.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
      set(CMAKE_CUDA_ARCHITECTURES "80;90" CACHE STRING
          "CUDA architectures of Strata's kernels (default 80;90: Ampere/Ada and Hopper)")
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit)
    if(CUDAToolkit_FOUND)
      set(_strata_cuda_found TRUE)
    endif()
  endif()
endif()
strata_resolve_option(STRATA_CUDA "${_strata_cuda_found}" STRATA_HAVE_CUDA)

set(_strata_nccl_found FALSE)
if(STRATA_HAVE_CUDA AND NOT STRATA_NCCL STREQUAL "OFF")
  find_package(NCCL)
  set(_strata_nccl_found ${NCCL_FOUND})
endif()
strata_resolve_option(STRATA_NCCL "${_strata_nccl_found}" STRATA_HAVE_NCCL)

if(STRATA_BUILD_TESTS)
  find_package(GTest REQUIRED)
endif()
if(STRATA_BUILD_BENCH)
  find_package(benchmark REQUIRED)
endif()
