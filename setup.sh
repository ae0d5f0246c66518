#!/usr/bin/env bash
# One command from a fresh Debian 12 machine to a working linvis:
# installs the system packages, builds, and runs the demo.
set -euo pipefail
cd "$(dirname "$0")"
./scripts/install-deps.sh
LINVIS_TARGETS=linvis_cli ./scripts/build.sh   # the library and the command; ./test.sh builds the tests
./build/linvis demo
