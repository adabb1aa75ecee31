// step.cpp's Run class, bound where it is defined (its nodes' types are step.cpp's own): bindings.cpp calls bind.
#pragma once

// pybind11 with torch's type casters (what torch/extension.h adds to them, the C++ frontend, costs seconds a file)
#include <torch/csrc/utils/pybind.h>

namespace optc::step {

// adds the Run class (a planned run of a step's nodes) to the extension's module
void bind(pybind11::module_& m);

}  // namespace optc::step
