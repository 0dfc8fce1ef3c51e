# strata_cc_library / strata_cc_test / strata_cc_bench: one target per module,
# one test binary per suite, the same warnings everywhere.
include_guard(GLOBAL)
include(GNUInstallDirs)

# GCC 12 reports false maybe-uninitialized warnings through std::optional,
# and false restrict warnings in std::string's inlined copies ("a" +
# std::to_string(n): GCC bug 105329, fixed in GCC 13).
set(STRATA_WARNINGS -Wall -Wextra -Wno-unused-parameter -Wno-maybe-uninitialized)
if(CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND CMAKE_CXX_COMPILER_VERSION VERSION_LESS 13)
  list(APPEND STRATA_WARNINGS -Wno-restrict)
endif()

# strata_cc_library(NAME name SRCS ... [DEPS ...] [PRIVATE_DEPS ...])
# Creates strata_<name> and its alias strata::<name> (exported under the same
# name by cmake/StrataInstall.cmake). The project root is the include root,
# so headers are included as "runtime/status.h" (installed: include/strata).
function(strata_cc_library)
  cmake_parse_arguments(A "" "NAME" "SRCS;DEPS;PRIVATE_DEPS" ${ARGN})
  add_library(strata_${A_NAME} ${A_SRCS})
  add_library(strata::${A_NAME} ALIAS strata_${A_NAME})
  target_include_directories(strata_${A_NAME} PUBLIC
    $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}> $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}/strata>)
  set_target_properties(strata_${A_NAME} PROPERTIES EXPORT_NAME ${A_NAME})
  target_link_libraries(strata_${A_NAME} PUBLIC ${A_DEPS} PRIVATE ${A_PRIVATE_DEPS})
  target_compile_options(strata_${A_NAME} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${STRATA_WARNINGS}>)
endfunction()

# strata_cc_test(NAME name SRCS ... [DEPS ...] [LABELS ...])
# A GoogleTest binary, registered with ctest test by test (gtest_discover_tests).
# GTEST_SKIP is reported by ctest as skipped through the SKIP_REGULAR_EXPRESSION
# that gtest_discover_tests itself sets on every test (3.25 and later). Passing
# it again in PROPERTIES breaks CMake 4, which writes the value into a bracket
# argument that its trailing "]" closes early (tests/cmake/check_gtest_skip.sh).
# RESOURCE_LOCK name: ctest runs none of its tests beside another test that
# holds the same lock (free_space: tests/offload/CMakeLists.txt).
function(strata_cc_test)
  cmake_parse_arguments(A "" "NAME;RESOURCE_LOCK" "SRCS;DEPS;LABELS" ${ARGN})
  add_executable(${A_NAME} ${A_SRCS})
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS} GTest::gtest GTest::gtest_main GTest::gmock)
  target_compile_options(${A_NAME} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${STRATA_WARNINGS}>)
  # A test's own code at -O1 in a Release build: half the compile time of
  # -O3 for the suites' large files (CI builds them on 2 cores). The code
  # under test is the libraries', built as configured; the tests' own
  # arithmetic gives the same bits at any level, as the kernels' does
  # (no contraction into FMAs, no fast-math).
  target_compile_options(${A_NAME} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-ffp-contract=off>
                         $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CONFIG:Release>>:-O1>)
  set(_labels ${A_LABELS})
  if(NOT _labels)
    set(_labels unit)
  endif()
  set(_properties LABELS "${_labels}")
  if(A_RESOURCE_LOCK)
    list(APPEND _properties RESOURCE_LOCK "${A_RESOURCE_LOCK}")
  endif()
  gtest_discover_tests(${A_NAME}
    PROPERTIES ${_properties}
    DISCOVERY_TIMEOUT 60)
endfunction()

# strata_cc_bench(NAME name SRCS ... [DEPS ...])
function(strata_cc_bench)
  cmake_parse_arguments(A "" "NAME" "SRCS;DEPS" ${ARGN})
  add_executable(${A_NAME} ${A_SRCS})
  target_link_libraries(${A_NAME} PRIVATE ${A_DEPS} benchmark::benchmark)
  target_compile_options(${A_NAME} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${STRATA_WARNINGS}>)
endfunction()

include(GoogleTest)
