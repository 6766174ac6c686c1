#!/usr/bin/env bash
# Installs the Debian packages the tests need, by name, when a command is missing:
#   iptables   (ip6tables too): meshgate-wait's redirect check under mesh-style rules in a
#              private network namespace (crates/meshgate-wait/tests/redirect_netns.rs)
# Needs root (CI and these machines run as root); prints what it does on stderr.
set -euo pipefail
missing=()
command -v iptables >/dev/null 2>&1 || missing+=(iptables)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v setpriv >/dev/null 2>&1 || missing+=(util-linux)
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "tools/packages.sh: missing ${missing[*]} and not root: install them, or set MESHGATE_SKIP_NETNS=1" >&2
  exit 1
fi
echo "tools/packages.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >&2
apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
