# Chooses the Python the module (strata._strata) is built for, and where its
# pybind11 comes from. Users train in the environment that has torch (a venv,
# conda, Debian's /usr/bin/python3), so in order:
#   1. STRATA_PYTHON given (-DSTRATA_PYTHON=... or the environment variable);
#   2. `python3` on PATH, when it imports torch;
#   3. /usr/bin/python3 (Debian's python3-torch lives there);
#   4. `python3` on PATH anyway.
# pybind11 is looked for in that Python first (`python -m pybind11
# --cmakedir`, as pip's pybind11 installs it), then where CMake finds it
# (Debian's pybind11-dev). The choice is cached: reconfigure with
# -DSTRATA_PYTHON=... to change it.
include_guard(GLOBAL)

if(NOT STRATA_PYTHON AND DEFINED ENV{STRATA_PYTHON} AND NOT "$ENV{STRATA_PYTHON}" STREQUAL "")
  set(STRATA_PYTHON "$ENV{STRATA_PYTHON}" CACHE FILEPATH "Python the module is built for")
endif()
if(NOT STRATA_PYTHON)
  find_program(_strata_path_python3 NAMES python3 NO_CACHE)
  set(_strata_choice "")
  if(_strata_path_python3)
    execute_process(COMMAND "${_strata_path_python3}" -c "import torch"
      RESULT_VARIABLE _strata_torch_rc OUTPUT_QUIET ERROR_QUIET TIMEOUT 180)
    if(_strata_torch_rc EQUAL 0)
      set(_strata_choice "${_strata_path_python3}")
      set(_strata_why "python3 on PATH imports torch")
    endif()
  endif()
  if(NOT _strata_choice AND EXISTS /usr/bin/python3)
    set(_strata_choice /usr/bin/python3)
    set(_strata_why "python3 on PATH has no torch")
  endif()
  if(NOT _strata_choice AND _strata_path_python3)
    set(_strata_choice "${_strata_path_python3}")
    set(_strata_why "no Python with torch found")
  endif()
  set(STRATA_PYTHON "${_strata_choice}" CACHE FILEPATH "Python the module is built for")
  message(STATUS "Strata: Python module for ${STRATA_PYTHON} (${_strata_why}; set STRATA_PYTHON to choose)")
endif()

# pybind11 of that Python, when it has one.
if(STRATA_PYTHON AND NOT pybind11_DIR)
  execute_process(COMMAND "${STRATA_PYTHON}" -m pybind11 --cmakedir
    RESULT_VARIABLE _strata_pb_rc OUTPUT_VARIABLE _strata_pb_dir
    OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET TIMEOUT 60)
  if(_strata_pb_rc EQUAL 0 AND EXISTS "${_strata_pb_dir}")
    set(pybind11_DIR "${_strata_pb_dir}" CACHE PATH "pybind11's CMake package (from STRATA_PYTHON)")
  endif()
endif()
