"""The speed targets of the Hopper ops (production time / ours in the same run, CUDA events, medians)
and the verdict of a hopper_ops.py result against them: for each target whether every row it covers
reaches it, how many do, and the worst row. A target whose section did not run is not judged."""

from __future__ import annotations

# HBM bandwidth on the datasheet, by what torch.cuda.get_device_name() contains (the longest match
# wins): the weight stream's share and the memory-bound ops' fraction are of the card that ran.
HBM_TBS = {"H200": 4.8, "H100": 3.35, "H100 NVL": 3.9, "H100 PCIe": 2.0}
DATASHEET_TBS = HBM_TBS["H200"]  # the card the targets were set on
DECODE_M = (1, 2, 4, 8, 16, 32, 64, 128)
LARGE_M = (256, 1024, 4096, 8192)
WEIGHT_STREAM_M = 16
TARGETS = {
    "det_gemm_ratio_decode_m": 1.0,  # every shape at M in DECODE_M
    "det_gemm_ratio_large_m": 0.95,  # every shape at M in LARGE_M
    "det_gemm_weight_stream_hbm_fraction": 0.5,  # of the datasheet, at M <= WEIGHT_STREAM_M
    "det_gemm_backward_ratio": 0.9,  # grad_input and grad_weight
    "linear_logp_ratio_vs_lm_head_gemm": 1.0,
    "linear_logp_extra_memory_below_bytes": 1e8,
    "linear_logp_backward_ratio": 1.0,
    "rmsnorm_backward_tbs": 3.4,
}


def datasheet_tbs(device_name: str) -> float:
    """The datasheet HBM bandwidth of the named card; a card not in HBM_TBS is an error, since a
    share of the wrong peak would read as a result."""
    known = [name for name in HBM_TBS if name in device_name]
    if not known:
        raise ValueError(f"no datasheet bandwidth for {device_name!r}: add it to HBM_TBS in "
                         f"benchmarks/hopper_targets.py (known: {', '.join(HBM_TBS)})")
    return HBM_TBS[max(known, key=len)]


def _verdict(rows: list[dict], value, bar: float, name, at_least: bool = True) -> dict:
    if not rows:
        return dict(target=bar, met=None, rows=0, rows_met=0, worst=None)
    reaches = (lambda r: value(r) >= bar) if at_least else (lambda r: value(r) < bar)
    worst = min(rows, key=value) if at_least else max(rows, key=value)
    met = sum(1 for r in rows if reaches(r))
    return dict(target=bar, met=met == len(rows), rows=len(rows), rows_met=met,
                worst=f"{name(worst)}: {value(worst):.4g}")


def weight_stream(result: dict) -> tuple[list[dict], float]:
    """The det_gemm rows the weight-stream target covers (M <= WEIGHT_STREAM_M, with the stream's
    TB/s recorded) and the datasheet bandwidth they are a share of."""
    rows = [r for r in result.get("gemm", []) if r["op"] == "det_gemm" and r["m"] <= WEIGHT_STREAM_M
            and "r_weight_tbs" in r]
    return rows, result.get("datasheet_tbs", DATASHEET_TBS)  # results before it was recorded ran on H200s


def _row(rows: dict, op: str) -> list[dict]:
    return [rows[op]] if op in rows else []


def judge(result: dict) -> dict:
    gemm = [r for r in result.get("gemm", []) if r["op"] == "det_gemm"]
    backward = [r for r in result.get("gemm", []) if r["op"] in ("det_gemm_grad_input", "det_gemm_grad_weight")]
    memory = {r["op"]: r for r in result.get("memory_bound", [])}
    logp = {r["op"]: r for r in result.get("linear_logp", [])}
    shape = lambda r: f"{r['shape']} m={r['m']}"  # noqa: E731
    ratio = lambda r: r["ratio"]  # noqa: E731
    t = TARGETS
    stream, peak = weight_stream(result)
    return {
        "det_gemm_ratio_decode_m": _verdict([r for r in gemm if r["m"] in DECODE_M], ratio,
                                            t["det_gemm_ratio_decode_m"], shape),
        "det_gemm_ratio_large_m": _verdict([r for r in gemm if r["m"] in LARGE_M], ratio,
                                           t["det_gemm_ratio_large_m"], shape),
        "det_gemm_weight_stream_hbm_fraction": _verdict(
            stream, lambda r: r["r_weight_tbs"] / peak, t["det_gemm_weight_stream_hbm_fraction"], shape),
        "det_gemm_backward_ratio": _verdict(backward, ratio, t["det_gemm_backward_ratio"], lambda r: r["op"]),
        "linear_logp_ratio_vs_lm_head_gemm": _verdict(
            _row(logp, "linear_logp"), lambda r: r["ratio_vs_lm_head_gemm"],
            t["linear_logp_ratio_vs_lm_head_gemm"], lambda r: r["op"]),
        "linear_logp_extra_memory_below_bytes": _verdict(
            _row(logp, "linear_logp"), lambda r: r["r_extra_peak_bytes"],
            t["linear_logp_extra_memory_below_bytes"], lambda r: r["op"], at_least=False),
        "linear_logp_backward_ratio": _verdict(_row(logp, "linear_logp_backward"), ratio,
                                               t["linear_logp_backward_ratio"], lambda r: r["op"]),
        "rmsnorm_backward_tbs": _verdict(_row(memory, "rmsnorm_backward"),
                                         lambda r: r["r_tbs"], t["rmsnorm_backward_tbs"], lambda r: r["op"]),
    }


def det_gemm_verdicts(rows: list[dict], key: str) -> dict:
    """The two det_gemm ratio targets judged on rows of (shape, m, key), as det_gemm_plans.py and
    det_gemm_replay.py record a plan per row (rows whose key is None are left out)."""
    got = judge(dict(gemm=[dict(op="det_gemm", shape=r["shape"], m=r["m"], ratio=r[key])
                           for r in rows if r.get(key) is not None]))
    return {name: got[name] for name in ("det_gemm_ratio_decode_m", "det_gemm_ratio_large_m")}
