#!/usr/bin/env bash
# Packs libaio (headers + shared library) for the offline GPU machine, whose image may lack
# libaio-dev: DeepSpeed's async I/O op (ZeRO-Infinity, deepspeed.zero3_nvme) links against it
# when it is JIT-built there.
#
#   bash scripts/libaio_bundle.sh [OUT]      (default OUT: .whl/libaio at the repository root)
#
# OUT gets include/libaio.h and lib/libaio.so{,.1,.1.0.2} (about 30 KB) taken from this machine's
# apt packages (libaio1t64 where the release names it so, else libaio1; and libaio-dev).
# scripts/device_run.sh exports CPATH, LIBRARY_PATH and LD_LIBRARY_PATH to them when .whl/libaio
# exists: the builder's is_compatible() test link and the op's build both go through gcc, which
# reads the first two; the loaded op finds libaio.so.1 through the third. The library needs only
# glibc, so a build from an older release (Debian 12 here) runs on a newer one (Ubuntu 24.04).
set -euo pipefail
out=${1:-$(cd "$(dirname "$0")/.." && pwd)/.whl/libaio}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
apt-get download libaio1t64 libaio-dev >/dev/null 2>&1 || apt-get download libaio1 libaio-dev >/dev/null 2>&1
for deb in ./*.deb; do dpkg -x "$deb" root; done
lib=$(dirname "$(find root -name 'libaio.so.*' -type f | head -1)")
rm -rf "$out"
mkdir -p "$out/include" "$out/lib"
cp root/usr/include/libaio.h "$out/include/"
# Plain copies, not symlinks: the trip to the device machine may not keep links.
for f in "$lib"/libaio.so*; do cp -L "$f" "$out/lib/"; done
ls -la "$out/lib"
du -sh "$out"
