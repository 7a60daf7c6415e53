// ferry._ferry: the C++ side of the Python package (python/ferry/ adds nixl_connect's names,
// asyncio and the conversions from Python objects). Private: import ferry, not this.
#include "binding.hpp"

PYBIND11_MODULE(_ferry, m) {
  m.doc() = "ferry's C++ core; use the ferry package, which wraps it.";
  ferry::python::bind_values(m);
  ferry::python::bind_descriptors(m);
  ferry::python::bind_completions(m);
  ferry::python::bind_connector(m);
  ferry::python::bind_messaging(m);
}
