# cmake -P tests/downstream/check.cmake: the downstream_* tests (see downstream.cmake, which
# passes every variable below). Installs the ferry build tree into a fresh prefix under
# WORK_DIR, then consumes it as an outside project would:
#   MODE=find_package  configure, build and run tests/downstream/project with
#                      CMAKE_PREFIX_PATH=<prefix> (find_package(ferry 0.1 REQUIRED)).
#   MODE=pkg_config    compile and run project/main.cpp with the flags of
#                      `pkg-config --cflags --libs ferry` from <prefix>.
cmake_minimum_required(VERSION 3.20)

foreach(_v MODE FERRY_BUILD_DIR FERRY_LIBRARY FERRY_VERSION WORK_DIR PROJECT_DIR LIBDIR
           INCLUDEDIR CXX_COMPILER)
  if("${${_v}}" STREQUAL "")
    message(FATAL_ERROR "check.cmake: ${_v} is not set")
  endif()
endforeach()
if(NOT MODE MATCHES "^(find_package|pkg_config)$")
  message(FATAL_ERROR "check.cmake: unknown MODE '${MODE}'")
endif()

# step(<what> COMMAND ...): runs the command, its output going to ours; fails the test on a
# nonzero exit status.
function(step what)
  message(STATUS "downstream ${MODE}: ${what}")
  execute_process(${ARGN} RESULT_VARIABLE rc COMMAND_ECHO STDOUT)
  if(NOT rc STREQUAL "0")
    message(FATAL_ERROR "downstream ${MODE}: ${what} failed (${rc})")
  endif()
endfunction()

function(expect_file path)
  if(NOT EXISTS "${path}")
    message(FATAL_ERROR "downstream ${MODE}: the install lacks ${path}")
  endif()
endfunction()

set(prefix "${WORK_DIR}/prefix")
if(IS_ABSOLUTE "${LIBDIR}")
  set(libdir "${LIBDIR}")
else()
  set(libdir "${prefix}/${LIBDIR}")
endif()
if(IS_ABSOLUTE "${INCLUDEDIR}")
  set(includedir "${INCLUDEDIR}")
else()
  set(includedir "${prefix}/${INCLUDEDIR}")
endif()

if(NOT EXISTS "${FERRY_LIBRARY}")
  message(FATAL_ERROR "downstream ${MODE}: ${FERRY_LIBRARY} does not exist: build ferry "
                      "before running this test (it installs the build tree as it is)")
endif()

# A fresh prefix each run: nothing left from an earlier install may hide a missing file.
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

set(config_args)
if(CONFIG)
  set(config_args --config "${CONFIG}")
endif()
step("install into ${prefix}"
  COMMAND "${CMAKE_COMMAND}" --install "${FERRY_BUILD_DIR}" --prefix "${prefix}" ${config_args})

# The tools the build made are installed and start from the prefix with nothing set.
string(REPLACE "," ";" tools "${TOOLS}")
foreach(tool IN LISTS tools)
  set(path "${prefix}/bin/${tool}")
  if(NOT EXISTS "${path}")
    message(FATAL_ERROR "downstream ${MODE}: the install lacks bin/${tool}")
  endif()
  step("run the installed ${tool} --help"
    COMMAND "${CMAKE_COMMAND}" -E env --unset=LD_LIBRARY_PATH "${path}" --help TIMEOUT 60)
endforeach()

# The Python package imports from the prefix, finds the libferry installed there (no
# LD_LIBRARY_PATH), and moves bytes.
if(PYTHON AND MODE STREQUAL "find_package")
  set(pydir "${prefix}/${PYTHON_DIR}")
  expect_file("${pydir}/ferry/__init__.py")
  step("import the installed Python package"
    COMMAND "${CMAKE_COMMAND}" -E env --unset=LD_LIBRARY_PATH "PYTHONPATH=${pydir}"
            "${PYTHON}" -c "import ferry, sys
assert ferry.__file__.startswith(sys.argv[1]), ferry.__file__
a, b = ferry.Connector(nats=False), ferry.Connector(nats=False)
src, dst = bytes(range(256)) * 16, bytearray(4096)
with a.create_readable(src) as r:
    assert b.begin_read(r.metadata(), dst).wait_for_completion(10)
assert bytes(dst) == src
print('installed ferry', ferry.__version__, 'from', ferry.__file__)" "${pydir}"
            TIMEOUT 60)
endif()

get_filename_component(library_name "${FERRY_LIBRARY}" NAME)
expect_file("${libdir}/${library_name}")
expect_file("${includedir}/ferry/ferry.hpp")
expect_file("${libdir}/cmake/ferry/ferryConfig.cmake")
expect_file("${libdir}/cmake/ferry/ferryConfigVersion.cmake")
expect_file("${libdir}/cmake/ferry/ferryTargets.cmake")
expect_file("${libdir}/pkgconfig/ferry.pc")

set(cxx_flags "${CXX_FLAGS}")
if(FERRY_WERROR)
  # The public headers must compile cleanly in a strict consumer too.
  string(APPEND cxx_flags " -Wall -Wextra -Wpedantic -Werror")
endif()
string(STRIP "${cxx_flags}" cxx_flags)

if(MODE STREQUAL "find_package")
  set(build "${WORK_DIR}/build")
  set(configure_args -S "${PROJECT_DIR}" -B "${build}"
    "-DCMAKE_PREFIX_PATH=${prefix}"
    "-DFERRY_EXPECTED_PREFIX=${prefix}"
    "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}"
    "-DCMAKE_CXX_FLAGS=${cxx_flags}")
  if(GENERATOR)
    list(APPEND configure_args -G "${GENERATOR}")
  endif()
  if(MAKE_PROGRAM)
    list(APPEND configure_args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
  endif()
  if(CONFIG)
    list(APPEND configure_args "-DCMAKE_BUILD_TYPE=${CONFIG}")
  endif()
  step("configure the downstream project" COMMAND "${CMAKE_COMMAND}" ${configure_args})
  step("build the downstream project"
    COMMAND "${CMAKE_COMMAND}" --build "${build}" ${config_args})
  # The project writes its executable's path (generators put it in different places).
  file(STRINGS "${build}/executable.txt" exe LIMIT_COUNT 1)
  step("run ${exe}" COMMAND "${exe}" TIMEOUT 120)
else()
  if(NOT PKG_CONFIG)
    find_program(PKG_CONFIG NAMES pkg-config pkgconf)
    if(NOT PKG_CONFIG)
      message(FATAL_ERROR "downstream pkg_config: no pkg-config program")
    endif()
  endif()
  set(ENV{PKG_CONFIG_PATH} "${libdir}/pkgconfig")
  set(static_arg)
  if(NOT FERRY_SHARED)
    set(static_arg --static)  # a static libferry needs libuv, libnats, libstdc++ at the link
  endif()

  execute_process(COMMAND "${PKG_CONFIG}" --modversion ferry
    RESULT_VARIABLE rc OUTPUT_VARIABLE version OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc STREQUAL "0" OR NOT version STREQUAL FERRY_VERSION)
    message(FATAL_ERROR "downstream pkg_config: PKG_CONFIG_PATH=$ENV{PKG_CONFIG_PATH} "
                        "pkg-config --modversion ferry gave '${version}' (exit ${rc}), "
                        "expected ${FERRY_VERSION}")
  endif()

  set(pc_args --cflags --libs ${static_arg} ferry)
  execute_process(COMMAND "${PKG_CONFIG}" ${pc_args}
    RESULT_VARIABLE rc OUTPUT_VARIABLE flags ERROR_VARIABLE errors
    OUTPUT_STRIP_TRAILING_WHITESPACE)
  list(JOIN pc_args " " pc_args)
  message(STATUS "downstream pkg_config: PKG_CONFIG_PATH=$ENV{PKG_CONFIG_PATH} "
                 "pkg-config ${pc_args}: ${flags}")
  if(NOT rc STREQUAL "0")
    message(FATAL_ERROR "downstream pkg_config: pkg-config failed (${rc}): ${errors}")
  endif()
  separate_arguments(flags UNIX_COMMAND "${flags}")

  # The flags must point into the prefix just installed, not where the build was configured
  # to install (CMAKE_INSTALL_PREFIX): a consumer of this prefix would otherwise compile
  # against other headers, or none.
  file(REAL_PATH "${includedir}" want_include)
  file(REAL_PATH "${libdir}" want_lib)
  set(have_include FALSE)
  set(have_lib FALSE)
  foreach(f IN LISTS flags)
    if(f MATCHES "^-I(.+)$")
      file(REAL_PATH "${CMAKE_MATCH_1}" dir)
      if(dir STREQUAL want_include)
        set(have_include TRUE)
      endif()
    elseif(f MATCHES "^-L(.+)$")
      file(REAL_PATH "${CMAKE_MATCH_1}" dir)
      if(dir STREQUAL want_lib)
        set(have_lib TRUE)
      endif()
    endif()
  endforeach()
  if(NOT have_include OR NOT have_lib)
    message(FATAL_ERROR "downstream pkg_config: the flags do not point into the install "
                        "prefix ${prefix} (want -I${includedir} and -L${libdir}); is "
                        "ferry.pc's prefix hard-coded to CMAKE_INSTALL_PREFIX instead of "
                        "following the .pc file (\${pcfiledir})?")
  endif()

  separate_arguments(extra UNIX_COMMAND "${cxx_flags}")
  set(exe "${WORK_DIR}/ferry_downstream_pc")
  # ferry's headers need C++20; the consumer picks its standard (the .pc file does not).
  # Nothing but the flags: the .pc file's own rpath must let the program start.
  step("compile main.cpp with the pkg-config flags"
    COMMAND "${CXX_COMPILER}" -std=c++20 ${extra} "${PROJECT_DIR}/main.cpp" -o "${exe}" ${flags})
  step("run ${exe}" COMMAND "${CMAKE_COMMAND}" -E env --unset=LD_LIBRARY_PATH "${exe}" TIMEOUT 120)
endif()
