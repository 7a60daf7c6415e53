# Registered by tests/CMakeLists.txt: checks that an installed ferry can be consumed.
#
#   downstream_find_package  cmake --install the build tree into a fresh prefix, then
#                            configure, build and run tests/downstream/project against it
#                            with find_package(ferry 0.1 REQUIRED) and ferry::ferry.
#   downstream_pkg_config    the same install, then compile and run project/main.cpp with
#                            nothing but `pkg-config --cflags --libs ferry`.
#
# Both run tests/downstream/check.cmake. They install what the build produced (cmake --install
# builds nothing), so they need the build to be complete, as ctest after a build has it; the
# library file is a REQUIRED_FILE, so ctest reports "Not Run" rather than a confusing failure
# when it is missing.

set(_ferry_ds_dir "${CMAKE_CURRENT_LIST_DIR}")
set(_ferry_ds_work "${CMAKE_CURRENT_BINARY_DIR}/downstream")

# Sanitizer runtimes must be in the consumer's link too (a -fsanitize=address libferry.so
# cannot be loaded into a program without the ASan runtime).
set(_ferry_ds_flags "${CMAKE_CXX_FLAGS}")
if(FERRY_SANITIZE)
  string(APPEND _ferry_ds_flags " -fsanitize=${FERRY_SANITIZE} -fno-omit-frame-pointer")
endif()
string(STRIP "${_ferry_ds_flags}" _ferry_ds_flags)

# The tools cmake --install puts into bin/ (when this build makes them).
# (bench/ comes after tests/: its option says whether ferry-bench is built.)
set(_ferry_ds_tools "")
if(TARGET ferry-info)
  list(APPEND _ferry_ds_tools ferry-info)
endif()
if(FERRY_BUILD_BENCH)
  list(APPEND _ferry_ds_tools ferry-bench)
endif()
string(REPLACE ";" "," _ferry_ds_tools "${_ferry_ds_tools}")  # a list through add_test
# The Python package, when this build makes it (python/ comes after tests/: the option's AUTO
# is decided before either, in the top-level CMakeLists.txt).
set(_ferry_ds_python "")
if(FERRY_PYTHON)
  set(_ferry_ds_python "${Python3_EXECUTABLE}")
endif()

foreach(_mode IN ITEMS find_package pkg_config)
  add_test(NAME downstream_${_mode}
    COMMAND ${CMAKE_COMMAND}
      -DMODE=${_mode}
      "-DFERRY_BUILD_DIR=${PROJECT_BINARY_DIR}"
      "-DFERRY_LIBRARY=$<TARGET_FILE:ferry>"
      "-DFERRY_VERSION=${PROJECT_VERSION}"
      "-DFERRY_SHARED=${FERRY_BUILD_SHARED}"
      "-DFERRY_WERROR=${FERRY_WERROR}"
      "-DCONFIG=$<CONFIG>"
      "-DLIBDIR=${CMAKE_INSTALL_LIBDIR}"
      "-DINCLUDEDIR=${CMAKE_INSTALL_INCLUDEDIR}"
      "-DWORK_DIR=${_ferry_ds_work}/${_mode}"
      "-DPROJECT_DIR=${_ferry_ds_dir}/project"
      "-DGENERATOR=${CMAKE_GENERATOR}"
      "-DMAKE_PROGRAM=${CMAKE_MAKE_PROGRAM}"
      "-DCXX_COMPILER=${CMAKE_CXX_COMPILER}"
      "-DCXX_FLAGS=${_ferry_ds_flags}"
      "-DPKG_CONFIG=${PKG_CONFIG_EXECUTABLE}"
      "-DTOOLS=${_ferry_ds_tools}"
      "-DPYTHON=${_ferry_ds_python}"
      "-DPYTHON_DIR=${FERRY_PYTHON_INSTALL_DIR}"
      -P "${_ferry_ds_dir}/check.cmake")
  set_tests_properties(downstream_${_mode} PROPERTIES
    LABELS install
    TIMEOUT 300
    REQUIRED_FILES "$<TARGET_FILE:ferry>"
    # Both write <build>/install_manifest.txt: one at a time.
    RESOURCE_LOCK ferry_install_tree)
endforeach()
