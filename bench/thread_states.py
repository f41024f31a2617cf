#!/usr/bin/env python3
"""Where a process's threads wait, sampled from /proc (for machines without nsys).

    thread_states.py sample PID OUT [SECONDS]   # every thread's state and syscall, ~2 kHz
    thread_states.py report OUT PID FROM TO     # FROM, TO: fractions of the sampled span

The report covers the instants of [FROM, TO) at which the main thread (PID) was
sampled: its state and syscall (202: futex, 16: ioctl; "running": none), the
futex addresses it waited on, and which other threads were running while it
waited (thread name, id, syscall). A main thread that waits on one futex while
one other thread runs is waiting for a lock that thread holds.
"""
import collections
import os
import sys
import time


def sample(pid, out, seconds):
    names, rows = {}, []
    end = time.time() + seconds
    while time.time() < end:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except FileNotFoundError:
            break
        now = time.time()
        for t in tids:
            try:
                if t not in names:
                    names[t] = open(f"/proc/{pid}/task/{t}/comm").read().strip().replace(" ", "_")
                sc = open(f"/proc/{pid}/task/{t}/syscall").read().split()
                state = open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0]
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                continue
            rows.append((now, t, state, sc[0], sc[1] if len(sc) > 1 else "-", names[t]))
        time.sleep(0.0005)
    with open(out, "w") as f:
        for r in rows:
            f.write(" ".join(map(str, r)) + "\n")


def report(path, pid, lo_frac, hi_frac):
    rows = [line.split() for line in open(path)]
    if not rows:
        sys.exit("no samples")
    t0, t1 = float(rows[0][0]), float(rows[-1][0])
    lo, hi = t0 + (t1 - t0) * lo_frac, t0 + (t1 - t0) * hi_frac
    at = collections.defaultdict(list)
    for r in rows:
        if lo <= float(r[0]) < hi:
            at[r[0]].append(r)
    main, futex, others = collections.Counter(), collections.Counter(), collections.Counter()
    for rs in at.values():
        m = [r for r in rs if r[1] == pid]
        if not m:
            continue
        now, _, state, call, arg, _ = m[0]
        main[f"{state}:{call}"] += 1
        if call == "202":
            futex[arg] += 1
            for r in rs:
                if r[1] != pid and r[2] == "R":
                    others[f"{r[5]}:{r[1]}:{r[3]}"] += 1
    print(f"window {lo - t0:.1f} to {hi - t0:.1f} s, {len(at)} instants")
    print("main thread (state:syscall):", main.most_common(8))
    print("its futex addresses:", futex.most_common(4))
    print("threads running while it waited on a futex:", others.most_common(8))


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "sample":
        sample(int(sys.argv[2]), sys.argv[3], float(sys.argv[4]) if len(sys.argv) > 4 else 60)
    elif len(sys.argv) == 6 and sys.argv[1] == "report":
        report(sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5]))
    else:
        sys.exit(__doc__)
