#!/usr/bin/env bash
# Idempotent set-up for a fresh machine of this kind (root, Debian, no GPU).
# Installs only what is missing; each step says what it does or why it is skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV="$ROOT/.venv"
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
STAMP="$VENV/.trainguard-setup"

say() { printf '[setup] %s\n' "$*"; }

apt_updated=0
apt_install() {
  local missing=()
  for pkg in "$@"; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" != 0 ]; then
    say "not root: skipping Debian packages ${missing[*]} (eBPF/promtool/etcd tests will report why they cannot run)"
    return 0
  fi
  if [ $apt_updated = 0 ]; then
    say "apt-get update"
    apt-get update -q >/dev/null
    apt_updated=1
  fi
  say "apt-get install ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
}

system_packages() {
  command -v apt-get >/dev/null 2>&1 || { say "no apt-get: skipping Debian packages"; return 0; }
  apt_install python3-bpfcc prometheus prometheus-alertmanager etcd-server procps iproute2 util-linux systemd-container
  # tests/slurm runs a real two-node Slurm cluster (slurmctld, slurmd, munged in the foreground)
  apt_install slurm-wlm munge
  # bcc compiles tracepoint programs against kernel headers; the running kernel ships none,
  # and Debian's 6.1 headers serve tracepoint programs.
  local build="/lib/modules/$(uname -r)/build"
  if [ ! -e "$build/include" ] && [ "$(id -u)" = 0 ]; then
    local hdr
    hdr=$(ls -d /usr/src/linux-headers-6.1.*-amd64 2>/dev/null | grep -v -e cloud -e rt | sort -V | tail -n1 || true)
    if [ -z "$hdr" ]; then
      [ $apt_updated = 0 ] && { apt-get update -q >/dev/null; apt_updated=1; }
      local pkg
      pkg=$(apt-cache search --names-only '^linux-headers-6\.1\.[0-9.-]+-amd64$' | awk '{print $1}' | sort -V | tail -n1)
      if [ -n "$pkg" ]; then
        say "apt-get install $pkg (kernel headers for bcc)"
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$pkg" >/dev/null
        hdr=$(ls -d /usr/src/linux-headers-6.1.*-amd64 2>/dev/null | grep -v -e cloud -e rt | sort -V | tail -n1 || true)
      fi
    fi
    if [ -n "$hdr" ]; then
      mkdir -p "/lib/modules/$(uname -r)"
      ln -sfn "$hdr" "$build"
      say "linked $build -> $hdr"
    else
      say "no kernel headers found: eBPF collectors will be off"
    fi
  fi
  # bcc also includes from the arch-independent half of the headers (…-common) through `source`.
  local source="/lib/modules/$(uname -r)/source"
  if [ -e "$build/include" ] && [ ! -e "$source/include" ] && [ "$(id -u)" = 0 ]; then
    local common
    common="$(readlink -f "$build" | sed 's/-amd64$/-common/')"
    if [ -d "$common" ]; then
      ln -sfn "$common" "$source"
      say "linked $source -> $common"
    fi
  fi
  # Tracepoint formats are read from tracefs; mount it where the kernel offers it and nobody did.
  if [ "$(id -u)" = 0 ] && [ -d /sys/kernel/tracing ] && [ ! -e /sys/kernel/tracing/events ]; then
    mount -t tracefs tracefs /sys/kernel/tracing 2>/dev/null && say "mounted tracefs at /sys/kernel/tracing" || true
  fi
}

python_env() {
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV"
    "$PY" -m venv "$VENV"
  fi
  local want
  want=$(cat pyproject.toml setup.py scripts/setup.sh | sha256sum | cut -c1-16)
  if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    return 0
  fi
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  if ! "$VENV/bin/python" -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    say "pip install torch==2.13.0 (local CPU wheel)"
    "$VENV/bin/python" -m pip install -q torch==2.13.0
  fi
  say "pip install -e .[dev]"
  "$VENV/bin/python" -m pip install -q -e ".[dev]"
  echo "$want" > "$STAMP"
}

bcc_link() {
  # bcc is pure Python over libbcc.so; expose only the Debian package's bcc dir to the venv.
  local site
  site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  if [ -d /usr/lib/python3/dist-packages/bcc ]; then
    mkdir -p "$VENV/bcc-link"
    ln -sfn /usr/lib/python3/dist-packages/bcc "$VENV/bcc-link/bcc"
    echo "$VENV/bcc-link" > "$site/trainguard-bcc.pth"
  fi
}

system_packages
python_env
bcc_link
say "ready"
