#!/usr/bin/env python3
"""Tables of an ncu --csv report (tools/gpu-check.sh's profile steps).

    ncu_table.py sum CSV CALLS   device time of each kernel summed over the
                                 report, per call (ms), and its launches
    ncu_table.py time CSV        each kernel's launches, median and mean
                                 gpu__time_duration (us)
    ncu_table.py metrics CSV     each kernel's metrics, the mean over its
                                 launches (stall reasons under 0.05 left out)

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


def main(argv):
    mode, path = argv[1], argv[2]
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
