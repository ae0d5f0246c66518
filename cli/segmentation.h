// linvis train/eval/predict --task segmentation (cli/cmd_segmentation.cpp); the classification commands
// hand over to these when they see --task segmentation.
#pragma once

#include "common.h"  // task_is

namespace linvis::cli {

int run_train_segmentation(int argc, const char* const* argv);
int run_eval_segmentation(int argc, const char* const* argv);
int run_predict_segmentation(int argc, const char* const* argv);

}  // namespace linvis::cli
