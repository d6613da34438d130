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
)

gdkv_log() { printf '\n== %s\n' "$*" >&2; }

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

# The Python environment: a virtual environment outside the clone (so CI on this machine reuses
# it) with python/requirements.txt's exact versions, reinstalled only when that file changes, and
# the gdkv package built into it (incrementally, in build/python).
GDKV_VENV=${GDKV_VENV:-$HOME/.cache/gdkv/venv}
GDKV_PYTHON=$GDKV_VENV/bin/python
gdkv_python_env() {
  [ -x "$GDKV_PYTHON" ] || /usr/bin/python3 -m venv "$GDKV_VENV"
  local stamp=$GDKV_VENV/.gdkv-requirements want
  want=$(sha256sum python/requirements.txt | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    gdkv_log "installing python/requirements.txt into $GDKV_VENV (the first time takes minutes: torch)"
    "$GDKV_PYTHON" -m pip install -q --disable-pip-version-check -r python/requirements.txt
    echo "$want" >"$stamp"
  fi
  gdkv_log "building the gdkv Python package (build/python)"
  "$GDKV_PYTHON" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps \
    ./python >build/python-install.log 2>&1 || { cat build/python-install.log; return 1; }
}
