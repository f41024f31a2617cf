#!/usr/bin/env python3
"""Tables of an ncu --csv report (tools/gpu-check.sh's profile steps).

    ncu_table.py sum CSV CALLS   device time of each kernel summed over the
                                 report, per call (ms), and its launches
    ncu_table.py time CSV        each kernel's launches, median and mean
                                 gpu__time_duration (us)
    ncu_table.py metrics CSV     each kernel's metrics, the mean over its
                                 launches (stall reasons under 0.05 left out)
    ncu_table.py source CSV [N]  a source page (ncu -i REPORT --page source
                                 --csv --print-source sass): the warp samples
                                 by opcode, then the N instructions (30) that
                                 hold the most, with the share of each

Kernel names lose their template arguments, namespaces and parameters.
"""
import collections
import csv
import re
import statistics
import sys

TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}


def kernel(name):
    while re.search(r"<[^<>]*>", name):
        name = re.sub(r"<[^<>]*>", "", name)  # template arguments, (anonymous) namespaces
    return name.split("(")[0].split("::")[-1].replace("void ", "")


def rows_of(path):
    rows = [r for r in csv.reader(open(path)) if len(r) > 10]
    if not rows:
        sys.exit("  no ncu rows")
    head = rows[0]
    return {k: head.index(k) for k in ("Kernel Name", "Metric Name", "Metric Unit", "Metric Value")}, rows[1:]


def number(text):
    return float(text.replace(",", ""))


def source(path, top):
    """Warp stall samples of a source page, by opcode and by instruction."""
    rows = list(csv.reader(open(path, newline="", errors="replace")))
    at = next((i for i, r in enumerate(rows) if r and r[0] == "Address" and "Source" in r), None)
    if at is None:
        sys.exit("  no source page (Address, Source, ...) in " + path)
    head = rows[at]
    src, samples = head.index("Source"), head.index("Warp Stall Sampling (All Samples)")

    def count(r):
        try:
            return number(r[samples])
        except ValueError:
            return 0.0

    body = [r for r in rows[at + 1:] if len(r) > samples]
    total = sum(count(r) for r in body) or 1.0
    by_op = collections.Counter()
    for r in body:
        words = r[src].split()
        if words:
            op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
            by_op[op.split(".")[0]] += count(r)
    print(f"  {total:.0f} warp samples over {len(body)} instructions; by opcode:")
    print("  " + ", ".join(f"{op} {100 * v / total:.1f}%" for op, v in by_op.most_common(12)))
    for r in sorted(body, key=lambda r: -count(r))[:top]:
        if count(r) == 0:
            break
        print(f"  {100 * count(r) / total:5.1f}% {r[0]:>18s}  {r[src].strip()[:90]}")


def main(argv):
    mode, path = argv[1], argv[2]
    if mode == "source":
        source(path, int(argv[3]) if len(argv) > 3 else 30)
        return
    col, rows = rows_of(path)
    if mode == "metrics":
        acc = collections.defaultdict(lambda: collections.defaultdict(list))
        for r in rows:
            try:
                acc[kernel(r[col["Kernel Name"]])][r[col["Metric Name"]]].append(number(r[col["Metric Value"]]))
            except ValueError:
                pass
        for k, metrics in acc.items():
            print(f"  {k}")
            for m, v in sorted(metrics.items()):
                x = sum(v) / len(v)
                if "stalled" in m and x < 0.05:
                    continue
                m = m.replace("smsp__average_warps_issue_stalled_", "stall ").replace("_per_issue_active.ratio", "")
                print(f"    {m[:60]:60s} {x:14.2f}")
        return
    t = collections.defaultdict(list)
    for r in rows:
        t[kernel(r[col["Kernel Name"]])].append(number(r[col["Metric Value"]]) * TO_US.get(r[col["Metric Unit"]], 1.0))
    if mode == "time":
        for k, v in sorted(t.items(), key=lambda x: -statistics.median(x[1])):
            print(f"  {k[:40]:40s} {len(v):6d} {statistics.median(v):9.2f} {sum(v) / len(v):9.2f}")
    elif mode == "sum":
        calls = int(argv[3])
        for k, v in sorted(t.items(), key=lambda x: -sum(x[1])):
            print(f"  {k[:44]:44s} {len(v) / calls:6.1f} {sum(v) / 1e3 / calls:8.3f}")
        print(f"  {'total':44s} {sum(len(v) for v in t.values()) / calls:6.1f} "
              f"{sum(sum(v) for v in t.values()) / 1e3 / calls:8.3f}")
    else:
        sys.exit(f"ncu_table.py: unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv)
