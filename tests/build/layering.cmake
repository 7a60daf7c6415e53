# The layers' include trees (CMakeLists.txt, transport/CMakeLists.txt), checked: each probe
# compiles one #include with exactly the include path its layer's sources get. A "refused"
# probe passes only when the compiler says the header cannot be found (an include against the
# direction does not compile); a "sees" probe must compile, which shows the probes themselves
# work. Every header named must exist in the tree, so a refusal is never a typo.

find_package(PkgConfig REQUIRED)
set(_ferry_probe_dir ${PROJECT_BINARY_DIR}/layering)
file(MAKE_DIRECTORY ${_ferry_probe_dir})
get_target_property(_nats_includes PkgConfig::FERRY_NATS INTERFACE_INCLUDE_DIRECTORIES)
get_target_property(_uv_includes PkgConfig::FERRY_UV INTERFACE_INCLUDE_DIRECTORIES)
set(_probe_includes -I${PROJECT_SOURCE_DIR}/sdk/include)
foreach(_dir IN LISTS _nats_includes _uv_includes)
  if(_dir)
    list(APPEND _probe_includes -isystem ${_dir})
  endif()
endforeach()

# ferry_layering_probe(layer refused|sees header): header as the layer's sources spell it.
function(ferry_layering_probe layer verdict header)
  if(header MATCHES "^loop/(.*)")
    set(source sdk/loop/${CMAKE_MATCH_1})
  else()
    set(source ${header})
  endif()
  if(NOT EXISTS ${PROJECT_SOURCE_DIR}/${source})
    message(FATAL_ERROR "layering probe: ${source} does not exist")
  endif()
  string(MAKE_C_IDENTIFIER "${layer}_${verdict}_${header}" id)
  set(file ${_ferry_probe_dir}/${id}.cpp)
  file(WRITE ${file} "#include \"${header}\"\n")
  set(name "Layering.${layer}_${verdict}_${header}")
  add_test(NAME ${name}
           COMMAND ${CMAKE_CXX_COMPILER} -std=c++20 -fsyntax-only
                   -I${PROJECT_BINARY_DIR}/layers/${layer} ${_probe_includes} ${file})
  set_tests_properties(${name} PROPERTIES LABELS "unit;build")
  if(verdict STREQUAL "refused")
    string(REPLACE "." "\\." pattern "${header}")
    set_tests_properties(${name} PROPERTIES
      PASS_REGULAR_EXPRESSION "${pattern}: No such file or directory|'${pattern}' file not found")
  endif()
endfunction()

# A method sees the kit, the wire, cuda (and same_host where it shares it), never another
# method.
ferry_layering_probe(tcp sees transport/tcp/tcp_transport.hpp)
ferry_layering_probe(tcp sees transport/kit/pending.hpp)
ferry_layering_probe(tcp refused transport/cma/cma_transport.hpp)
ferry_layering_probe(tcp refused transport/same_host/link.hpp)
ferry_layering_probe(cma sees transport/same_host/link.hpp)
ferry_layering_probe(cma refused transport/tcp/tcp_transport.hpp)
ferry_layering_probe(cma refused transport/cuda_ipc/ipc_handles.hpp)
ferry_layering_probe(cuda_ipc sees transport/same_host/listener.hpp)
ferry_layering_probe(cuda_ipc refused transport/cma/cma_transport.hpp)
ferry_layering_probe(same_host sees transport/kit/admission.hpp)
ferry_layering_probe(same_host refused transport/cma/cma_transport.hpp)
ferry_layering_probe(same_host refused transport/tcp/tcp_link.hpp)
if(FERRY_VERBS)
  ferry_layering_probe(verbs sees transport/verbs/verbs_conn.hpp)
  ferry_layering_probe(verbs refused transport/tcp/tcp_transport.hpp)
  ferry_layering_probe(verbs refused transport/same_host/link.hpp)
  ferry_layering_probe(tcp refused transport/verbs/verbs_transport.hpp)
endif()
# The kit, the wire and cuda see no method, and not each other unless named.
ferry_layering_probe(kit sees transport/kit/transfers.hpp)
ferry_layering_probe(kit refused transport/wire/frame.hpp)
ferry_layering_probe(kit refused transport/tcp/tcp_transport.hpp)
ferry_layering_probe(wire sees transport/wire/frame_reader.hpp)
ferry_layering_probe(wire refused transport/kit/pending.hpp)
ferry_layering_probe(cuda sees transport/cuda/stager.hpp)
ferry_layering_probe(cuda refused transport/wire/frame.hpp)
# The core sees none of its parts; the side channel and the loop see no transport; nothing
# below the sdk sees it.
ferry_layering_probe(transport sees transport/method.hpp)
ferry_layering_probe(transport refused transport/kit/pending.hpp)
ferry_layering_probe(transport refused transport/tcp/tcp_transport.hpp)
ferry_layering_probe(sidechannel sees sidechannel/nats_channel.hpp)
ferry_layering_probe(sidechannel refused transport/transport.hpp)
ferry_layering_probe(sidechannel refused sdk/src/core.hpp)
ferry_layering_probe(loop refused sidechannel/nats_channel.hpp)
ferry_layering_probe(loop refused transport/transport.hpp)
ferry_layering_probe(sdk sees transport/method.hpp)
ferry_layering_probe(sdk sees transport/cuda/cuda_memory.hpp)
ferry_layering_probe(sdk refused transport/tcp/tcp_transport.hpp)
ferry_layering_probe(sdk refused transport/kit/transfers.hpp)
