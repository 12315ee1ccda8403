// The serving half of elasticep._C (serving_bindings.cpp), registered by bindings.cpp.
#pragma once

#include <nanobind/nanobind.h>

namespace elasticep::python {
void register_serving(nanobind::module_& m);
}  // namespace elasticep::python
