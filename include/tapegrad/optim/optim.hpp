// tg::optim: Optax's composable gradient transformations in C++.
#pragma once

#include "tapegrad/optim/alias.hpp"
#include "tapegrad/optim/base.hpp"
#include "tapegrad/optim/combine.hpp"
#include "tapegrad/optim/adamw.hpp"
#include "tapegrad/optim/schedule.hpp"
#include "tapegrad/optim/transforms.hpp"
#include "tapegrad/optim/update.hpp"
