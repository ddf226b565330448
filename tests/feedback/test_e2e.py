"""End-to-end serving metrics read from a serving benchmark's output."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from feedback.e2e import metrics_from_records, parse_output, run_benchmark

FAKE_SERVER_BENCH = textwrap.dedent('''
    import json, random, sys
    rng = random.Random(int(sys.argv[1]))
    reqs, t = [], 0.0
    for i in range(40):
        t += rng.expovariate(20.0)                  # Poisson arrivals
        ttft = 0.05 + 0.01 * rng.random()
        n = rng.randint(8, 64)
        tpot = 0.010 + 0.002 * rng.random()
        reqs.append({"arrival": t, "first_token": t + ttft, "done": t + ttft + tpot * (n - 1), "output_tokens": n})
    print("warming up...")
    print(json.dumps({"requests": reqs, "overheads": {"kv_transfer": 0.004}}))
''')


def test_e2e_reads_ttft_tpot_throughput_from_a_fake_workload(tmp_path):
    script = tmp_path / "bench.py"
    script.write_text(FAKE_SERVER_BENCH)
    m = run_benchmark([sys.executable, str(script), "3"])
    out = subprocess.run([sys.executable, str(script), "3"], capture_output=True, text=True, check=True)
    records = json.loads(out.stdout.splitlines()[-1])["requests"]
    assert m.requests == 40 and m.overheads == {"kv_transfer": 0.004}
    assert 50 <= m.ttft_ms_p50 <= 60 and 10 <= m.tpot_ms_p50 <= 12
    tokens = sum(r["output_tokens"] for r in records)
    span = max(r["done"] for r in records) - min(r["arrival"] for r in records)
    assert m.throughput_tok_s == pytest.approx(tokens / span)
    assert m == metrics_from_records(records, {"kv_transfer": 0.004})


def test_e2e_bad_output_is_a_clear_error():
    with pytest.raises(ValueError, match="not JSON"):
        parse_output("hello\nworld")
    with pytest.raises(ValueError, match="lacks"):
        parse_output('{"ttft_ms": 1}')
    with pytest.raises(ValueError, match="no requests"):
        parse_output('{"requests": []}')
    with pytest.raises(RuntimeError, match="exited with 3"):
        run_benchmark([sys.executable, "-c", "import sys; sys.exit(3)"])
