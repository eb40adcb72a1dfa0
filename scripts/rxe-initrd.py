#!/usr/bin/env python3
"""Build the initramfs that scripts/rxe-vm boots.

The initramfs holds a static busybox, the stage-1 init script (scripts/rxe-vm-init.sh) and the
kernel modules the soft-RoCE VM needs (virtio, 9p, rdma_rxe + RDMA CM, dummy, ...) together with
everything they depend on, resolved from modules.dep and listed in load order in
/lib/modules/load-order. Modules compressed with xz (Debian 6.12) are stored decompressed
because busybox insmod cannot read them.

Modules in OPTIONAL (and their dependencies not loaded already) are listed in
/lib/modules/extra-order instead: stage 1 loads them only when asked (rxe-vm --extra-modules).

The archive (newc cpio, gzip) is deterministic: same inputs, same bytes.

With --bzimage/--vmlinux it also extracts the uncompressed kernel (ELF) from the bzImage when
that kernel supports PVH entry: qemu then boots it directly, which skips the kernel's own
decompression (xz on Debian 6.1, zstd on 6.12), the slowest part of a boot under TCG (about 4 s).

Usage: rxe-initrd.py --modules DIR --init FILE --busybox FILE --output FILE
                     [--bzimage FILE --vmlinux FILE]
  DIR is a kernel's lib/modules/KVER directory on which depmod has been run.
"""

import argparse
import gzip
import lzma
import os
import shutil
import subprocess
import sys
import zlib

# Modules the VM cannot work without, by module name ('-' and '_' are equivalent).
REQUIRED = [
    "virtio_pci",  # virtio transport for the 9p shares and the output port
    "virtio_console",  # virtio serial port carrying COMMAND's output to the host
    "9pnet_virtio",
    "9p",
    "ib_uverbs",
    "rdma_rxe",
    "rdma_ucm",  # RDMA CM from user space (rdma_cm, iw_cm, ib_cm, configfs come as dependencies)
    "dummy",  # rxe cannot be bound to lo: it sits on dummy0
    "overlay",  # the guest's /tmp: the host's /tmp (read-only) under a writable tmpfs
]
# Loaded with the required ones when the kernel has them as modules.
IF_PRESENT = [
    # rxe up to Linux 6.14 looks up "crc32" in the crypto API: without it `rdma link add` fails.
    # Later rxe calls the crc32 library directly and the module is gone (crc32-cryptoapi).
    "crc32_generic",
]
# Shipped when the kernel has them, loaded only on request: useful for some tests, not needed
# to boot (loading them costs about 0.5 s under TCG).
OPTIONAL = [
    "virtio_net",  # for multi-VM setups over a QEMU socket netdev
    "veth",
    "sch_netem",
]
BUSYBOX_APPLETS = [
    "sh", "mount", "mkdir", "insmod", "chroot", "poweroff", "cat", "echo", "dmesg",
    "tail", "sleep", "hostname", "ls", "ip",
]


def norm(name):
    return name.replace("-", "_")


def module_name(path):
    base = os.path.basename(path)
    return norm(base[: base.index(".ko")])


def read_modules_dep(mdir):
    deps = {}
    with open(os.path.join(mdir, "modules.dep"), encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            mod, rest = line.split(":", 1)
            deps[mod] = rest.split()
    return deps


def read_builtin(mdir):
    names = set()
    path = os.path.join(mdir, "modules.builtin")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    names.add(module_name(line.strip()))
    return names


def load_orders(mdir):
    """(required, extra): module paths in load order, dependencies first."""
    deps = read_modules_dep(mdir)
    by_name = {module_name(p): p for p in deps}
    builtin = read_builtin(mdir)
    seen = set()

    def visit(path, order):
        if path in seen:
            return
        seen.add(path)
        for dep in deps[path]:
            visit(dep, order)
        order.append(path)

    required, extra = [], []
    for name in REQUIRED:
        if name in by_name:
            visit(by_name[name], required)
        elif name not in builtin:
            sys.exit(f"rxe-initrd: module {name} is neither a module nor built into this kernel")
    for name in IF_PRESENT:
        if name in by_name:
            visit(by_name[name], required)
    for name in OPTIONAL:
        if name in by_name:
            visit(by_name[name], extra)
        elif name not in builtin:
            print(f"rxe-initrd: optional module {name} not available, skipped", file=sys.stderr)
    return required, extra


def elf_notes(data):
    """Yield (name, type, desc) of the notes in an ELF64 little-endian image's PT_NOTE segments."""
    phoff = int.from_bytes(data[0x20:0x28], "little")
    phentsize = int.from_bytes(data[0x36:0x38], "little")
    phnum = int.from_bytes(data[0x38:0x3A], "little")
    for i in range(phnum):
        ph = phoff + i * phentsize
        if int.from_bytes(data[ph : ph + 4], "little") != 4:  # PT_NOTE
            continue
        off = int.from_bytes(data[ph + 8 : ph + 16], "little")
        end = off + int.from_bytes(data[ph + 32 : ph + 40], "little")
        while off + 12 <= end:
            namesz, descsz, ntype = (int.from_bytes(data[off + k : off + k + 4], "little") for k in (0, 4, 8))
            name = data[off + 12 : off + 12 + namesz].rstrip(b"\0")
            desc_off = off + 12 + (namesz + 3) // 4 * 4
            yield name, ntype, data[desc_off : desc_off + descsz]
            off = desc_off + (descsz + 3) // 4 * 4


def extract_pvh_vmlinux(bzimage):
    """The uncompressed ELF kernel inside bzimage if it has a PVH entry point, else None."""
    with open(bzimage, "rb") as f:
        data = f.read()
    for magic, decompress in [
        (b"\xfd7zXZ\x00", lambda b: lzma.LZMADecompressor().decompress(b)),
        (b"\x1f\x8b\x08", gzip_decompress_prefix),
        (b"\x28\xb5\x2f\xfd", zstd_decompress_prefix),  # Debian 6.12
    ]:
        start = data.find(magic)
        while start >= 0:
            try:
                elf = decompress(data[start:])
            except (lzma.LZMAError, OSError, EOFError, zlib.error):
                elf = b""
            if elf[:4] == b"\x7fELF":
                xen_phys32_entry = 18
                if any(n == b"Xen" and t == xen_phys32_entry for n, t, _ in elf_notes(elf)):
                    return elf
                return None
            start = data.find(magic, start + 1)
    return None


def gzip_decompress_prefix(b):
    return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(b)


def zstd_decompress_prefix(b):
    """Decompress the zstd frame at the start of b with the zstd tool (not in Python's stdlib).

    zstd complains about the bytes that follow the frame but has written the frame by then."""
    if shutil.which("zstd") is None:
        return b""
    return subprocess.run(["zstd", "-dcq"], input=b, capture_output=True, check=False).stdout


def is_static_elf(path):
    """True if the ELF file at path has no PT_INTERP program header (statically linked)."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:  # 64-bit little endian only
        return False
    phoff = int.from_bytes(data[0x20:0x28], "little")
    phentsize = int.from_bytes(data[0x36:0x38], "little")
    phnum = int.from_bytes(data[0x38:0x3A], "little")
    for i in range(phnum):
        off = phoff + i * phentsize
        if int.from_bytes(data[off : off + 4], "little") == 3:  # PT_INTERP
            return False
    return True


class Cpio:
    """Minimal writer of the newc cpio format the kernel unpacks into its rootfs."""

    def __init__(self):
        self.parts = []
        self.ino = 1

    def _entry(self, name, mode, data=b"", rdev=(0, 0)):
        namez = name.encode() + b"\0"
        fields = [self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(namez), 0]
        self.ino += 1
        hdr = b"070701" + b"".join(b"%08X" % v for v in fields)
        self.parts.append(hdr + namez + b"\0" * (-(len(hdr) + len(namez)) % 4))
        self.parts.append(data + b"\0" * (-len(data) % 4))

    def dir(self, name):
        self._entry(name, 0o040755)

    def file(self, name, data, mode=0o644):
        self._entry(name, 0o100000 | mode, data)

    def symlink(self, name, target):
        self._entry(name, 0o120777, target.encode())

    def chardev(self, name, major, minor, mode=0o600):
        self._entry(name, 0o020000 | mode, rdev=(major, minor))

    def finish(self):
        self._entry("TRAILER!!!", 0)
        return b"".join(self.parts)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--modules", required=True, help="the kernel's lib/modules/KVER directory")
    ap.add_argument("--init", required=True, help="stage-1 init script")
    ap.add_argument("--busybox", required=True, help="a statically linked busybox")
    ap.add_argument("--output", required=True, help="initramfs to write (gzip-compressed cpio)")
    ap.add_argument("--bzimage", help="the kernel (bzImage) to extract a PVH-bootable ELF from")
    ap.add_argument("--vmlinux", help="where to write that ELF (not written if it cannot boot PVH)")
    args = ap.parse_args()

    if args.bzimage and args.vmlinux:
        elf = extract_pvh_vmlinux(args.bzimage)
        if elf is None:
            print("rxe-initrd: no PVH-bootable kernel inside the bzImage; qemu will boot the bzImage", file=sys.stderr)
        else:
            with open(args.vmlinux + ".tmp", "wb") as f:
                f.write(elf)
            os.replace(args.vmlinux + ".tmp", args.vmlinux)

    if not is_static_elf(args.busybox):
        sys.exit(f"rxe-initrd: {args.busybox} is not a static x86-64 ELF (install busybox-static)")

    cpio = Cpio()
    for d in ["bin", "dev", "proc", "sys", "host", "lib", "lib/modules"]:
        cpio.dir(d)
    cpio.chardev("dev/console", 5, 1)
    with open(args.busybox, "rb") as f:
        cpio.file("bin/busybox", f.read(), 0o755)
    for applet in BUSYBOX_APPLETS:
        cpio.symlink(f"bin/{applet}", "busybox")
    with open(args.init, "rb") as f:
        cpio.file("init", f.read(), 0o755)

    required, extra = load_orders(args.modules)
    names = []
    for i, rel in enumerate(required + extra):
        with open(os.path.join(args.modules, rel), "rb") as f:
            data = f.read()
        if rel.endswith(".xz"):
            data = lzma.decompress(data)
        elif not rel.endswith(".ko"):
            sys.exit(f"rxe-initrd: unsupported module compression: {rel}")
        name = f"{i:02d}-{module_name(rel)}.ko"
        cpio.file(f"lib/modules/{name}", data)
        names.append(name)
    n = len(required)
    cpio.file("lib/modules/load-order", "".join(m + "\n" for m in names[:n]).encode())
    cpio.file("lib/modules/extra-order", "".join(m + "\n" for m in names[n:]).encode())

    tmp = args.output + ".tmp"
    with open(tmp, "wb") as f:
        f.write(gzip.compress(cpio.finish(), compresslevel=6, mtime=0))
    os.replace(tmp, args.output)
    print(" ".join(m[3:-3] for m in names[:n]) + " | extra: " + " ".join(m[3:-3] for m in names[n:]))


if __name__ == "__main__":
    main()
