"""``python -m target_stack.bench kda [--json FILE]``: target_stack's benchmarks (table + JSON)."""

from __future__ import annotations

import argparse
import pathlib
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m target_stack.bench", description=__doc__)
    sub = parser.add_subparsers(dest="bench", required=True)
    kda = sub.add_parser("kda", help="KDA decode and prefill kernels (GPU timings; CPU smoke)")
    kda.add_argument("--json", type=pathlib.Path, default=pathlib.Path("bench/out/kda.json"),
                     help="where to write the JSON result (default: %(default)s)")
    args = parser.parse_args(argv)

    from rich.console import Console

    console = Console()
    if args.bench == "kda":
        from target_stack.bench.kda import run

        return run(args.json, console)
    return 2  # pragma: no cover - argparse rejects unknown benchmarks


if __name__ == "__main__":
    sys.exit(main())
