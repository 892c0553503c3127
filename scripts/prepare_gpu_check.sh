#!/usr/bin/env bash
# Prepare what benchmarks/gpu_check.sh carries to a GPU machine that has no network:
#   wheels/gpu   kvikio-cu13, libkvikio-cu13, rapids-logger (Python 3.12, manylinux x86_64)
#   wheels/deps  gdskv dependencies that machine's image lacks (crc32c, liburing)
#   tools/fio/fio  (with --with-fio) a static fio 3.33 built from Debian's source package,
#                so the check can compare against fio where the machine has none
# Neither is committed (wheels/ is in .gitignore; add /tools/ to .git/info/exclude).
# Then: device run(command="bash benchmarks/gpu_check.sh", carry=["wheels", "tools"]).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp)
for n in 17 24 27 28 31 34 35; do PLAT+=(--platform "manylinux_2_${n}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
# The image already has torch, cupy-cuda13x, numpy, cuda-pathfinder and nvidia-cufile: do
# not carry those (two versions of a package break the install there).
$PY -m pip download -q --no-deps "${PLAT[@]}" -d wheels/gpu kvikio-cu13 libkvikio-cu13 rapids-logger
$PY -m pip download -q --no-deps "${PLAT[@]}" -d wheels/deps 'crc32c>=2.4' liburing==2026.3.30
du -sh wheels/gpu wheels/deps

if [ "${1:-}" = "--with-fio" ]; then
    work=$(mktemp -d)
    apt-get install -y -q build-essential zlib1g-dev libaio-dev dpkg-dev > /dev/null
    (cd "$work" && apt-get source -q fio > /dev/null)  # needs a deb-src line for the release
    src=$(ls -d "$work"/fio-*/)
    (cd "$src" && ./configure --build-static --disable-native --disable-numa --disable-rdma \
        --disable-rados --disable-rbd --disable-http --disable-gfapi --disable-libnfs \
        --disable-pmem --disable-xnvme --disable-libzbc --disable-tcmalloc --disable-dfs > /dev/null \
        && make -j"$(nproc)" > /dev/null)
    mkdir -p tools/fio
    strip -o tools/fio/fio "$src/fio"
    grep -qx '/tools/' .git/info/exclude 2> /dev/null || echo '/tools/' >> .git/info/exclude
    tools/fio/fio --version
    rm -rf "$work"
fi
