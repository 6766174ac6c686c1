#!/usr/bin/env bash
# Installs the Debian packages a real node of the local cluster needs, by name, when missing:
#   containerd                   the CRI runtime the kubelet talks to (Debian 12: 1.6.x; the
#                                kubelet falls back to its own cgroupDriver, containerd 1.6 has no
#                                RuntimeConfig RPC)
#   runc                         the OCI runtime containerd's shim runs containers with
#   containernetworking-plugins  the CNI plugins (bridge, host-local, loopback, portmap, ...), in
#                                /usr/lib/cni
#   iptables                     the kubelet's canary chains, kube-proxy's iptables mode, and the
#                                bridge plugin's ipMasq / portmap rules
#   ipset                        ipset, for the tests' teardown: Istio's ambient node agent creates
#                                IP sets in the host's network namespace (over netlink; it needs no
#                                tool), which only the tool deletes again
#   nftables                     nft, for the tests' teardown: iptables-nft creates the ip/ip6
#                                filter, nat and mangle tables when the node first writes a rule,
#                                and only nft can delete them again (without it a fresh host is
#                                left with empty tables it did not have, and the host check fails)
# Not needed by kubelet v1.36 or kube-proxy here, so not installed: conntrack (kube-proxy clears
# conntrack entries over netlink since v1.32), socat (port-forward runs in containerd's CRI
# streaming server), ethtool, ebtables. mount/umount/losetup come with util-linux and mount,
# which Debian always has.
#
#   tools/node/packages.sh        # installs what is missing; prints what it installs on stderr
#
# Needs root (CI and these machines run as root). Installing containerd starts no daemon on these
# machines (no systemd; /usr/sbin/policy-rc.d forbids service starts); on a host with systemd,
# Debian's unit starts one on /run/containerd/containerd.sock. The tests start their own
# containerd, with their own config, root, state and socket, and do not use that one.
set -euo pipefail

# package name, then how to tell it is there without dpkg (a binary from elsewhere counts).
wanted=(
  "containerd command:containerd"
  "runc command:runc"
  "containernetworking-plugins file:/usr/lib/cni/bridge"
  "iptables command:iptables"
  "nftables command:nft"
  "ipset command:ipset"
)

present() {
  local pkg=$1 probe=$2
  [ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" = "install ok installed" ] && return 0
  case $probe in
    command:*) command -v "${probe#command:}" >/dev/null 2>&1 ;;
    file:*) [ -x "${probe#file:}" ] ;;
    *) return 1 ;;
  esac
}

missing=()
for w in "${wanted[@]}"; do
  read -r pkg probe <<<"$w"
  present "$pkg" "$probe" || missing+=("$pkg")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "tools/node/packages.sh: missing Debian packages ${missing[*]} and not root: run as root, or install them" >&2
  exit 1
fi
echo "tools/node/packages.sh: installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >&2
apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
for pkg in "${missing[@]}"; do
  echo "tools/node/packages.sh: installed $pkg $(dpkg-query -W -f='${Version}' "$pkg")" >&2
done
