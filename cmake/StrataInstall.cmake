# `cmake --install build --prefix /opt/strata`: the libraries, headers and the
# `strata` tool, with
#   lib/cmake/strata/strataConfig.cmake   find_package(strata) -> strata::offload, ...
#   lib/pkgconfig/strata_c.pc            pkg-config for the C API (libstrata_c.so)
# and, for use without installing, build/strata_c.pc (the build tree's paths).
# The Python package installs with pip instead (setup.py, README "Installing").
include_guard(GLOBAL)
include(CMakePackageConfigHelpers)

set(STRATA_INSTALL_CMAKEDIR ${CMAKE_INSTALL_LIBDIR}/cmake/strata)

# Installed binaries keep the directories of libraries found outside the
# system paths (NCCL from a Python wheel, a CUDA toolkit, a conda prefix).
# The build tree's copies get the same run path: CMake pads a build run path
# with ':' to make room for the install one, and an empty entry means the
# current directory (a libxxhash.so.0 there was loaded). Both link only
# static Strata libraries, so nothing of the build tree is looked up.
set_target_properties(strata strata_capi PROPERTIES INSTALL_RPATH_USE_LINK_PATH TRUE
                                                    BUILD_WITH_INSTALL_RPATH TRUE)

install(TARGETS strata_runtime strata_cpu_adam strata_kernels strata_offload strata_capi
  EXPORT strataTargets
  ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(TARGETS strata RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

# Public headers, as the source tree lays them out ("offload/optimizer.h").
foreach(_dir runtime cpu_adam kernels offload)
  install(DIRECTORY ${PROJECT_SOURCE_DIR}/${_dir}/
    DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/strata/${_dir}
    FILES_MATCHING PATTERN "*.h"
    PATTERN "*_internal.h" EXCLUDE
    PATTERN "*-inl.h" EXCLUDE
    PATTERN "testing" EXCLUDE)
endforeach()

install(EXPORT strataTargets NAMESPACE strata:: DESTINATION ${STRATA_INSTALL_CMAKEDIR})
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/strataConfig.cmake.in
  ${PROJECT_BINARY_DIR}/strataConfig.cmake
  INSTALL_DESTINATION ${STRATA_INSTALL_CMAKEDIR})
write_basic_package_version_file(${PROJECT_BINARY_DIR}/strataConfigVersion.cmake
  COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/strataConfig.cmake
              ${PROJECT_BINARY_DIR}/strataConfigVersion.cmake
  DESTINATION ${STRATA_INSTALL_CMAKEDIR})

# Relocatable: the prefix is found from the .pc file's own place, so
# `cmake --install --prefix` anywhere gives a working file. Libs carries an
# rpath to libdir: a prefix like /opt/strata is not in the loader's path, and
# `cc trainer.c $(pkg-config --cflags --libs strata_c)` gave a binary that
# could not find libstrata_c.so.
file(RELATIVE_PATH _strata_pc_up "/p/${CMAKE_INSTALL_LIBDIR}/pkgconfig" "/p")
string(REGEX REPLACE "/$" "" _strata_pc_up "${_strata_pc_up}")
set(STRATA_PC_PREFIX "\${pcfiledir}/${_strata_pc_up}")
configure_file(${PROJECT_SOURCE_DIR}/cmake/strata_c.pc.in
  ${PROJECT_BINARY_DIR}/pkgconfig-install/strata_c.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/pkgconfig-install/strata_c.pc
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

# The build tree's own strata_c.pc (`PKG_CONFIG_PATH=build pkg-config
# strata_c`): this build's library, with an rpath to it, and the source
# tree's headers, included as in an install ("offload/strata_c.h").
file(GENERATE OUTPUT ${PROJECT_BINARY_DIR}/strata_c.pc CONTENT
"libdir=$<TARGET_FILE_DIR:strata_capi>
includedir=${PROJECT_SOURCE_DIR}

Name: strata_c
Description: Strata offload optimizer, C API (the build tree in ${PROJECT_BINARY_DIR})
Version: ${PROJECT_VERSION}
Libs: -L\${libdir} -Wl,-rpath,\${libdir} -lstrata_c
Cflags: -I\${includedir}
")
