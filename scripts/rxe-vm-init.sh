#!/bin/sh
# rxe-vm stage 1: /init of the initramfs that scripts/rxe-initrd.py builds (runs under busybox sh).
#
# Loads the modules listed in /lib/modules/load-order (and those in extra-order if the kernel
# command line has rxe_vm.extra_modules), mounts the host's root (9p, tag hostroot,
# read-only) on /host, a tmpfs on /host/run and the per-run control share (9p, tag rxevmctl) on
# /host/run/rxe-vm/ctl, then runs stage 2 (ctl/guest.sh, a copy of scripts/rxe-vm-guest.sh)
# chrooted into the host's root with the host's /bin/sh, and powers the VM off.
#
# A failure here is reported on the console as "RXE_VM_STATUS fail 122 <why>", which rxe-vm
# looks for when the control share holds no status file.
# This file is baked into the cached initramfs: rxe-vm rebuilds the cache when it changes.

PATH=/bin
export PATH
p9=trans=virtio,version=9p2000.L,msize=512000

log() {
	read -r up _ </proc/uptime
	echo "rxe-vm-init: [$up] $*"
}

fail() {
	log "$*"
	dmesg | tail -n 40
	echo "RXE_VM_STATUS fail 122 $*"
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
mount -t 9p -o "$p9,ro,cache=loose" hostroot /host || fail "cannot mount the host root (9p tag hostroot)"
mount -t tmpfs -o mode=0755 run /host/run || fail "cannot mount a tmpfs on /run"
mkdir -p /host/run/rxe-vm/ctl
mount -t 9p -o "$p9" rxevmctl /host/run/rxe-vm/ctl ||
	fail "cannot mount the control share (9p tag rxevmctl)"
[ -r /host/run/rxe-vm/ctl/guest.sh ] || fail "stage 2 script missing from the control share"
log "shares mounted"

chroot /host /bin/sh /run/rxe-vm/ctl/guest.sh
log "stage 2 exited with status $?"
poweroff -f
