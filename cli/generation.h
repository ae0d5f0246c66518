// linvis eval --task diffusion (cli/cmd_sample.cpp): the eval command hands over to it when it sees
// --task diffusion.
#pragma once

#include "common.h"  // task_is

namespace linvis::cli {

int run_eval_diffusion(int argc, const char* const* argv);

}  // namespace linvis::cli
