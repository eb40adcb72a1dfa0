#!/bin/sh
# rxe-vm stage 2: runs in the guest as root, chrooted into the host's (read-only) root, under the
# host's /bin/sh, after stage 1 (scripts/rxe-vm-init.sh) mounted the file systems and brought
# dummy0 up at 192.0.2.1/24. scripts/rxe-vm copies it into the per-run control directory, which
# the guest sees at /run/rxe-vm/ctl (writable 9p share) next to:
#   config   sourced here: RXE_VM_CWD (directory COMMAND runs in), RXE_VM_OUT (host --out
#            directory, mounted at the same path; empty without --out), RXE_VM_NET_ADDR (eth0's
#            ADDR/LEN with --net, else empty)
#   cmd.sh   run with an empty environment: exports COMMAND's environment, then execs COMMAND
# It adds rxe0 on dummy0 (on eth0 at RXE_VM_NET_ADDR with --net), waits until rxe0 is ACTIVE with
# its IPv4 GID and listed by ibv_devices, raises the memlock limit and runs COMMAND with stdout+stderr on the virtio serial
# port "rxe-vm.out", which qemu writes to a host file that rxe-vm streams.
# Outcome, written to ctl/status and echoed on the console as "RXE_VM_STATUS <outcome>":
#   exit N             COMMAND ran and exited with status N
#   fail CODE WHY      setup failed (CODE 122: guest setup, 123: RDMA setup; see rxe-vm)
# Progress goes to the console (the guest console log on the host).

PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export PATH
ctl=/run/rxe-vm/ctl
p9=trans=virtio,version=9p2000.L,msize=512000

log() {
	read -r up _ </proc/uptime
	echo "rxe-vm-guest: [$up] $*"
}

status() {
	printf '%s\n' "$*" >"$ctl/status.tmp" && mv -f "$ctl/status.tmp" "$ctl/status"
	echo "RXE_VM_STATUS $*"
}

fail() {
	code=$1
	shift
	msg=$(printf '%s' "$*" | tr '\n' ' ')
	log "$msg"
	dmesg 2>/dev/null | tail -n 40
	status "fail $code $msg"
	exit 1
}

log "stage 2 started"

[ -r "$ctl/config" ] || fail 122 "$ctl/config missing"
RXE_VM_CWD=
RXE_VM_OUT=
RXE_VM_NET_ADDR=
# shellcheck source=/dev/null
. "$ctl/config"

if [ -n "$RXE_VM_OUT" ]; then
	# Exists already if visible in the host root; created in a tmpfs if under /tmp or /run.
	mkdir -p "$RXE_VM_OUT" 2>/dev/null
	mount -t 9p -o "$p9" rxevmout "$RXE_VM_OUT" ||
		fail 122 "cannot mount the --out share (9p tag rxevmout) on $RXE_VM_OUT"
fi

port=
for d in /sys/class/virtio-ports/*; do
	if [ "$(cat "$d/name" 2>/dev/null)" = rxe-vm.out ]; then
		port=/dev/${d##*/}
	fi
done
if [ -z "$port" ] || [ ! -c "$port" ]; then
	fail 122 "virtio serial port rxe-vm.out not found"
fi

if [ -n "$RXE_VM_NET_ADDR" ]; then
	# --net: rxe0 on the virtio NIC (virtio_net comes with the extra modules), a real wire.
	netdev=eth0
	addr=${RXE_VM_NET_ADDR%/*}
	[ -e /sys/class/net/eth0 ] || fail 123 "no eth0 (virtio_net not loaded?)"
	out=$(ip addr add "$RXE_VM_NET_ADDR" dev eth0 2>&1) || fail 123 "cannot add $RXE_VM_NET_ADDR to eth0: $out"
	out=$(ip link set eth0 up 2>&1) || fail 123 "cannot bring eth0 up: $out"
else
	# Both ends of a connection use 192.0.2.1 and rxe's internal loopback path.
	netdev=dummy0
	addr=192.0.2.1
fi
out=$(rdma link add rxe0 type rxe netdev $netdev 2>&1) ||
	fail 123 "'rdma link add rxe0 type rxe netdev $netdev' failed: $out"

# GIDs are filled in asynchronously: wait for the port and for the IPv4 GID of $addr
# (...:ffff:c000:0201 for 192.0.2.1).
# shellcheck disable=SC2086 # split the dotted quad
gid_tail=$(IFS=.; set -f; set -- $addr; printf ':ffff:%02x%02x:%02x%02x' "$1" "$2" "$3" "$4")
port_dir=/sys/class/infiniband/rxe0/ports/1
i=0
while :; do
	state=$(cat "$port_dir/state" 2>/dev/null)
	case $state in
	*ACTIVE*)
		if cat "$port_dir"/gids/[0-9] 2>/dev/null | grep -q "$gid_tail\$"; then
			break
		fi
		;;
	esac
	i=$((i + 1))
	[ "$i" -lt 200 ] || fail 123 "rxe0 not ready after 20 s (port state: ${state:-none}, no GID for $addr)"
	sleep 0.1
done
log "rxe0 active with its GID"
devs=$(ibv_devices 2>&1)
printf '%s\n' "$devs" | grep -qw rxe0 || fail 123 "ibv_devices does not list rxe0: $devs"
# shellcheck disable=SC3045 # dash, the host's /bin/sh, has ulimit -l
ulimit -l unlimited || fail 123 "ulimit -l unlimited failed"
log "rxe0 ready on $netdev ($addr)"
# The kernel booted quietly; from now on its messages up to info level reach the console log.
echo 7 >/proc/sys/kernel/printk

cd "$RXE_VM_CWD" || fail 122 "cannot cd to $RXE_VM_CWD in the guest"
: >"$ctl/started"
log "running the command"
env -i /bin/sh "$ctl/cmd.sh" </dev/null >"$port" 2>&1
rc=$?
log "the command exited with status $rc"
status "exit $rc"
