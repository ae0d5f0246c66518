// linvis train/eval/predict --task segmentation (cli/cmd_segmentation.cpp); the classification commands
// hand over to these when they see --task segmentation.
#pragma once

namespace linvis::cli {

// True when argv holds "--task NAME" or "--task=NAME".
bool task_is(int argc, const char* const* argv, const char* name);

int run_train_segmentation(int argc, const char* const* argv);
int run_eval_segmentation(int argc, const char* const* argv);
int run_predict_segmentation(int argc, const char* const* argv);

}  // namespace linvis::cli
