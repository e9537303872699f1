// tapegrad: the umbrella header. Include this one; it only includes the public headers.
#pragma once

#include "tapegrad/config.hpp"
#include "tapegrad/core/bf16.hpp"
#include "tapegrad/core/device.hpp"
#include "tapegrad/core/dtype.hpp"
#include "tapegrad/core/error.hpp"
#include "tapegrad/core/shape.hpp"
#include "tapegrad/core/storage.hpp"
#include "tapegrad/core/tensor.hpp"
#include "tapegrad/random/random.hpp"
#include "tapegrad/random/threefry.hpp"
#include "tapegrad/ops/elementwise.hpp"
#include "tapegrad/ops/functors.hpp"
#include "tapegrad/ops/matmul.hpp"
#include "tapegrad/ops/nn.hpp"
#include "tapegrad/ops/reduce.hpp"
