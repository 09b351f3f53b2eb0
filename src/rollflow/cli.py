"""``rollflow`` command line. The only place that configures logging.

Exit status: 0 done, 1 runtime failure, 2 bad config or arguments, 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import structlog

from rollflow.errors import ConfigError, RollflowError

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


def configure_logging(level: str) -> None:
    """Console rendering on a terminal, one JSON object per line otherwise; both on stderr."""
    renderer = (
        structlog.dev.ConsoleRenderer(colors=True)
        if sys.stderr.isatty()
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollflow", description="RL post-training for language models.")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log verbosity"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="train with a config (TOML files, later ones win)")
    run.add_argument("configs", nargs="*", type=Path, metavar="CONFIG", help="TOML config files")
    run.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config value, e.g. --set trainer.lr=3e-4 (repeatable; wins over files)",
    )
    run.add_argument("--dry-run", action="store_true", help="print the resolved config as JSON and exit")
    run.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its last checkpoint (its saved config, then CONFIGs and --set)",
    )
    run.add_argument("--no-progress", action="store_true", help="plain lines instead of the progress display")
    return parser


def _resolve_run_config(args: argparse.Namespace):
    from rollflow.config import load_config, read_toml_or_json

    base = None
    if args.resume is not None:
        saved = args.resume / "config.json"
        if not saved.exists():
            raise ConfigError(
                f"--resume {args.resume}: no config.json there; is it a rollflow run directory?"
            )
        base = read_toml_or_json(saved)
    elif not args.configs:
        raise ConfigError("rollflow run: give at least one CONFIG file (or --resume RUN_DIR)")
    config = load_config(args.configs, args.overrides, base=base)
    if args.resume is not None and config.run_dir.resolve() != args.resume.resolve():
        raise ConfigError(
            f"--resume {args.resume}: the resolved run directory is {config.run_dir}; "
            "do not change `name` or `output_dir` when resuming"
        )
    return config


async def _train(config, resume: bool, show_progress: bool) -> None:
    from rollflow.metrics import ProgressDisplay
    from rollflow.orchestrator import Orchestrator

    progress = ProgressDisplay(config.orchestrator.steps, interactive=None if show_progress else False)
    async with Orchestrator(config, resume=resume, sinks=[progress]) as orchestrator:
        await orchestrator.run()


def _run(args: argparse.Namespace) -> int:
    import anyio

    from rollflow.config import to_json

    config = _resolve_run_config(args)
    if args.dry_run:
        sys.stdout.write(to_json(config).decode() + "\n")
        return 0
    log = structlog.get_logger("rollflow.cli")
    log.info("starting run", name=config.name, run_dir=str(config.run_dir), resume=args.resume is not None)
    try:
        anyio.run(_train, config, args.resume is not None, not args.no_progress)
    except KeyboardInterrupt:
        sys.stderr.write(
            f"\ninterrupted: metrics and checkpoints so far are in {config.run_dir}; "
            f"continue with `rollflow run --resume {config.run_dir}`\n"
        )
        return EXIT_INTERRUPTED
    log.info("run finished", run_dir=str(config.run_dir))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        if args.command == "run":
            return _run(args)
    except ConfigError as error:
        sys.stderr.write(f"config error: {error}\n")
        return EXIT_USAGE
    except RollflowError as error:
        sys.stderr.write(f"error: {error}\n")
        return EXIT_FAILURE
    return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
