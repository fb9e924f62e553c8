// Eigen views of float rows, shared by the CPU kernels.
#pragma once

#include <Eigen/Core>

namespace fusecli {

using Arr = Eigen::Array<float, Eigen::Dynamic, 1>;
using CA = Eigen::Map<const Arr>;
using MA = Eigen::Map<Arr>;

}  // namespace fusecli
