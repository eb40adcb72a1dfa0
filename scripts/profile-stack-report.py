#!/usr/bin/env python3
"""Report of scripts/profile-stack: per-request user-space instructions of the stack over
RdmaStream and over TcpStream, by crate, and the calls that show how the stream works.

Usage: profile-stack-report.py DIR N1 N2 SCENARIO
DIR holds cg.{rdma,tcp}.{N1,N2}.{bare,base}: callgrind files of examples/stack with N1 and N2
requests, without (bare) and with (base) the raw ping-pong baseline of N requests.
"""
import collections
import os
import re
import subprocess
import sys

# Functions whose calls per request are reported (a regex on the demangled name).
CALLS = [
    ("messages posted (ibv_post_send)", r"^ibv_post_send__extern$"),
    ("receives posted (ibv_post_recv)", r"^ibv_post_recv__extern$"),
    ("completions handled (ConnIo::on_completion)", r"Sink for tokio_rdma::conn::io::ConnIo>::on_completion$"),
    ("CQ polls (Shared::poll_cq)", r"^tokio_rdma::driver::shared::Shared::poll_cq$"),
    ("looks at the connection state (ConnIo::with)", r"^tokio_rdma::conn::io::ConnIo::with$"),
    ("state machine pumps (ConnIo::pump)", r"^tokio_rdma::conn::io::ConnIo::pump$"),
    ("poll_read on the stream", r"(RdmaStream|TcpStream) as tokio::io::async_read::AsyncRead>::poll_read$"),
    ("poll_write(_vectored) on the stream",
     r"(RdmaStream|TcpStream) as tokio::io::async_write::AsyncWrite>::poll_write(_vectored)?$"),
    ("clock reads (Timespec::now)", r"^<std::sys::pal::unix::time::Timespec>::now$"),
]


def exclusive(path):
    """{function: exclusive Ir} and the program total, from callgrind_annotate."""
    out = subprocess.run(
        ["callgrind_annotate", "--inclusive=no", "--threshold=100", "--auto=no", path],
        capture_output=True, text=True, check=True).stdout
    costs, total = collections.Counter(), 0
    for line in out.splitlines():
        m = re.match(r"^\s*([\d,]+)\s+(?:\([^)]*\)\s+)?(\S.*)$", line)
        if not m:
            continue
        ir = int(m.group(1).replace(",", ""))
        if "PROGRAM TOTALS" in m.group(2):
            total = ir
        else:
            costs[m.group(2)] += ir
    return costs, total


def calls(path):
    """{callee: number of calls}, from the file's call records (name compression resolved)."""
    names, count, callee = {}, collections.Counter(), None
    with open(path, errors="replace") as f:
        for line in f:
            if line.startswith(("fn=", "cfn=")):
                m = re.match(r"c?fn=\((\d+)\)(?: (.*))?", line.rstrip("\n"))
                if m:
                    if m.group(2):
                        names[m.group(1)] = m.group(2)
                    if line.startswith("cfn="):
                        callee = names.get(m.group(1), m.group(1))
            elif line.startswith("calls=") and callee is not None:
                count[callee] += int(line[6:].split()[0])
                callee = None
    return count


def crate(entry):
    """The crate an `file:function [object]` entry belongs to."""
    path, _, fn = entry.partition(":")
    fn = re.sub(r"\s*\[[^\]]*\]$", "", fn)
    m = re.match(r"^[<&\s]*(?:mut\s+|dyn\s+)?([A-Za-z_][A-Za-z0-9_]*)::", fn)
    if m and path != "???":
        name = m.group(1)
        return "std/core/alloc" if name in ("core", "alloc", "std") else name
    if "libibverbs" in entry or "librxe" in entry:
        return "libibverbs + rxe provider"
    if "malloc" in path:
        return "libc malloc/free"
    if "memmove" in path or "memcpy" in path or "memset" in path or "memcmp" in path:
        return "libc mem*"
    if "libc.so" in entry or "sysdeps" in path or "nptl" in path:
        return "libc other"
    return "other"


def per_request(d, net, n1, n2):
    a, ta = exclusive(os.path.join(d, f"cg.{net}.{n1}.bare"))
    b, tb = exclusive(os.path.join(d, f"cg.{net}.{n2}.bare"))
    groups = collections.Counter()
    for k in set(a) | set(b):
        groups[crate(k)] += (b.get(k, 0) - a.get(k, 0)) / (n2 - n1)
    ca = calls(os.path.join(d, f"cg.{net}.{n1}.bare"))
    cb = calls(os.path.join(d, f"cg.{net}.{n2}.bare"))
    per_call = {}
    for label, pat in CALLS:
        r = re.compile(pat)
        per_call[label] = sum(cb[k] - ca.get(k, 0) for k in cb if r.search(k)) / (n2 - n1)
    raw = None
    try:
        _, ra = exclusive(os.path.join(d, f"cg.{net}.{n1}.base"))
        _, rb = exclusive(os.path.join(d, f"cg.{net}.{n2}.base"))
        raw = ((rb - tb) - (ra - ta)) / (n2 - n1)
    except (OSError, subprocess.CalledProcessError):
        pass
    return (tb - ta) / (n2 - n1), groups, per_call, raw


def main():
    d, n1, n2, scenario = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    res = {}
    for net in ("rdma", "tcp"):
        try:
            res[net] = per_request(d, net, n1, n2)
        except (OSError, subprocess.CalledProcessError) as e:
            print(f"profile-stack: no {net} profile: {e}")
    if len(res) < 2:
        sys.exit(1)
    (rt, rg, rc, rraw), (tt, tg, tc, traw) = res["rdma"], res["tcp"]
    print(f"{scenario}, one request at a time, client and server in one process; "
          f"user-space instructions per request ({n2} - {n1} requests):")
    print(f"  over RdmaStream {rt:>10,.0f}")
    print(f"  over TcpStream  {tt:>10,.0f}   (+ the kernel's TCP work, not counted)")
    print(f"  the stream adds {rt - tt:>10,.0f} in user space")
    if rraw is not None and traw is not None:
        print(f"raw 64 B ping-pong per round trip (both ends): Connection {rraw:,.0f}, "
              f"TcpStream {traw:,.0f} (+ kernel)")
    print()
    print(f"{'by crate (exclusive)':<28} {'RDMA':>10} {'TCP':>10} {'RDMA - TCP':>11}")
    keys = sorted(set(rg) | set(tg), key=lambda k: -max(rg.get(k, 0), tg.get(k, 0)))
    for k in keys:
        r, t = rg.get(k, 0), tg.get(k, 0)
        if max(abs(r), abs(t)) >= 100:
            print(f"{k:<28} {r:>10,.0f} {t:>10,.0f} {r - t:>11,.0f}")
    print()
    print(f"{'calls per request':<46} {'RDMA':>7} {'TCP':>7}")
    for label, _ in CALLS:
        print(f"{label:<46} {rc[label]:>7.2f} {tc[label]:>7.2f}")


if __name__ == "__main__":
    main()
