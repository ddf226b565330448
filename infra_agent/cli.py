"""The ``infra-agent`` command line."""

from __future__ import annotations

import platform
import sys

import typer
from rich.console import Console

from infra_agent import __version__

app = typer.Typer(
    name="infra-agent",
    help="Dense, local feedback for agent-assisted work on LLM inference stacks.",
    rich_markup_mode="rich",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()
err_console = Console(stderr=True)


def fail(message: str, code: int = 2) -> None:
    """Every CLI error is one clear line and a non-zero exit code."""
    err_console.print(f"[bold red]error:[/] {message}", highlight=False)
    raise typer.Exit(code)


@app.command()
def version() -> None:
    """Print the versions of infra-agent and the numerical stack it runs on."""
    import torch
    import triton

    console.print(f"infra-agent {__version__}")
    console.print(f"python {platform.python_version()}  torch {torch.__version__}  triton {triton.__version__}")
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (Triton interpreter)"
    console.print(f"device {device}")


@app.command()
def demo(
    tokens: int = typer.Option(256, "--tokens", "-t", min=16, help="sequence length of the CP demo"),
    seed: int = typer.Option(0, help="seed of the random inputs"),
) -> None:
    """Run target_stack's KDA kernels against their float64 references, then show the tf32 CP bug.

    On a CPU the kernels run in Triton's interpreter, where the tf32 merge bug only shows under
    the numerics emulation (feedback.emulation).
    """
    from infra_agent.demo import run_demo

    sys.exit(run_demo(console, tokens=tokens, seed=seed))


def main() -> None:  # pragma: no cover - console script entry point
    app()
