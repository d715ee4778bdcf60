import json
import logging
import subprocess
import sys
import textwrap

import pytest
import torch

from rl_engine.ops import counters
from rl_engine.runtime.plan import Plan
from rl_engine.runtime.routing import Router

# Runs a snippet in a fresh interpreter in which the extension cannot be imported.
_NO_EXTENSION = "import sys; sys.modules['rl_engine._C'] = None\n"


def _run_without_extension(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _NO_EXTENSION + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=120)


def test_strict_route_without_extension_fails_before_work():
    proc = _run_without_extension("""
        from rl_engine.runtime.plan import Plan
        from rl_engine.runtime.routing import Router, RouteUnavailable
        try:
            Router(Plan(ffn="P/R", attention="P/P", logp="P/P"), side="rollout", engine="builtin")
        except RouteUnavailable as exc:
            print("refused:", exc)
        else:
            print("ran")
    """)
    assert "refused: strict rollout route of module ffn cannot run: rl_engine._C" in proc.stdout, proc.stderr
    # The training side of the same plan is P: it needs no extension and is allowed.
    proc = _run_without_extension("""
        from rl_engine.runtime.plan import Plan
        from rl_engine.runtime.routing import Router
        Router(Plan(ffn="P/R", attention="P/P", logp="P/P"), side="training", engine="builtin")
        print("ran")
    """)
    assert proc.stdout.strip() == "ran", proc.stderr


def test_preflight_without_extension_exits_2():
    proc = _run_without_extension("from rl_engine.cli import main; raise SystemExit(main(['preflight']))")
    assert proc.returncode == 2, proc.stderr
    assert "rl_engine._C loads: not built" in proc.stderr


def test_audit_mode_records_the_fallback_and_its_reason():
    proc = _run_without_extension("""
        import json
        import torch
        from rl_engine.runtime.plan import Plan
        from rl_engine.runtime.routing import Router
        r = Router(Plan(mode="audit"), side="training", engine="builtin")
        r.linear("ffn", torch.ones(2, 4), torch.ones(3, 4))
        print(json.dumps(r.records["ffn"].as_dict()))
    """)
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rec["requested"] == "R" and rec["actual"] == "P" and rec["fallback"] is True
    assert "rl_engine._C" in rec["fallback_reason"]
    assert rec["call_counts"] == {"production.torch.linear": 1}


def test_call_counts_come_from_the_kernel_counters(tmp_path):
    router = Router(Plan(), side="training", engine="builtin")
    x, w = torch.randn(5, 16, dtype=torch.bfloat16), torch.randn(8, 16, dtype=torch.bfloat16)
    before = counters.read()
    for _ in range(3):
        router.linear("ffn", x, w)
    router.swiglu("ffn", torch.randn(5, 16))
    launched = counters.delta(before, counters.read())
    assert launched == {("det_gemm", "cpu"): 3, ("swiglu", "cpu"): 1}
    assert router.records["ffn"].call_counts == {"rlkernel.det_gemm.cpu.v1": 3, "rlkernel.swiglu.cpu.v1": 1}
    assert router.records["attention"].call_counts == {}


def test_route_line_is_logged_once_per_module(caplog):
    with caplog.at_level(logging.INFO, logger="rl_engine.route"):
        router = Router(Plan(), side="rollout", engine="builtin")
        for _ in range(4):
            router.rmsnorm("ffn", torch.randn(2, 8), torch.ones(8), 1e-6)
    lines = [r.getMessage() for r in caplog.records if "[rl-engine][route]" in r.getMessage()]
    assert len(lines) == 3
    assert any("module=ffn requested=R actual=R fallback=false" in line for line in lines)


def test_a_split_op_runs_the_routes_implementation_and_counts_it_once():
    """An op split over ranks hands the router both implementations; the record shows only the
    chosen one's calls: kernel launches on R, one production call on P."""
    x = {"q": torch.randn(8, 2, 32, dtype=torch.bfloat16), "k": torch.randn(8, 1, 32, dtype=torch.bfloat16)}
    cu, pos = torch.tensor([0, 8], dtype=torch.int32), torch.arange(8)

    def r_fn(router):
        return "R", router.attention_lse("attention", x["q"], x["k"], x["k"], cu, cu, pos, 0.125)

    def p_fn(router):
        router.count_production("attention", "production.sdpa")
        return "P", None

    r = Router(Plan(), side="training", engine="builtin")
    assert r.split("attention", r_fn, p_fn, r)[0] == "R"
    assert r.records["attention"].call_counts == {"rlkernel.attention.cpu.v1": 1}
    p = Router(Plan(attention="P/P"), side="training", engine="builtin")
    assert p.split("attention", r_fn, p_fn, p)[0] == "P"
    assert p.records["attention"].call_counts == {"production.sdpa": 1}


def test_a_route_cannot_run_the_other_routes_pieces():
    p = Router(Plan(attention="P/P"), side="training", engine="builtin")
    with pytest.raises(RuntimeError, match="runs only on an R route"):
        p.sum_in_order("attention", [torch.ones(3), torch.ones(3)])
    r = Router(Plan(), side="training", engine="builtin")
    with pytest.raises(RuntimeError, match="production call was made on its R route"):
        r.count_production("attention", "production.sdpa")
    assert p.records["attention"].call_counts == r.records["attention"].call_counts == {}


def test_a_routed_op_inside_a_counted_block_is_counted_once():
    """An R backward recomputes a routed op inside its own counted block (the CP weight taps):
    each launch appears once in the record, as the kernels' counters saw it."""
    router = Router(Plan(), side="training", engine="builtin")
    x, w = torch.randn(5, 16, dtype=torch.bfloat16), torch.randn(8, 16, dtype=torch.bfloat16)
    before = counters.read()
    with router.kernels("ffn"):
        router.linear("ffn", x, w)
        router.linear("ffn", x, w)
    assert counters.delta(before, counters.read()) == {("det_gemm", "cpu"): 2}
    assert router.records["ffn"].call_counts == {"rlkernel.det_gemm.cpu.v1": 2}
