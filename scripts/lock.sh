#!/usr/bin/env bash
# Refresh the hash-pinned Python locks that scripts/bootstrap.sh installs (Python 3.11, Linux x86_64):
#   requirements.lock      the runtime, test and lint dependencies of pyproject.toml, plus its build backend
#   requirements-pip.lock  the pip the bootstrap installs before anything else
# Versions already in a lock are kept (a dependency added to pyproject.toml is resolved and pinned);
# `scripts/lock.sh --upgrade` moves every pin to the newest release pyproject.toml allows. Hashes are taken
# from the public Python package index only, whatever pip or uv configuration this machine has. Commit both files.
set -euo pipefail
cd "$(dirname "$0")/.."

uv_version=0.13.9
tool=$(mktemp -d)
trap 'rm -rf "$tool"' EXIT
python3 -m venv "$tool/venv"
env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL PIP_CONFIG_FILE=/dev/null \
  "$tool/venv/bin/pip" install -q --index-url https://pypi.org/simple "uv==$uv_version"

compile() {
  env -u UV_INDEX_URL -u UV_EXTRA_INDEX_URL -u UV_FIND_LINKS -u UV_INDEX -u UV_CONSTRAINT \
    "$tool/venv/bin/uv" pip compile --quiet --no-config --generate-hashes --python-version 3.11 \
    --python-platform x86_64-manylinux_2_28 --index-url https://pypi.org/simple \
    --custom-compile-command scripts/lock.sh "$@"
}

# The build backend is pinned too: the project is installed with --no-build-isolation from the locked set.
python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))' |
  compile pyproject.toml - --extra test --extra lint -o requirements.lock "$@"
echo pip | compile - -o requirements-pip.lock "$@"
echo "lock: wrote requirements.lock and requirements-pip.lock"
