#!/usr/bin/env bash
# Install what the controller, its lab and its tests need on a Debian 12 machine, idempotently:
# Debian packages (podman and debootstrap for the systemd target, a compiler for the CPU engine, npm for
# the Claude Code client of the tests, Chromium for the certify report's PDF and its browser test),
# then a virtual environment in .venv with the locked dependencies and the project installed.
set -euo pipefail
cd "$(dirname "$0")/.."

# strace: the GPU check (lab/gpu_check) traces the server's system calls, in CI on the CPU engine.
packages=(podman crun debootstrap uidmap cmake ninja-build g++ make curl openssh-client ca-certificates systemd strace)
missing=()
for package in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing+=("$package")
done
# npm installs the pinned Claude Code client the tests run; a Node that brings its own npm is kept as it is.
command -v npm >/dev/null || missing+=(npm)
# Chromium renders the certify report to PDF and opens its HTML page in the tests; any Chromium on PATH will do.
command -v chromium >/dev/null || command -v chromium-browser >/dev/null || missing+=(chromium)
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then sudo=sudo; else sudo=; fi
  echo "bootstrap: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

python=${PYTHON:-python3}
if ! "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "bootstrap: requirements.lock is resolved for Python 3.11 (Debian 12's python3): set PYTHON=python3.11" >&2
  exit 2
fi
if [[ ! -x .venv/bin/python ]]; then
  if ! "$python" -m venv .venv 2>/dev/null; then
    DEBIAN_FRONTEND=noninteractive ${sudo:-} apt-get install -y -qq python3-venv >/dev/null
    "$python" -m venv .venv
  fi
fi
# Every Python package comes from the hash-pinned locks (scripts/lock.sh refreshes them): pip first, then the
# locked set with its build backend, then this project alone, so nothing unpinned is ever resolved.
# --no-compile, then compileall without the `ansible` package's collections: byte-compiling all ~20 000 files of
# the locked set was two thirds of the install's time, and ~15 000 of them are collections, whose plugins Ansible
# compiles from source whenever it loads them (its collection loader keeps no bytecode). The rest is compiled here
# and not left to the first import: where PYTHONDONTWRITEBYTECODE is set (the shells of this lab set it), no import writes
# bytecode, and every process would compile its imports again (`controller --help`: 0.97 CPU-s against 0.53).
stamp=.venv/.installed-$(cat requirements-pip.lock requirements.lock pyproject.toml | sha256sum | cut -c1-16)
if [[ ! -e $stamp ]]; then
  .venv/bin/python -m pip install -q --require-hashes -r requirements-pip.lock
  .venv/bin/python -m pip install -q --no-compile --require-hashes -r requirements.lock
  # A file that does not compile (a package's test data) is left to Python, as pip's own compile step leaves it.
  .venv/bin/python -m compileall -q -j 0 -x '/ansible_collections/' \
    "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
  .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
  rm -f .venv/.installed-* && touch "$stamp"
fi
# The project's own code, for the same reason (compileall skips what is already up to date; a file with a syntax
# error is named, and bootstrap goes on: its import fails as it would anyway).
.venv/bin/python -m compileall -q -j 0 controller lab ansible_collections/v100box/llm/plugins || true
echo "bootstrap: ready (.venv/bin/controller, .venv/bin/pytest)"
