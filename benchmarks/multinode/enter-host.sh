#!/bin/sh
# Run a command on a simulated host of benchmarks/multinode/cluster.py, the way ssh runs one on a
# real host: enter-host.sh [-x ...] HOST COMMAND...  The command words are joined and run by sh,
# as ssh does, inside HOST's network namespace with its own hostname (UTS namespace) and its own
# /dev/shm and /etc/hosts (mount namespace). mpiexec uses it as its ssh (-launcher-exec), so
# Hydra starts its proxies on the simulated hosts; SimCluster.spawn uses it for everything else.
# Needs SIM_NAMESPACES ("host=namespace ..."), SIM_HOSTS_FILE, and root.
set -e
while [ $# -gt 0 ]; do
    case "$1" in -*) shift ;; *) break ;; esac  # ssh options (Hydra passes -x): not needed here
done
host=$1
shift
ns=
for pair in $SIM_NAMESPACES; do
    [ "${pair%%=*}" = "$host" ] && ns=${pair#*=}
done
if [ -z "$ns" ]; then
    echo "enter-host.sh: no simulated host named '$host' (known: $SIM_NAMESPACES)" >&2
    exit 255
fi
export SIM_HOSTNAME="$host"
exec ip netns exec "$ns" unshare --uts --mount --propagation private sh -c '
    hostname "$SIM_HOSTNAME" && mount -t tmpfs -o size=2g tmpfs /dev/shm &&
    mount --bind "$SIM_HOSTS_FILE" /etc/hosts && exec sh -c "$*"' sh "$*"
