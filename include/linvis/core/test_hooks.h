// Test-only stop points, so that crash tests can kill a linvis process with SIGKILL at a known
// place (for example between writing a checkpoint's temporary file and renaming it) instead of
// at a random moment.
//
// When the environment variable LINVIS_TEST_STOP_AT is "NAME:N", the N-th call (counting from 1)
// of test_stop_point(NAME) prints "linvis: stopped at test point NAME #N" on stderr and stops the
// process with SIGSTOP; the test then inspects the files and sends SIGKILL (or SIGCONT).
// Without the variable (always, outside tests) a call only compares a cached flag.
// Points: "atomic-write-begin:<file name>" (temporary file created, nothing written yet),
// "atomic-write-rename:<file name>" (temporary file complete and fsync-ed, not yet renamed),
// "train-batch" (before each training batch).
#pragma once

#include <string>

namespace linvis {

void test_stop_point(const std::string& name);

}  // namespace linvis
