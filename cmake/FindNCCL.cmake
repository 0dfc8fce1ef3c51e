# FindNCCL: locates NCCL's header and library. Defines NCCL_FOUND,
# NCCL_VERSION and the imported target NCCL::nccl. Looked for, in order:
#   1. NCCL_ROOT (CMake variable or environment);
#   2. the NCCL wheel of the Python that has torch (STRATA_PYTHON, else
#      python3 on PATH): nvidia/nccl/{include,lib} of `nvidia-nccl-cu1x`,
#      which ships only libnccl.so.2. Linking the same file torch loads keeps
#      one NCCL in the process;
#   3. the CUDA toolkit (/usr/local/cuda here).
# Set NCCL_INCLUDE_DIR and NCCL_LIBRARY to override the search.
set(_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT})
set(_nccl_python "${STRATA_PYTHON}")
if(NOT _nccl_python)
  find_program(_nccl_python NAMES python3 NO_CACHE)
endif()
if(_nccl_python)
  execute_process(
    COMMAND "${_nccl_python}" -c "import nvidia.nccl as m; print(list(m.__path__)[0])"
    RESULT_VARIABLE _nccl_py_rc OUTPUT_VARIABLE _nccl_py_dir
    OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET TIMEOUT 60)
  if(_nccl_py_rc EQUAL 0 AND EXISTS "${_nccl_py_dir}/include/nccl.h")
    list(APPEND _nccl_hints "${_nccl_py_dir}")
  endif()
endif()
list(APPEND _nccl_hints ${CUDAToolkit_INCLUDE_DIRS} ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda)

find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include)
# libnccl.so.2 by its full name: the wheel has no libnccl.so link.
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR HINTS ${_nccl_hints} PATH_SUFFIXES lib lib64)

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_ver REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) +[0-9]+")
  string(REGEX REPLACE ".*NCCL_MAJOR +([0-9]+).*" "\\1" _maj "${_nccl_ver}")
  string(REGEX REPLACE ".*NCCL_MINOR +([0-9]+).*" "\\1" _min "${_nccl_ver}")
  string(REGEX REPLACE ".*NCCL_PATCH +([0-9]+).*" "\\1" _pat "${_nccl_ver}")
  set(NCCL_VERSION "${_maj}.${_min}.${_pat}")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL
  REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR
  VERSION_VAR NCCL_VERSION)

if(NCCL_FOUND AND NOT TARGET NCCL::nccl)
  add_library(NCCL::nccl UNKNOWN IMPORTED)
  set_target_properties(NCCL::nccl PROPERTIES
    IMPORTED_LOCATION "${NCCL_LIBRARY}"
    INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
