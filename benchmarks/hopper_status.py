"""Where the Hopper kernels stand against their speed targets, one column per evidence folder (each
holding the hopper_ops.json and hopper_attention.json of one commit), as a Markdown table:

    python benchmarks/hopper_status.py benchmarks/results/h200/f5257e9 benchmarks/results/h100/19fe046
    python benchmarks/hopper_status.py --update README.md

--update rewrites the table between README.md's `<!-- hopper-status: FOLDER... -->` and
`<!-- /hopper-status -->` lines from the folders the first one names (paths from the repository's
root; printed tables take them from the current directory): name a new evidence folder on that line,
then run it. The tests hold the committed table to the committed JSON.
hopper_ops.json is judged again with hopper_targets.judge (not read from its stored verdict), the
attention targets from the rows of hopper_attention.json. Needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from collect_evidence import recorded  # noqa: E402
from hopper_targets import TARGETS, judge, weight_stream  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
START = re.compile(r"^<!-- hopper-status: (?P<folders>.+) -->$")
END = "<!-- /hopper-status -->"
# The rows of the table, in the order: (key in judge() or attention_verdicts(), label).
ROWS = (
    ("det_gemm_ratio_decode_m", "det_gemm at M <= 128, of cuBLAS (>= 1.0)"),
    ("det_gemm_ratio_large_m", "det_gemm at M >= 256, of cuBLAS (>= 0.95)"),
    ("det_gemm_weight_stream_hbm_fraction", "det_gemm's weight stream at M <= 16, of HBM (>= 0.5)"),
    ("det_gemm_backward_ratio", "det_gemm grad_input / grad_weight (>= 0.9)"),
    ("forward_ratio", "attention forward, of cuDNN (>= 0.9)"),
    ("backward_ratio", "attention backward, of cuDNN (>= 0.75)"),
    ("decode_tbs", "paged decode, TB/s (>= 3.6)"),
    ("linear_logp_ratio_vs_lm_head_gemm", "linear_logp forward, of the LM-head GEMM (>= 1.0)"),
    ("linear_logp_extra_memory_below_bytes", "linear_logp extra memory, bytes (< 1e8)"),
    ("linear_logp_backward_ratio", "linear_logp backward, of the plain path (>= 1.0)"),
    ("rmsnorm_backward_tbs", "RMSNorm backward, TB/s (>= 3.4)"),
)


class StatusError(Exception):
    """Input the table cannot be made from; the message names the file and the fix."""


def _load(path: Path) -> dict:
    if not path.parent.is_dir():
        raise StatusError(f"{path.parent} is not a folder: give evidence folders, each holding the "
                          "hopper_ops.json and hopper_attention.json of one commit")
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise StatusError(f"{path} is missing: a folder needs the hopper_ops.json and "
                          "hopper_attention.json that benchmarks/hopper_ops.py and hopper_attention.py write")
    except (ValueError, UnicodeDecodeError) as e:
        raise StatusError(f"{path} is not JSON ({e}); write it again with its benchmark")
    if not isinstance(data, dict):
        raise StatusError(f"{path} holds {type(data).__name__}, not a benchmark result; write it again "
                          "with its benchmark")
    return data


def attention_verdicts(result: dict) -> dict:
    """The attention targets judged on every row, in judge()'s form (hopper_attention.py records only
    whether each is met)."""
    targets = result.get("targets", {})
    out = {}
    for key, rows, field in (("forward_ratio", result.get("prefill", []), "forward_ratio"),
                             ("backward_ratio", result.get("prefill", []), "backward_ratio"),
                             ("decode_tbs", result.get("decode", []), "r_tbs")):
        rows, bar = [r for r in rows if r.get(field) is not None], targets.get(key)
        if not rows or bar is None:
            out[key] = dict(target=bar, met=None, rows=0, rows_met=0, worst=None)
            continue
        worst = min(rows, key=lambda r: r[field])
        where = f"{worst['tokens']} tokens, " if "tokens" in worst else ""
        met = sum(1 for r in rows if r[field] >= bar)
        out[key] = dict(target=bar, met=met == len(rows), rows=len(rows), rows_met=met,
                        worst=f"{where}head_dim {worst['head_dim']}: {worst[field]:.4g}")
    return out


def column(folder: Path) -> tuple[str, dict]:
    """(header, verdicts by row key) of one evidence folder."""
    ops, attention = _load(folder / "hopper_ops.json"), _load(folder / "hopper_attention.json")
    sources = {name: recorded(d) or (None, None) for name, d in
               (("hopper_ops.json", ops), ("hopper_attention.json", attention))}
    commits = {name: commit for name, (commit, _) in sources.items()}
    if None in commits.values():
        raise StatusError(f"{folder}: every result must record the commit it measured (`source`), but "
                          f"the files record {commits}; run the benchmark again from a checkout")
    if len(set(commits.values())) != 1:
        raise StatusError(f"{folder}: a column is one commit's, but its files record {commits}; keep "
                          "each commit's results in a folder of their own")
    devices = {ops.get("device"), attention.get("device")} - {None}
    if len(devices) > 1:
        raise StatusError(f"{folder}: a column is one card's, but its files ran on {sorted(devices)}")
    dirty = any(dirty is not False for _, dirty in sources.values())
    header = f"{ops.get('device', '?')}, {commits['hopper_ops.json'][:7]}{' (dirty)' if dirty else ''}"
    verdicts = {**judge(ops), **attention_verdicts(attention)}
    # The TB/s targets are absolute (set on an H200): beside them, the share of the bandwidth a copy
    # reached on the card that ran, which says how far a smaller card's figure is from its own peak.
    for key, result in (("rmsnorm_backward_tbs", ops), ("decode_tbs", attention)):
        v, copy = verdicts.get(key), result.get("copy_tbs")
        if v and v["worst"] and copy:
            v["worst"] += f" ({float(v['worst'].rsplit(': ', 1)[1]) / copy:.2f} of a copy's {copy:.2f})"
    # The weight-stream bar is absolute too: beside it, how many of the rows that miss it cuBLAS
    # misses as well.
    v, (stream, peak) = verdicts.get("det_gemm_weight_stream_hbm_fraction"), weight_stream(ops)
    missed = [r for r in stream if r["r_weight_tbs"] / peak < v["target"]] if v and v["worst"] else []
    if missed and all("p_weight_tbs" in r for r in missed):
        both = sum(1 for r in missed if r["p_weight_tbs"] / peak < v["target"])
        which = f"all {len(missed)}" if both == len(missed) else f"{both} of the {len(missed)}"
        v["worst"] += f" (cuBLAS also under {v['target']:g} on {which} rows missed)"
    # Under the memory cap the backward recomputes the logits, so it runs three products the size of
    # the LM-head GEMM where the plain path, holding its logits, runs two: the ratio the backward
    # would reach at cuBLAS's own rate says how much of the miss that accounts for.
    logp = {r.get("op"): r for r in ops.get("linear_logp", [])}
    v, fwd, bwd = verdicts.get("linear_logp_backward_ratio"), logp.get("linear_logp"), logp.get("linear_logp_backward")
    if v and v["worst"] and fwd and bwd and fwd.get("lm_head_gemm_ms") and bwd.get("p_ms"):
        v["worst"] += f" ({bwd['p_ms'] / (3 * fwd['lm_head_gemm_ms']):.2f} if it took three LM-head GEMMs' time)"
    return header, verdicts


def cell(verdict: dict | None) -> str:
    """met or **missed**, with the worst row (its value alone where there is one row)."""
    if verdict is None or verdict["met"] is None:
        return "not run"
    word = "met" if verdict["met"] else "**missed**"
    if verdict["rows"] == 1:
        return f"{word}: {verdict['worst'].rsplit(': ', 1)[1]}"
    return f"{word}: {verdict['rows_met']} / {verdict['rows']} rows; worst {verdict['worst']}"


def table(folders: list[Path]) -> str:
    columns = [column(f) for f in folders]
    lines = ["| target | " + " | ".join(h for h, _ in columns) + " |",
             "| --- | " + " | ".join("---" for _ in columns) + " |"]
    lines += [f"| {label} | " + " | ".join(cell(v.get(key)) for _, v in columns) + " |"
              for key, label in ROWS]
    return "\n".join(lines) + "\n"


def update(readme: Path) -> bool:
    """Rewrites readme's status table from the folders its marker names; True if it changed."""
    try:
        text = readme.read_text()
    except OSError as e:
        raise StatusError(f"--update {readme}: {e.strerror}; give the README that holds the table")
    lines = text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if START.match(line.rstrip("\n"))]
    ends = [i for i, line in enumerate(lines) if line.rstrip("\n") == END]
    if len(starts) != 1 or len(ends) != 1:
        raise StatusError(f"{readme} needs one `<!-- hopper-status: FOLDER... -->` line and, after it, one "
                          f"`{END}` line; found {len(starts)} and {len(ends)}")
    if ends[0] < starts[0]:
        raise StatusError(f"{readme}: `{END}` (line {ends[0] + 1}) comes before the `<!-- hopper-status: "
                          f"... -->` line (line {starts[0] + 1}); put the table's markers around it in that order")
    folders = [ROOT / f for f in START.match(lines[starts[0]].rstrip("\n"))["folders"].split()]
    new = "".join(lines[:starts[0] + 1]) + table(folders) + "".join(lines[ends[0]:])
    if new == text:
        return False
    tmp = readme.with_name(readme.name + ".tmp")
    tmp.write_text(new)
    tmp.replace(readme)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folders", nargs="*", type=Path, help="evidence folders, one column each")
    ap.add_argument("--update", type=Path, metavar="README", help="rewrite the table between its markers")
    args = ap.parse_args(argv)
    if bool(args.folders) == bool(args.update):
        ap.error("give evidence folders to print their table, or --update README (not both)")
    try:
        if args.update:
            print(f"{args.update}: {'updated' if update(args.update) else 'already current'}")
        else:
            sys.stdout.write(table(args.folders))
    except StatusError as e:
        print(f"hopper_status: {e}", file=sys.stderr)
        return 2
    return 0


assert {key for key, _ in ROWS} >= set(TARGETS), "every hopper_ops target has a row"

if __name__ == "__main__":
    sys.exit(main())
