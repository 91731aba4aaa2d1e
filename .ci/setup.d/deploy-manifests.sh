#!/usr/bin/env bash
# Validates deploy/ offline: renders every kustomization, checks each object
# strictly against the Kubernetes schemas (and the Prometheus Operator's for
# its objects), the grace-period arithmetic, the alert rules with promtool
# and their unit tests, then breaks the manifests on purpose to prove each
# check fails (deploy/validate.py --self-test).
set -euo pipefail
cd "$(dirname "$0")/../.."

log() { printf 'deploy-manifests: %s\n' "$*" >&2; }

venv=.venv-deploy
if [[ ! -x $venv/bin/python ]]; then
  log "creating $venv"
  python3 -m venv "$venv"
fi
stamp=$venv/.requirements.sha
want=$(sha256sum deploy/requirements.txt | cut -d' ' -f1)
if [[ ! -f $stamp || $(cat "$stamp") != "$want" ]]; then
  log "installing deploy/requirements.txt"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r deploy/requirements.txt
  echo "$want" > "$stamp"
fi

# promtool, from Debian's prometheus package, unpacked (not installed: no
# service is set up or started).
if [[ -z ${PROMTOOL:-} ]]; then
  if command -v promtool >/dev/null; then
    PROMTOOL=$(command -v promtool)
  else
    PROMTOOL=$PWD/$venv/prometheus/usr/bin/promtool
    if [[ ! -x $PROMTOOL ]]; then
      log "unpacking promtool from Debian's prometheus package"
      tmp=$(mktemp -d)
      if ! (cd "$tmp" && apt-get download prometheus >/dev/null 2>&1); then
        apt-get update -qq >/dev/null
        (cd "$tmp" && apt-get download prometheus >/dev/null 2>&1)
      fi
      dpkg-deb -x "$tmp"/prometheus_*.deb "$PWD/$venv/prometheus"
      rm -rf "$tmp"
    fi
  fi
fi
export PROMTOOL

"$venv/bin/python" deploy/validate.py --self-test
