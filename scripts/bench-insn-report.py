#!/usr/bin/env python3
"""bench-insn-report: the tables of scripts/bench-insn, from its callgrind files.

Usage: scripts/bench-insn-report.py DIR [--top N] [--case CASE] [--check]

DIR holds runs.tsv (one line per run: case, tool, iterations, callgrind file, status) and the
callgrind output files that scripts/bench-insn wrote in the VM. Prints, per case, the user-space
instructions per operation of perftest and of tokio-rdma's perf example, their ratio, the
per-stage breakdown of ours and the top of our profile, and as its last line

    insn_summary: insn_ratio_max=X

(the worst ratio over the cases; n/a if none could be computed). --check exits non-zero unless
every case has both tools' numbers (scripts/bench-insn --smoke uses it).

Method: each tool runs twice per case, with N1 and N2 iterations; instructions per operation
are (Ir(N2) - Ir(N1)) / (N2 - N1), so that process start-up, connection setup and teardown
cancel. What grows with N but is not the data path is taken out of each run first:
  perftest: get_cpu_mhz()'s sampling loop (it spins ~0.2 s calling gettimeofday, so its count
    depends on the speed of the emulation: the inclusive cost of the executable's functions that
    call gettimeofday), and the latency report (the executable's functions that call qsort:
    their own instructions and their calls into libraries: qsort of the samples, pow per sample).
  tokio-rdma: the report after the loop (perf::report::*, the sort of the samples, the
    hdrhistogram of the percentiles) and what only it calls.
The excluded instructions are printed per run (column `excl`).
"""

import argparse
import collections
import os
import re
import sys

# ---------------------------------------------------------------------------------------------
# The callgrind format (valgrind's docs/callgrind-format): name compression "(id) name" /
# "(id)", position compression ("+n", "-n", "*"), "calls=" lines followed by the inclusive cost
# of the call.
# ---------------------------------------------------------------------------------------------


class Profile:
    """Self cost per function and inclusive cost per call arc of one callgrind file."""

    def __init__(self, path):
        self.path = path
        self.total = 0
        self.self_ir = collections.Counter()  # fn -> Ir
        self.arcs = collections.Counter()  # (caller, callee) -> inclusive Ir
        self.calls = collections.Counter()  # (caller, callee) -> number of calls
        self.cmd = ""
        self._parse()
        self.callers = collections.defaultdict(set)
        self.callees = collections.defaultdict(set)
        for a, b in self.arcs:
            self.callers[b].add(a)
            self.callees[a].add(b)

    def _parse(self):
        tables = {"ob": {}, "fl": {}, "fn": {}}
        kind = {"ob": "ob", "cob": "ob", "fl": "fl", "fi": "fl", "fe": "fl", "cfi": "fl",
                "cfl": "fl", "fn": "fn", "cfn": "fn"}
        npos = 1
        ir_col = 0
        ob = fn = cob = cfn = None
        pending = None  # (callee, count) after a calls= line
        summary = totals = None

        def name(k, v):
            m = re.match(r"\((\d+)\)(?: (.*))?$", v)
            if not m:
                return v
            table = tables[kind[k]]
            if m.group(2) is not None:
                table[m.group(1)] = m.group(2)
            return table.get(m.group(1), "?")

        with open(self.path, encoding="utf-8", errors="replace") as f:
            for line in f:
                line = line.rstrip("\n")
                if not line:
                    continue
                c = line[0]
                if c.isdigit() or c in "+-*":
                    parts = line.split()
                    vals = parts[npos:]
                    ir = int(vals[ir_col]) if len(vals) > ir_col else 0
                    if pending is not None:
                        callee, count = pending
                        self.arcs[(fn, callee)] += ir
                        self.calls[(fn, callee)] += count
                        pending = None
                        cob = None
                    else:
                        self.self_ir[fn] += ir
                    continue
                key, _, val = line.partition("=")
                if key in ("ob", "fl", "fi", "fe", "cob", "cfi", "cfl", "fn", "cfn"):
                    v = name(key, val)
                    if key == "ob":
                        ob = v
                    elif key == "fn":
                        fn = (v, ob)
                    elif key == "cob":
                        cob = v
                    elif key == "cfn":
                        cfn = v
                elif key == "calls":
                    count = int(val.split()[0])
                    pending = ((cfn, cob if cob is not None else ob), count)
                elif line.startswith("positions:"):
                    npos = len(line.split()[1:])
                elif line.startswith("events:"):
                    events = line.split()[1:]
                    ir_col = events.index("Ir")
                elif line.startswith("summary:"):
                    summary = int(line.split()[1])
                elif line.startswith("totals:"):
                    totals = int(line.split()[ir_col + 1])
                elif line.startswith("cmd:"):
                    self.cmd = line[4:].strip()
        self.total = totals if totals is not None else (summary or 0)

    def inclusive(self, f):
        """Own instructions plus those of its calls (calls to itself not counted twice)."""
        return self.self_ir[f] + sum(v for (a, b), v in self.arcs.items() if a == f and b != f)


def short(fnkey):
    fn, ob = fnkey
    return f"{fn} [{os.path.basename(ob or '?')}]"


# ---------------------------------------------------------------------------------------------
# What is not the data path.
# ---------------------------------------------------------------------------------------------


def perftest_exe(p):
    """The perftest executable's object name (the command's first word)."""
    word = os.path.basename(p.cmd.split()[0]) if p.cmd else ""
    for (_, ob) in p.self_ir:
        if ob and word and os.path.basename(ob) == word:
            return ob
    return None


# Ours: what is not the measured loop (the samples' sort and the percentiles after the loop).
OUR_REPORT = re.compile(r"^<?perf::report::|^<?core::slice::sort::|^<?hdrhistogram::")


def excluded_set(p, tool):
    """Functions that are not the measured loop (see the module docstring): the seeds, and
    every function called only from excluded functions (or from itself)."""
    fns = set(p.self_ir) | {b for (_, b) in p.arcs}
    if tool == "perftest":
        exe = perftest_exe(p)
        x = {a for (a, b) in p.arcs
             if a[1] == exe and ("gettimeofday" in b[0] or b[0] in ("qsort", "qsort_r"))}
    else:
        x = {f for f in fns if OUR_REPORT.search(f[0])}
    changed = True
    while changed:
        changed = False
        for f in fns - x:
            callers = p.callers.get(f, set()) - {f}
            if callers and callers <= x:
                x.add(f)
                changed = True
    return x


def excluded(p, tool):
    """Instructions of `p` outside the measured loop: own instructions of excluded_set."""
    x = excluded_set(p, tool)
    return sum(v for f, v in p.self_ir.items() if f in x)


# ---------------------------------------------------------------------------------------------
# Stages of ours: function name patterns, first match wins. Generic functions (core::, alloc::,
# std:: without a stage of their own) and functions without a name or in the verbs libraries
# (the rxe provider is stripped: rxe_poll_cq shows as 0x...2ca0) take the stage of the caller
# that spends the most in them. `leaf` stages also get an inclusive figure (calls into the
# stage from other stages); the others nest (the runtime polls everything) and get only their
# own instructions.
# ---------------------------------------------------------------------------------------------

STAGES = [
    # (name, pattern, leaf)
    ("memcpy", r"^(__)?mem(cpy|move|set)|^__(memcpy|memmove|memset)", True),
    ("clock", r"clock_gettime|gettimeofday|Instant>?::(now|elapsed|duration_since)|Timespec|"
     r"tokio::time::clock::", True),
    # glibc's pthread_spin_unlock shares its code with pthread_spin_init: callgrind names the
    # unlocks pthread_spin_init.
    ("locks", r"pthread_mutex|pthread_spin|parking_lot|lock_api|futex|std::sync::.*[Mm]utex|"
     r"::lock$|::try_lock$", True),
    ("wakers", r"[Ww]aker|::wake(_by_ref)?$|::wake_|Notif(y|ied)", True),
    ("alloc", r"^(malloc|free|calloc|realloc|cfree)\b|^_int_(malloc|free)|^__libc_(malloc|free)|"
     r"^__rust_(alloc|dealloc|realloc)|^__rdl_|alloc::alloc::|RawVec.*grow", True),
    ("CQ poll (ibv_poll_cq, provider)", r"ibv_poll_cq|poll_cq|verbs::cq::|req_notify", True),
    ("post (ibv_post_*, driver::post)", r"ibv_post_|post_send|post_recv|driver::post::|verbs::wr::",
     True),
    ("op table (proto::engine/table)", r"proto::(engine|table|qp|wr|msg)::", True),
    ("conn state machine (proto::conn)", r"proto::conn::", True),
    ("events (epoll, CQ events)", r"epoll|ibv_get_cq_event|ibv_ack_cq_events|mio::|"
     r"tokio::runtime::io::|tokio::io::|^__GI___poll|^(read|write)$", True),
    ("connection I/O (src/conn)", r"tokio_rdma::conn::", False),
    ("completion task (driver::shared, Deferred)", r"tokio_rdma::driver::(shared|completion)::|"
     r"tokio_rdma::driver::Driver::new::", False),
    ("driver other (raw ops, wait, qp)", r"tokio_rdma::driver::", False),
    ("ops futures (src/ops)", r"tokio_rdma::ops::", False),
    ("buffers (src/buf)", r"tokio_rdma::buf::", False),
    ("tokio runtime", r"^<?tokio::", False),
    ("benchmark loop (perf example)", r"^<?perf::", False),
    ("verbs other", r"tokio_rdma::verbs::|^ibv_", False),
    ("futures crate", r"^<?futures_(util|core)::", False),
]
STAGE_RE = [(n, re.compile(r)) for n, r, _ in STAGES]
LEAF = {n for n, _, leaf in STAGES if leaf}
GENERIC = re.compile(r"^<?(core|alloc|std)::|^0x[0-9a-f]+$")


def stage_of_name(fnkey):
    """The stage of a function by its name; None: decided by its callers."""
    fn, ob = fnkey
    for n, r in STAGE_RE:
        if r.search(fn):
            return n
    base = os.path.basename(ob or "")
    if GENERIC.search(fn) or "librxe" in base or "libibverbs" in base:
        return None
    return "other"


def stages(p, x):
    """Own instructions per stage (the report excluded; they sum to the total minus the
    report), and inclusive instructions of the leaf stages (calls into the stage from functions
    of other stages)."""
    st = {}
    for f in set(p.self_ir) | {b for (_, b) in p.arcs}:
        st[f] = "(excluded: report)" if f in x else stage_of_name(f)
    # Inherited stages: heaviest caller first; a few rounds for chains.
    for _ in range(8):
        changed = False
        for f, s in st.items():
            if s is not None:
                continue
            best = None
            for a in p.callers.get(f, ()):
                if st.get(a) is None or a == f:
                    continue
                v = p.arcs[(a, f)]
                if best is None or v > best[0]:
                    best = (v, st[a])
            if best:
                st[f] = best[1]
                changed = True
        if not changed:
            break
    for f, s in st.items():
        if s is None:
            st[f] = "other"
    own = collections.Counter()
    incl = collections.Counter()
    for f, v in p.self_ir.items():
        own[st[f]] += v
    for (a, b), v in p.arcs.items():
        if st[a] != st[b]:
            incl[st[b]] += v
    return own, incl


def by_object(p, x):
    """Own instructions per object (executable, provider, libibverbs, libc, ...), without the
    excluded functions `x`."""
    c = collections.Counter()
    for (fn, ob), v in p.self_ir.items():
        if (fn, ob) not in x:
            c[os.path.basename(ob or "?")] += v
    return c


def fn_inclusive(p):
    """Inclusive instructions of every function (self + calls, self-recursion counted once)."""
    inc = collections.Counter(p.self_ir)
    for (a, b), v in p.arcs.items():
        if a != b:
            inc[a] += v
    return inc


# ---------------------------------------------------------------------------------------------


def load_runs(d):
    runs = collections.defaultdict(dict)  # case -> tool -> {n: file}
    order = []
    path = os.path.join(d, "runs.tsv")
    with open(path, encoding="utf-8") as f:
        for line in f:
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 5 or parts[0] == "case":
                continue
            case, tool, n, file, status = parts[:5]
            if case not in order:
                order.append(case)
            if status != "ok":
                continue
            fp = file if os.path.isabs(file) else os.path.join(d, file)
            if os.path.exists(fp):
                runs[case].setdefault(tool, {})[int(n)] = fp
    return order, runs


def provider_calls(p):
    """Calls into the RDMA provider library (rxe: polls, posts, arming) from other objects."""
    prov = lambda ob: "librxe" in os.path.basename(ob or "")  # noqa: E731
    return sum(v for (a, b), v in p.calls.items() if prov(b[1]) and not prov(a[1]))


def per_op(profiles, tool):
    """(insns/op, provider calls/op, [(n, total, excluded)]) from {n: Profile}; None without
    two runs."""
    ns = sorted(profiles)
    if len(ns) < 2:
        return None, None, []
    rows = []
    for n in ns:
        p = profiles[n]
        rows.append((n, p.total, excluded(p, tool)))
    (n1, t1, x1), (n2, t2, x2) = rows[0], rows[-1]
    pc = (provider_calls(profiles[n2]) - provider_calls(profiles[n1])) / (n2 - n1)
    return ((t2 - x2) - (t1 - x1)) / (n2 - n1), pc, rows


def fmt_int(v):
    return "n/a" if v is None else f"{v:,.0f}"


def fmt_dec(v):
    return "n/a" if v is None else f"{v:.1f}"


def synthetic(path, tool, n, seed):
    """Writes a callgrind file of a made-up run of `tool` with `n` iterations: 1000 setup
    instructions, 50 per iteration in the loop (30 of them in the provider, 1 call each), a
    timing loop and a report whose costs are not the loop's; uses name and position
    compression like callgrind."""
    spin = 7000 + 977 * seed  # varies between runs, as get_cpu_mhz's sampling does
    if tool == "perftest":
        exe, main_, loop, samp, rep = ("/usr/bin/ib_send_lat", "0x0000000000005ae0",
                                       "0x0000000000023100", "0x0000000000028fc0",
                                       "0x0000000000016a60")
        tod, sort = "__gettimeofday_syscall", "qsort"
        libc = "/usr/lib/x86_64-linux-gnu/libc.so.6"
    else:
        exe, main_, loop, samp, rep = ("/x/perf", "perf::main", "perf::run::client_case::{{closure}}",
                                       "tokio_rdma::driver::post::post",
                                       "perf::report::Percentiles::of")
        tod, sort = "core::slice::sort::stable::driftsort_main", "hdrhistogram::Histogram<T>::record"
        libc = "/x/perf"
    prov = "/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so"
    loop_self, prov_cost = 20 * n, 30 * n
    lines = ["# callgrind format", "version: 1", "creator: callgrind-3.19.0", "pid: 1",
             f"cmd:  {os.path.basename(exe)} -n {n}", "part: 1", "", "positions: line",
             "events: Ir", ""]
    rep_cost = 3 * n * max(1, n.bit_length())
    # main: 1000 own, calls loop, samp (perftest: the sampling loop; ours: post, part of the loop)
    # and rep.
    lines += [f"ob=(1) {exe}", "fl=(1) ???", f"fn=(1) {main_}", "0 600", "+3 400",
              "cfn=(2) " + loop, "calls=1 0", f"* {loop_self + prov_cost}"]
    if tool == "perftest":
        lines += ["cfn=(3) " + samp, "calls=1 0", f"0 {spin}"]
    lines += ["cfn=(4) " + rep, "calls=1 0", f"0 {rep_cost}"]
    lines += ["", "fn=(2)", f"0 {loop_self}", f"cob=(2) {prov}", "cfi=(2) ???",
              "cfn=(5) 0x0000000000002ca0", f"calls={n} 0", f"0 {prov_cost}"]
    if tool == "perftest":
        lines += ["", "fn=(3)", f"0 {spin // 2}", f"cob=(3) {libc}", "cfi=(3) ???", f"cfn=(6) {tod}",
                  f"calls={spin // 10} 0", f"0 {spin - spin // 2}"]
        lines += ["", "ob=(3)", "fn=(6)", f"0 {spin - spin // 2}"]
    lines += ["", "ob=(1)", "fn=(4)", f"0 {rep_cost // 3}", "cob=(3)" if tool == "perftest" else "",
              f"cfn=(7) {sort}", "calls=1 0", f"0 {rep_cost - rep_cost // 3}"]
    lines += ["", "ob=(3)" if tool == "perftest" else "ob=(1)", "fn=(7)",
              f"0 {rep_cost - rep_cost // 3}"]
    lines += ["", "ob=(2)", "fn=(5)", f"0 {prov_cost}"]
    total = 1000 + loop_self + prov_cost + rep_cost + (spin if tool == "perftest" else 0)
    lines += ["", f"totals: {total}"]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(l for l in lines if l != "") .replace("\nfn=", "\n\nfn=") + "\n")
    return total


def selftest():
    """Checks the parser and the method on synthetic callgrind files (no VM, no valgrind)."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        rows = ["case\ttool\titers\tfile\tstatus"]
        for tool in ("perftest", "perf"):
            for i, n in enumerate((20, 60)):
                f = f"t.{tool}.{n}.cg"
                total = synthetic(os.path.join(d, f), tool, n, i)
                p = Profile(os.path.join(d, f))
                assert p.total == total, (tool, n, p.total, total)
                assert sum(p.self_ir.values()) == total, (tool, n, sum(p.self_ir.values()), total)
                rows.append(f"t:2:busy\t{tool}\t{n}\t{f}\tok")
        with open(os.path.join(d, "runs.tsv"), "w", encoding="utf-8") as f:
            f.write("\n".join(rows) + "\n")
        order, runs = load_runs(d)
        for tool in ("perftest", "perf"):
            profs = {n: Profile(fp) for n, fp in runs["t:2:busy"][tool].items()}
            ins, pc, _ = per_op(profs, tool)
            assert abs(ins - 50) < 1e-9, (tool, ins)
            assert abs(pc - 1) < 1e-9, (tool, pc)
            p = profs[60]
            x = excluded_set(p, tool)
            if tool == "perf":
                own, incl = stages(p, x)
                assert own["CQ poll (ibv_poll_cq, provider)"] == 0, own
                # The provider's function takes the loop's stage (its only caller).
                assert own["benchmark loop (perf example)"] == 1000 + 60 * 50, own
                assert own["post (ibv_post_*, driver::post)"] == 0, own
        # The whole report on them: both ratios 1.00.
        import io
        import contextlib
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = report(d, 3, None, True)
        assert rc == 0 and "insn_summary: insn_ratio_max=1.00" in buf.getvalue(), buf.getvalue()
    print("bench-insn-report: selftest passed")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dir", nargs="?")
    ap.add_argument("--top", type=int, default=12, help="functions listed per case")
    ap.add_argument("--case", action="append", help="only these cases (repeatable)")
    ap.add_argument("--check", action="store_true", help="fail unless every case has numbers")
    ap.add_argument("--side", choices=("client", "server"), default="client",
                    help="which process the callgrind files are of (a label only)")
    ap.add_argument("--selftest", action="store_true",
                    help="check the parser and the method on synthetic files, then exit")
    args = ap.parse_args()
    if args.selftest:
        return selftest()
    if not args.dir:
        ap.error("DIR is required")
    return report(args.dir, args.top, args.case, args.check, args.side)


def report(d, top_n, only, check, side="client"):
    """Prints the tables of run directory `d`; non-zero with `check` if a case lacks a ratio."""
    order, runs = load_runs(d)
    if only:
        order = [c for c in order if c in only]
    results = {}
    loaded = {}
    for case in order:
        for tool in ("perftest", "perf"):
            files = runs.get(case, {}).get(tool, {})
            profs = {n: Profile(fp) for n, fp in files.items()}
            loaded[case, tool] = profs
            results[case, tool] = per_op(profs, tool)

    print(f"{'case (test:size:mode)':<22} {'perftest':>10} {'tokio-rdma':>11} {'ratio':>7} "
          f"{'prov/op':>13}   runs: N:Ir/excluded Ir (perftest | ours)")
    worst = None
    missing = []
    for case in order:
        pt, pt_pc, pt_rows = results[case, "perftest"]
        ours, our_pc, our_rows = results[case, "perf"]
        # A busy-polling case counts its empty polls, whose number depends on the timing: if the
        # N1 run spun so much more than the N2 run that the difference is not positive, the
        # case has no number. Nor has it if the N2 run made fewer calls into the provider than
        # the N1 run (negative prov/op): each operation posts and polls, so the N1 run's extra
        # spins swamped the difference, and what is left (89 instructions for a round trip of
        # ib_send_lat, whose posts and polls alone cost ~400) would be taken for a cost and
        # make insn_ratio_max absurd (36.82 in session 28's full run).
        if pt is not None and (pt <= 0 or (pt_pc is not None and pt_pc < 0)):
            pt = None
        if ours is not None and (ours <= 0 or (our_pc is not None and our_pc < 0)):
            ours = None
        r = ours / pt if (pt and ours is not None) else None
        if r is not None:
            worst = r if worst is None else max(worst, r)
        else:
            missing.append(case)
        runs_txt = " ".join(f"{n}:{t:,}/{x:,}" for n, t, x in pt_rows) + " | " + \
            " ".join(f"{n}:{t:,}/{x:,}" for n, t, x in our_rows)
        pc = f"{fmt_dec(pt_pc)}/{fmt_dec(our_pc)}"
        print(f"{case:<22} {fmt_int(pt):>10} {fmt_int(ours):>11} "
              f"{('n/a' if r is None else f'{r:.2f}x'):>7} {pc:>13}   {runs_txt}")
    print(f"user-space instructions per operation (Ir, callgrind; {side} process only; a latency")
    print("  operation is one round trip, a bandwidth one a write or message): (Ir(N2) - Ir(N1)) /")
    print("  (N2 - N1), after taking out report and sort costs (excluded Ir, see --help). prov/op:")
    print("  calls into the rxe provider per operation (polls, posts, arming), perftest/ours; in")
    print("  busy mode mostly empty polls, whose number depends on timing (n/a: the N1 run spun more")
    print("  than the N2 run; then the case's instructions are n/a too, and it is left out of")
    print("  insn_ratio_max).")

    for case in order:
        profs = loaded[case, "perf"]
        if len(profs) < 2:
            continue
        ns = sorted(profs)
        p1, p2 = profs[ns[0]], profs[ns[-1]]
        dn = ns[-1] - ns[0]
        x1, x2 = excluded_set(p1, "perf"), excluded_set(p2, "perf")
        own1, inc1 = stages(p1, x1)
        own2, inc2 = stages(p2, x2)
        print()
        print(f"stages of tokio-rdma, {case}, insns/op (self: own instructions, they sum to the")
        print("  total; incl: with what the stage calls in other stages, for stages that do not nest):")
        for n in [n for n, _, _ in STAGES] + ["other"]:
            so = (own2[n] - own1[n]) / dn
            si = (inc2[n] - inc1[n]) / dn
            if abs(so) < 0.5 and abs(si) < 0.5:
                continue
            incl = f" incl {si:,.0f}" if n in LEAF else ""
            print(f"  {n}: self {so:,.0f}{incl}")
        x = (excluded(p2, "perf") - excluded(p1, "perf")) / dn
        print(f"  (excluded report: {x:,.0f}; total before excluding {(p2.total - p1.total) / dn:,.0f})")
        for tool in ("perftest", "perf"):
            pr = loaded[case, tool]
            if len(pr) < 2:
                continue
            q1, q2 = pr[min(pr)], pr[max(pr)]
            o1, o2 = by_object(q1, excluded_set(q1, tool)), by_object(q2, excluded_set(q2, tool))
            d = max(pr) - min(pr)
            objs = sorted(set(o1) | set(o2), key=lambda o: -(o2[o] - o1[o]))
            parts = [f"{o} {(o2[o] - o1[o]) / d:,.0f}" for o in objs if abs(o2[o] - o1[o]) / d >= 5]
            label = "perftest" if tool == "perftest" else "tokio-rdma"
            print(f"  by object, {label}: {', '.join(parts)}")
        if top_n > 0:
            i1, i2 = fn_inclusive(p1), fn_inclusive(p2)
            s1, s2 = p1.self_ir, p2.self_ir
            fs = set(i2) | set(i1)
            fs = {f for f in fs if f not in x1 and f not in x2}
            top = sorted(fs, key=lambda f: -(s2[f] - s1[f]))[:top_n]
            print(f"  top functions by own instructions per op (self / inclusive):")
            for f in top:
                so = (s2[f] - s1[f]) / dn
                if so < 1:
                    break
                print(f"    {so:8,.0f} {(i2[f] - i1[f]) / dn:9,.0f}  {short(f)}")

    print(f"insn_summary: insn_ratio_max={'n/a' if worst is None else f'{worst:.2f}'}")
    if check and missing:
        print(f"bench-insn-report: no ratio for {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
