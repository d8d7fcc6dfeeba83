#!/usr/bin/python3
"""The kernel targets of docs/PERFORMANCE.md, judged from one bench_kernels.sh run.

Reads the output of scripts/bench_kernels.sh (a file, or standard input) and
prints one line per target: what it asks, what this run measured, and whether
it was met. Only figures of the same run are compared. The rows used are the
default ones of `colibri-bench kernels` (the first table after each
"# model" line: what a node runs without flags), the layer case, and
PyTorch's bf16 rows.

  read bandwidth  frac_bw of the T=1 row: GB/s over the best probe pass read
                  just before that type's run; per_call is 1 / x_floor, against
                  a probe pass just before each call (steadier on a noisy host)
  PyTorch ratios  PyTorch bf16's median over Colibri's, same T
  T=128 bf16      on a machine with AMX (the log has the AMX rows) the target
                  is x_floor <= 1.3 (the time to read the layer's bytes at the
                  bandwidth of the moment), else >= 1.5x PyTorch
  p99/p50         over every default layer row

Exit status: 0 (the verdicts are printed, met or not), 2 when the log has no
Colibri rows at all.
"""
import re
import sys

COLIBRI = re.compile(
    r"^colibri\s+(?P<dtype>\S+)\s+(?P<case>\S+)\s+(?P<T>\d+)\s+(?P<median>[\d.]+)\s+(?P<p99>[\d.]+)\s+"
    r"(?P<ratio>[\d.]+)\s+(?P<gbps>[\d.]+)\s+(?P<frac>[\d.]+)\s+\S+\s+\S+\s+(?P<floor>\S+)\s+(?P<x_floor>\S+)$")
TORCH = re.compile(r"^torch\s+(?P<dtype>\S+)\s+(?P<T>\d+)\s+\d+\s+(?P<median>[\d.]+)\s+[\d.]+\s+(?P<p99>[\d.]+)")


def parse(lines):
    """({(dtype, T): row} of the default layer rows, {T: median} of PyTorch bf16, amx, the layer's shape)."""
    colibri, torch, amx, shape = {}, {}, False, None
    default = False
    for line in lines:
        line = line.rstrip("\n")
        if line.startswith("# model "):
            default = True
            m = re.search(r"d_model \d+, d_ff \d+", line)
            shape = shape or (m and m.group(0))
        elif line.startswith("# the same"):
            default = False
            amx = amx or "AMX tiles for every T" in line
        m = COLIBRI.match(line)
        if m and default and m["case"] == "layer":
            colibri[(m["dtype"], int(m["T"]))] = {
                "median": float(m["median"]), "p99": float(m["p99"]), "frac": float(m["frac"]),
                "x_floor": float(m["x_floor"]) if m["x_floor"] != "-" else None}
        m = TORCH.match(line)
        if m and m["dtype"] == "bf16":
            torch[int(m["T"])] = float(m["median"])
    return colibri, torch, amx, shape


def verdicts(colibri, torch, amx):
    """[(target, measured, status)], status one of met / not met / not measured."""
    out = []

    def add(target, measured, ok):
        out.append((target, measured, "not measured" if ok is None else "met" if ok else "not met"))

    for dtype, goal in (("bf16", 0.90), ("int4", 0.80), ("int8", 0.85)):
        row = colibri.get((dtype, 1))
        if row is None:
            add(f"T=1 {dtype} >= {goal:.2f} of the read bandwidth", "-", None)
            continue
        per_call = f", {1 / row['x_floor']:.3f} per call" if row["x_floor"] else ""
        add(f"T=1 {dtype} >= {goal:.2f} of the read bandwidth", f"{row['frac']:.3f}{per_call}",
            row["frac"] >= goal)

    row, base = colibri.get(("bf16", 128)), torch.get(128)
    speedup = f"{base / row['median']:.3f}x PyTorch" if row and base else "-"
    if amx:
        ok = None if row is None or row["x_floor"] is None else row["x_floor"] <= 1.3
        floor = f"{row['x_floor']:.2f}x the read time" if row and row["x_floor"] else "-"
        add("T=128 bf16 <= 1.3x the time to read its bytes (AMX)", f"{floor}; {speedup}", ok)
    else:
        add("T=128 bf16 >= 1.5x PyTorch (no AMX)", speedup, None if not (row and base) else base / row["median"] >= 1.5)

    for tokens in (8, 32):
        base = torch.get(tokens)
        for dtype in ("bf16", "int8", "int4"):
            row = colibri.get((dtype, tokens))
            ok = None if not (row and base) else base / row["median"] >= 2.0
            add(f"T={tokens} {dtype} >= 2x PyTorch bf16", f"{base / row['median']:.3f}x" if ok is not None else "-", ok)

    bf16 = colibri.get(("bf16", 128))
    for dtype in ("int8", "int4"):
        row = colibri.get((dtype, 128))
        ok = None if not (row and bf16) else row["median"] <= bf16["median"]
        measured = f"{row['median']:.1f} vs {bf16['median']:.1f} ms" if ok is not None else "-"
        add(f"T=128 {dtype} at least as fast as bf16", measured, ok)

    ratios = [r["p99"] / r["median"] for r in colibri.values() if r["median"] > 0]
    add("p99 <= 1.3x p50 (every layer row)", f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-",
        max(ratios) <= 1.3 if ratios else None)
    return out


def main():
    try:
        lines = open(sys.argv[1]) if len(sys.argv) > 1 else sys.stdin
    except OSError as e:
        print(f"kernel_targets: cannot read the log: {e}", file=sys.stderr)
        return 2
    colibri, torch, amx, shape = parse(lines)
    if not colibri:
        print("kernel_targets: no default Colibri layer rows in the log", file=sys.stderr)
        return 2
    print(f"# the kernel targets (docs/PERFORMANCE.md; set for d_model 4096, d_ff 14336), from this run ({shape}):")
    rows = verdicts(colibri, torch, amx)
    width = max(len(t) for t, _, _ in rows)
    for target, measured, status in rows:
        print(f"#   {target.ljust(width)}  {measured:<32}  {status}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
