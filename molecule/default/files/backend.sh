#!/bin/sh
# A backend "pod" on this node for the verify step: network namespace NS with address
# IP/32 on its eth0 (Calico style: default route via 169.254.1.1, the node's end of the
# veth answers ARP for it), and an HTTP server on IP:8080 that answers "hello from NS on
# HOST". Idempotent: does nothing when NS exists. Usage: backend.sh NS IP HOST
set -eu
ns=$1 ip=$2 host=$3
veth="kn-$(printf %s "$ns" | cut -c1-8)"
www="/run/$ns-www"
[ -e "/run/netns/$ns" ] && exit 0
ip netns add "$ns"
ip link add "$veth" type veth peer name eth0 netns "$ns"
ip -n "$ns" link set lo up
ip -n "$ns" link set eth0 up
ip -n "$ns" addr add "$ip/32" dev eth0
ip -n "$ns" route add default via 169.254.1.1 dev eth0 onlink
sysctl -q -w "net.ipv4.conf.$veth.proxy_arp=1"
ip link set "$veth" up
ip route add "$ip/32" dev "$veth"
mkdir -p "$www"
echo "hello from $ns on $host" > "$www/index.html"
systemd-run --quiet --unit "$ns-http" -- \
  ip netns exec "$ns" python3 -m http.server 8080 --bind "$ip" --directory "$www"
echo "created $ns"
