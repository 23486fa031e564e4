#!/usr/bin/env bash
# The Kubernetes manifests of deploy/kubernetes: every kustomize tree builds (a small renderer,
# tests/kubernetes/render.py; no kustomize binary needed, compared with `kubectl kustomize`
# where there is a kubectl), the core objects pass the Kubernetes OpenAPI schemas in strict
# mode, the custom resources pass our transcriptions of their CRDs (tests/kubernetes/schemas),
# and the invariants between the objects hold (tests/kubernetes/check.py says which).
# Needs python3 with pip and, the first time, PyPI (tests/kubernetes/requirements.txt goes into
# target/kubernetes-venv).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=target/kubernetes-venv
requirements=tests/kubernetes/requirements.txt
if [ ! -x "$venv/bin/python" ]; then
  mkdir -p target
  # Debian's python3 makes venvs with pip only with python3-venv installed; without it, an
  # empty venv that the system's pip installs into (pip >= 22.3: --python).
  if ! python3 -m venv "$venv" >/dev/null 2>&1; then
    rm -rf "$venv"
    python3 -m venv --without-pip "$venv"
  fi
fi
if ! cmp -s "$requirements" "$venv/requirements.txt"; then
  if [ -x "$venv/bin/pip" ]; then
    pip=("$venv/bin/python" -m pip)
  else
    pip=(python3 -m pip --python "$venv/bin/python")
  fi
  "${pip[@]}" install --quiet --disable-pip-version-check -r "$requirements"
  cp "$requirements" "$venv/requirements.txt"
fi
# -B: no __pycache__ left in tests/kubernetes
"$venv/bin/python" -B tests/kubernetes/check.py "$@"
