#!/bin/sh
# rxe-vm stage 1: /init of the initramfs that scripts/rxe-initrd.py builds (runs under busybox sh).
#
# Loads the modules listed in /lib/modules/load-order (and those in extra-order if the kernel
# command line has rxe_vm.extra_modules); mounts the host's root (9p, tag hostroot, read-only)
# on /host, and below it: tmpfs on /run, /tmp and /dev/shm, proc, sysfs, devtmpfs, devpts, and
# the per-run control share (9p, tag rxevmctl) on /run/rxe-vm/ctl; brings lo up and dummy0 up
# at 192.0.2.1/24. Then it runs stage 2 (ctl/guest.sh, a copy of scripts/rxe-vm-guest.sh)
# chrooted into the host's root with the host's /bin/sh, and powers the VM off.
# All this uses busybox from the initramfs: running the host's tools over 9p costs more.
#
# A failure here is reported on the console as "RXE_VM_STATUS fail CODE <why>" (CODE 122: guest
# setup, 123: network setup), which rxe-vm looks for when the control share holds no status file.
# This file is baked into the cached initramfs: rxe-vm rebuilds the cache when it changes.

PATH=/bin
export PATH
p9=trans=virtio,version=9p2000.L,msize=512000

log() {
	read -r up _ </proc/uptime
	echo "rxe-vm-init: [$up] $*"
}

fail() {
	code=$1
	shift
	log "$*"
	dmesg | tail -n 40
	echo "RXE_VM_STATUS fail $code $*"
	poweroff -f
}

mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
hostname rxe-vm

load() {
	while read -r m; do
		insmod "/lib/modules/$m" || echo "rxe-vm-init: insmod $m failed"
	done <"/lib/modules/$1"
}
load load-order
case " $(cat /proc/cmdline) " in
*" rxe_vm.extra_modules "*) load extra-order ;;
esac
log "modules loaded"

# cache=loose: the guest keeps what it read from the host root in its page cache (halves the
# setup time). A file the host rewrites while a VM runs may look stale in that VM.
mount -t 9p -o "$p9,ro,cache=loose" hostroot /host || fail 122 "cannot mount the host root (9p tag hostroot)"
h=/host
mount -t tmpfs -o mode=0755 run $h/run || fail 122 "cannot mount a tmpfs on /run"
# /tmp: the host's /tmp stays visible (read-only lower layer, so a clone or build under /tmp
# works) under a fresh writable tmpfs (the upper layer); writes never reach the host.
mkdir -p /ovl
mount -t tmpfs -o mode=0755 ovl /ovl || fail 122 "cannot mount a tmpfs for /tmp"
mkdir -p /ovl/upper /ovl/work && chmod 1777 /ovl/upper
if ! mount -t overlay -o "lowerdir=$h/tmp,upperdir=/ovl/upper,workdir=/ovl/work" overlay $h/tmp; then
	log "overlay on /tmp failed; /tmp is a plain tmpfs (the host's /tmp is hidden)"
	mount -t tmpfs -o mode=1777 tmp $h/tmp || fail 122 "cannot mount a tmpfs on /tmp"
fi
mount -t proc proc $h/proc || fail 122 "cannot mount /proc"
mount -t sysfs sysfs $h/sys || fail 122 "cannot mount /sys"
mount -t devtmpfs devtmpfs $h/dev || fail 122 "cannot mount /dev"
mkdir -p $h/dev/pts $h/dev/shm $h/run/rxe-vm/ctl
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts $h/dev/pts || fail 122 "cannot mount /dev/pts"
mount -t tmpfs -o mode=1777 shm $h/dev/shm || fail 122 "cannot mount /dev/shm"
mount -t 9p -o "$p9" rxevmctl $h/run/rxe-vm/ctl ||
	fail 122 "cannot mount the control share (9p tag rxevmctl)"
[ -r $h/run/rxe-vm/ctl/guest.sh ] || fail 122 "stage 2 script missing from the control share"
log "file systems mounted"

# rxe cannot sit on lo: it goes on dummy0 (created by the dummy module), in stage 2.
ip link set lo up || fail 123 "cannot bring lo up"
[ -e /sys/class/net/dummy0 ] || ip link add dummy0 type dummy || fail 123 "cannot create dummy0"
ip addr add 192.0.2.1/24 dev dummy0 || fail 123 "cannot add 192.0.2.1/24 to dummy0"
ip link set dummy0 up || fail 123 "cannot bring dummy0 up"
log "dummy0 up at 192.0.2.1"

chroot /host /bin/sh /run/rxe-vm/ctl/guest.sh
log "stage 2 exited with status $?"
poweroff -f
