"""``python -m target_stack.bench {kda,serve,prefix}``: target_stack's benchmarks (a table and JSON)."""

from __future__ import annotations

import argparse
import pathlib
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m target_stack.bench", description=__doc__)
    sub = parser.add_subparsers(dest="bench", required=True)
    kda = sub.add_parser("kda", help="KDA decode and prefill kernels (GPU timings; CPU smoke)")
    kda.add_argument("--only", choices=["decode", "prefill", "state"],
                     help="run one part only (state: the bf16 decode state's drift over a long decode)")
    kda.add_argument("--json", type=pathlib.Path, default=pathlib.Path("bench/out/kda.json"),
                     help="where to write the JSON result (default: %(default)s)")
    serve = sub.add_parser("serve", help="serving workload: engine and disaggregated workers (TTFT, TPOT, "
                                         "throughput, KV-transfer overhead)")
    serve.add_argument("--preset", default="tiny", help="model preset (default: %(default)s)")
    from target_stack.bench.serve import DEFAULT_WORKLOAD

    serve.add_argument("--workload", default=DEFAULT_WORKLOAD,
                       help="requests=N,rate=R (req/s, 0: all at once),prompt=LO-HI,output=LO-HI,mm=SHARE,seed=S "
                            "(default: %(default)s)")
    serve.add_argument("--stages", type=int, default=2, help="Layer Split stages of the prefill worker")
    serve.add_argument("--only", choices=["engine", "disagg"], help="run one part only")
    serve.add_argument("--repeats", type=int, default=3,
                       help="alternate prefill-only and full disaggregated runs this many times (medians)")
    serve.add_argument("--disagg-device", default="cpu", choices=["cpu", "cuda"],
                       help="where the prefill and decode workers run (default: %(default)s; on cuda the native "
                            "dispatch waits for the device's routing)")
    serve.add_argument("--transfer-copy", default="gather", choices=["gather", "page", "post"],
                       help="the transfer thread's copies: a gather-scatter per cache tensor, one torch copy per "
                            "page, or one native copy per page (default: %(default)s)")
    serve.add_argument("--compare-gil", action="store_true",
                       help="also run the disaggregated part with scenarios/gil-kv-transfer.patch applied")
    serve.add_argument("--json", type=pathlib.Path, default=pathlib.Path("bench/out/serve.json"),
                       help="where to write the JSON result (default: %(default)s)")
    serve.add_argument("--print-json", action="store_true", help="print the JSON result as the last stdout line")
    prefix = sub.add_parser("prefix", help="multi-turn conversations with and without prefix reuse (TTFT per turn)")
    prefix.add_argument("--preset", default="tiny", help="model preset (default: %(default)s)")
    from target_stack.bench.prefix import DEFAULT as PREFIX_DEFAULT

    prefix.add_argument("--conversations", default=PREFIX_DEFAULT,
                        help="conversations=N,turns=N,first=LO-HI,user=LO-HI,output=N,seed=S (default: %(default)s)")
    prefix.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda when available")
    prefix.add_argument("--json", type=pathlib.Path, default=pathlib.Path("bench/out/prefix.json"),
                        help="where to write the JSON result (default: %(default)s)")
    prefix.add_argument("--print-json", action="store_true", help="print the JSON result as the last stdout line")
    args = parser.parse_args(argv)

    from rich.console import Console

    console = Console()
    if args.bench == "kda":
        from target_stack.bench.kda import run

        return run(args.json, console, args.only)
    if args.bench == "serve":
        from target_stack.bench.serve import run as run_serve

        return run_serve(args.preset, args.workload, args.stages, args.only, args.compare_gil, args.json,
                         args.print_json, console, args.repeats, args.disagg_device, args.transfer_copy)
    if args.bench == "prefix":
        from target_stack.bench.prefix import run as run_prefix

        return run_prefix(args.preset, args.conversations, args.json, console, args.device, args.print_json)
    return 2  # pragma: no cover - argparse rejects unknown benchmarks


if __name__ == "__main__":
    sys.exit(main())
