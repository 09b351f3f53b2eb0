"""``rollflow`` command line: parses the arguments, configures logging, dispatches to each command's entry
point (``main`` beside its component) and turns its errors into exit statuses.

Exit status: 0 done, 1 runtime failure, 2 bad config or arguments (or a run directory in use), 130
interrupted (Ctrl-C), 143 terminated (SIGTERM: ``rollflow run`` and ``generate`` stop as on Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
from pathlib import Path

import structlog

from rollflow import eventloop
from rollflow.cli_args import (
    add_http_limits,
    balance_factor,
    non_negative_int,
    port,
    positive_int,
)
from rollflow.errors import ConfigError, RollflowError, RunDirectoryInUseError
from rollflow.logs import configure_logging

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # 128 + SIGTERM, what a shell reports for a process SIGTERM ended


class _Termination:
    """SIGTERM (``timeout``, systemd, Slurm, Kubernetes) handled as Ctrl-C is: the SIGINT handler in force
    runs (asyncio's cancels the main task, so teardown and checkpoint-safe stops run; outside a loop,
    Python's raises KeyboardInterrupt), and ``received`` tells the exit status apart."""

    received = False

    @classmethod
    def install(cls) -> None:
        signal.signal(signal.SIGTERM, cls._handle)

    @classmethod
    def _handle(cls, signum: int, frame: object) -> None:
        cls.received = True
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):
            handler(signal.SIGINT, frame)
        else:  # SIGINT ignored or default: still stop
            raise KeyboardInterrupt

    @classmethod
    def exit_status(cls) -> int:
        return EXIT_TERMINATED if cls.received else EXIT_INTERRUPTED


def _add_overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one config value, e.g. --set trainer.lr=3e-4 (repeatable; wins over files)",
    )


def _parser() -> argparse.ArgumentParser:
    from rollflow.config.server_spec import add_serve_arguments

    parser = argparse.ArgumentParser(prog="rollflow", description="RL post-training for language models.")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log verbosity"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser("run", help="train with a config (TOML files, later ones win)")
    run.add_argument("configs", nargs="*", type=Path, metavar="CONFIG", help="TOML config files")
    _add_overrides(run)
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config as JSON (and, with cluster.backend = 'ray', the placement plan on stderr) "
        "and exit",
    )
    run.add_argument(
        "--resume",
        type=Path,
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR from its last checkpoint, or from step 0 if it has none yet (its "
        "latest saved config, then CONFIGs and --set)",
    )
    run.add_argument(
        "--force",
        action="store_true",
        help="with --resume: accept a config that changes what the run means (model, task, data, "
        "samples_per_prompt, seeds)",
    )
    run.add_argument("--no-progress", action="store_true", help="plain lines instead of the progress display")

    serve = commands.add_parser(
        "serve", help="torch engine server speaking vLLM's HTTP API (prints a JSON ready line)"
    )
    serve.add_argument(
        "--model",
        required=True,
        metavar="PATH",
        help="rollflow:tiny, a local HF model directory or a cached name",
    )
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    serve.add_argument(
        "--port", type=port, default=8000, help="port to bind; 0 picks a free one (default 8000)"
    )
    add_serve_arguments(serve)  # the options rollflow sets on the servers it starts (``ServerSpec``)
    serve.add_argument(
        "--served-model-name", default=None, help="the model name clients send (default: --model)"
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help="bearer token every endpoint but /health and /metrics requires (default: $ROLLFLOW_API_KEY, "
        "else none)",
    )
    serve.add_argument(
        "--logprobs-mode",
        choices=["processed_logprobs", "raw_logprobs"],
        default="processed_logprobs",
        help="vLLM's flag: processed_logprobs (default) reports the logprob of the distribution each token was "
        "drawn from (after temperature and top-k/top-p), what the trainer recomputes; raw_logprobs reports "
        "log_softmax(logits) before both, like a vLLM started without the flag (for tests)",
    )
    serve.add_argument(
        "--adapter-versions",
        type=non_negative_int,
        default=0,
        help="LoRA adapter versions kept unmerged, each request decoding to its end on the version it started "
        "on; 0 (default) merges each adapter push into the weights served",
    )
    serve.add_argument(
        "--max-request-sequences",
        type=positive_int,
        default=256,
        help="most sequences (prompts x n) one generation request may ask for; more is a 400 (default 256)",
    )
    serve.add_argument(
        "--max-request-tokens",
        type=positive_int,
        default=2**19,
        help="most tokens (over its sequences, prompt tokens plus max_tokens) one generation request may ask "
        f"for; more is a 400 (default {2**19})",
    )
    add_http_limits(serve)

    router = commands.add_parser(
        "router", help="session-aware HTTP router in front of inference servers (prints a JSON ready line)"
    )
    router.add_argument(
        "--server",
        dest="servers",
        action="append",
        default=[],
        metavar="URL",
        help="base URL of an inference server, e.g. http://127.0.0.1:8000 (repeatable)",
    )
    router.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    router.add_argument(
        "--port", type=port, default=8080, help="port to bind; 0 picks a free one (default 8080)"
    )
    router.add_argument(
        "--health-check-interval-s", type=float, default=2.0, help="seconds between health probes (default 2)"
    )
    router.add_argument(
        "--request-timeout-s",
        type=float,
        default=600.0,
        help="longest one proxied request may take (default 600)",
    )
    router.add_argument(
        "--balance-factor",
        type=balance_factor,
        default=1.0,
        help="a new session goes to the first server on its consistent-hash ring walk holding fewer than "
        "ceil(balance_factor x (pinned sessions + 1) / healthy servers); 1.0 (default) keeps servers within "
        "one session of each other, larger values come closer to plain consistent hashing",
    )
    router.add_argument(
        "--max-request-sequences",
        type=positive_int,
        default=256,
        help="most sequences (prompts x n) one generation request may ask for; more is a 400 before any "
        "server sees it (default 256, as rollflow serve)",
    )
    router.add_argument(
        "--api-key",
        default=None,
        help="bearer token every endpoint but /health and /metrics requires, also sent to the servers "
        "(default: $ROLLFLOW_API_KEY, else none)",
    )
    add_http_limits(router)

    proxy = commands.add_parser(
        "proxy",
        help="standalone TITO proxy over the config's [inference] (prints a JSON ready line)",
    )
    proxy.add_argument(
        "configs", nargs="+", type=Path, metavar="CONFIG", help="rollflow run TOML files (model, inference)"
    )
    _add_overrides(proxy)
    proxy.add_argument("--host", default=None, help="interface to bind (default agent.host, 127.0.0.1)")
    proxy.add_argument(
        "--port", type=port, default=None, help="port to bind; 0 picks a free one (default agent.port, 0)"
    )

    _add_artifact_commands(commands)

    generate = commands.add_parser(
        "generate",
        help="generate only: run the configured generator (agent or single-turn) and write samples as JSONL",
    )
    generate.add_argument("configs", nargs="+", type=Path, metavar="CONFIG", help="TOML config files")
    _add_overrides(generate)
    generate.add_argument(
        "--output",
        default=None,
        metavar="PATH",
        help="JSONL file (default {run_dir}/samples.jsonl; - for stdout)",
    )
    generate.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        metavar="N",
        help="prompts to generate (default prompts_per_step)",
    )
    generate.add_argument(
        "--checkpoint",
        default=None,
        metavar="PATH",
        help="sample from a training checkpoint: its directory, or a run directory for its latest "
        "(default: the initial weights)",
    )
    trace = commands.add_parser("trace", help="render one saved agent trace of a run as an HTML page")
    trace.add_argument("run_dir", type=Path, metavar="RUN", help="a run directory (runs/NAME)")
    trace.add_argument("--session", default=None, help="the session id (default: the first trace that forks)")
    trace.add_argument("--prompt", type=int, default=None, help="a trace of this prompt index")
    trace.add_argument(
        "--output", type=Path, default=None, help="HTML file (default RUN/traces/SESSION.html)"
    )

    evaluate = commands.add_parser(
        "eval",
        help="held-out evaluation ([eval]) of the initial weights or a checkpoint; prints eval/* as JSON",
    )
    evaluate.add_argument("configs", nargs="+", type=Path, metavar="CONFIG", help="TOML config files")
    _add_overrides(evaluate)
    evaluate.add_argument(
        "--checkpoint",
        default=None,
        metavar="RUN",
        help="evaluate a training checkpoint: its directory, or a run directory for its latest "
        "(default: the initial weights)",
    )
    return parser


def _eval(args: argparse.Namespace) -> int:
    import json

    from rollflow.config import load_config
    from rollflow.orchestrator.offline import evaluate_offline

    config = load_config(args.configs, args.overrides)
    try:
        metrics = eventloop.run(evaluate_offline(config, checkpoint=args.checkpoint))
    except KeyboardInterrupt:
        return _Termination.exit_status()
    sys.stdout.write(json.dumps(metrics) + "\n")
    return 0


def _generate(args: argparse.Namespace) -> int:
    import json

    from rollflow.config import load_config
    from rollflow.orchestrator.offline import generate_samples

    config = load_config(args.configs, args.overrides)
    num_prompts = config.orchestrator.prompts_per_step if args.num_prompts is None else args.num_prompts
    try:
        summary = eventloop.run(
            generate_samples(config, num_prompts=num_prompts, output=args.output, checkpoint=args.checkpoint)
        )
    except KeyboardInterrupt:
        return _Termination.exit_status()
    sys.stderr.write(json.dumps({"event": "generated", **summary}) + "\n")
    return 0


def _resolve_run_config(args: argparse.Namespace):
    from rollflow.config import load_config, read_toml_or_json
    from rollflow.orchestrator.run_dir import CONFIG_FILE, latest_config

    base = None
    if args.resume is not None:
        saved = latest_config(args.resume)
        if saved is None:
            raise ConfigError(
                f"--resume {args.resume}: no {CONFIG_FILE} there; is it a rollflow run directory?"
            )
        base = read_toml_or_json(saved)
    elif not args.configs:
        raise ConfigError("rollflow run: give at least one CONFIG file (or --resume RUN_DIR)")
    elif args.force:
        raise ConfigError("rollflow run: --force only applies with --resume RUN_DIR")
    config = load_config(args.configs, args.overrides, base=base)
    if args.resume is not None and config.run_dir.resolve() != args.resume.resolve():
        raise ConfigError(
            f"--resume {args.resume}: the resolved run directory is {config.run_dir}; "
            "do not change `name` or `output_dir` when resuming"
        )
    return config


def _steps_left(config) -> bool:
    """For a resume: whether steps are left to train; says so when none are.

    Raises:
        ConfigError: ``orchestrator.steps`` is below the step the run's last checkpoint reached.
    """
    from rollflow.orchestrator.checkpoint import latest_checkpoint, load_state

    checkpoint = latest_checkpoint(config.run_dir)
    if checkpoint is None:
        return True
    done, steps = load_state(checkpoint).step, config.orchestrator.steps
    if steps < done:
        raise ConfigError(
            f"--resume {config.run_dir}: orchestrator.steps = {steps} is below the {done} steps the run has "
            f"done (checkpoint {checkpoint}): nothing to resume. To train further, resume with "
            f"--set orchestrator.steps=N, N > {done}"
        )
    if steps == done:
        sys.stderr.write(
            f"nothing to do: {config.run_dir} has done all its orchestrator.steps = {steps} steps "
            f"(checkpoint {checkpoint}). To train further, resume with --set orchestrator.steps=N, N > {done}\n"
        )
        return False
    return True


async def _train(config, resume: bool, force: bool, show_progress: bool) -> None:
    from rollflow.metrics import ProgressDisplay
    from rollflow.orchestrator import Orchestrator

    progress = ProgressDisplay(config.orchestrator.steps, interactive=None if show_progress else False)
    async with Orchestrator(config, resume=resume, force=force, sinks=[progress]) as orchestrator:
        # Set up (models, engines, trainer loaded): an older-generation collection would walk all of that in
        # the middle of a step, a stall of ~0.1 s on the tiny model's process that halts generation with it.
        eventloop.tune_gc_for_serving()
        await orchestrator.run()


def _run(args: argparse.Namespace) -> int:
    from rollflow.config import to_json
    from rollflow.orchestrator.run_dir import check_unlocked

    config = _resolve_run_config(args)
    if args.dry_run:
        sys.stdout.write(to_json(config).decode() + "\n")
        if config.cluster.backend == "ray":
            from rollflow.launch.ray_cluster import dry_run_plan

            sys.stderr.write(dry_run_plan(config).describe() + "\n")
        return 0
    resume = args.resume is not None
    check_unlocked(config.run_dir)
    if resume and not _steps_left(config):
        return 0
    log = structlog.get_logger("rollflow.cli")
    log.info("starting run", name=config.name, run_dir=str(config.run_dir), resume=resume)
    try:
        eventloop.run(_train(config, resume, args.force, not args.no_progress))
    except KeyboardInterrupt:
        what = "terminated (SIGTERM)" if _Termination.received else "interrupted"
        sys.stderr.write(
            f"\n{what}: metrics and checkpoints so far are in {config.run_dir}; "
            f"continue with `rollflow run --resume {config.run_dir}`\n"
        )
        return _Termination.exit_status()
    log.info("run finished", run_dir=str(config.run_dir))
    return 0


def _router(args: argparse.Namespace) -> int:
    from rollflow.inference.router_main import main as router_main

    try:
        return router_main(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except OSError as error:
        sys.stderr.write(f"error: rollflow router could not listen on {args.host}:{args.port}: {error}\n")
        return EXIT_FAILURE


def _proxy(args: argparse.Namespace) -> int:
    from rollflow.errors import ModelNotFoundError
    from rollflow.orchestrator.proxy_main import main as proxy_main

    try:
        return proxy_main(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except ModelNotFoundError as error:  # an OSError too: not the port's fault
        configs = " ".join(map(str, args.configs))
        raise ConfigError(f"rollflow proxy {configs}: model.path: {error}") from None


def _trace(args: argparse.Namespace) -> int:
    from rollflow.tito.trace_page import write_trace_page

    try:
        path = write_trace_page(args.run_dir, session=args.session, prompt=args.prompt, output=args.output)
    except (FileNotFoundError, LookupError, ValueError) as error:
        sys.stderr.write(f"error: rollflow trace {args.run_dir}: {error}\n")
        return EXIT_USAGE
    sys.stdout.write(f"{path}\n")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from rollflow.errors import ModelNotFoundError
    from rollflow.inference.engine.server_main import main as serve_main

    try:
        return serve_main(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except ModelNotFoundError as error:  # an OSError too: not the port's fault
        raise ConfigError(f"rollflow serve --model {args.model}: {error}") from None
    except ValueError as error:
        raise ConfigError(f"rollflow serve: {error}") from None
    except OSError as error:
        sys.stderr.write(f"error: rollflow serve could not listen on {args.host}:{args.port}: {error}\n")
        return EXIT_FAILURE


def _add_artifact_commands(commands: argparse._SubParsersAction) -> None:
    """``export``, ``config`` and ``plot``: what a run leaves behind made usable, and the config reference."""
    export = commands.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face model directory (from_pretrained, vllm serve)",
    )
    export.add_argument("run", type=Path, metavar="RUN", help="a run directory (or one checkpoint directory)")
    export.add_argument("out", type=Path, metavar="OUT", help="the directory to write (must be empty or new)")
    export.add_argument(
        "--step", type=int, default=None, metavar="N", help="the checkpoint of step N (default the latest)"
    )
    export.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="dtype of the written weights (default auto: the checkpoint's)",
    )
    export.add_argument("--force", action="store_true", help="replace OUT when it exists and is not empty")
    export.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run's checkpoint: merge the adapter into its base model (default: the PEFT adapter dir)",
    )
    export.add_argument(
        "--push-to-hub",
        default=None,
        metavar="REPO_ID",
        help="then upload OUT to this Hugging Face Hub model repository (private; needs a token and network)",
    )

    config = commands.add_parser("config", help="the config reference: every key, its default and meaning")
    config.add_argument(
        "--explain",
        nargs="?",
        const="",
        default="",
        metavar="KEY",
        help="a key (trainer.lr) or section (trainer) to explain (default: every key)",
    )

    plot = commands.add_parser(
        "plot", help="write PNG figures of runs' metrics.jsonl (reward, loss, KL, staleness, timings, ...)"
    )
    plot.add_argument(
        "runs", nargs="+", type=Path, metavar="RUN", help="run directories (several: compared on one figure)"
    )
    plot.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="DIR",
        help="where the PNGs go (default RUN/plots for one run, ./plots for several)",
    )


def _config(args: argparse.Namespace) -> int:
    from rollflow.config_docs import explain

    sys.stdout.write(explain(args.explain or None))
    return 0


def _plot(args: argparse.Namespace) -> int:
    import json

    from rollflow.plots import plot_runs

    out = args.out
    if out is None:
        out = args.runs[0] / "plots" if len(args.runs) == 1 and args.runs[0].is_dir() else Path("plots")
    written = plot_runs(args.runs, out)
    sys.stdout.write(
        json.dumps({"event": "plotted", "out": str(out), "files": [p.name for p in written]}) + "\n"
    )
    return 0


def _export(args: argparse.Namespace) -> int:
    import json

    from rollflow.orchestrator.export import export_checkpoint, push_to_hub

    result = export_checkpoint(
        args.run, args.out, step=args.step, dtype=args.dtype, force=args.force, merge=args.merge
    )
    if args.push_to_hub:
        result["pushed"] = push_to_hub(args.out, args.push_to_hub)
    sys.stdout.write(json.dumps({"event": "exported", **result}) + "\n")
    return 0


_ARTIFACT_COMMANDS = {"export": _export, "plot": _plot, "config": _config}


def main(argv: list[str] | None = None) -> int:
    """Run one ``rollflow`` command; returns its exit status (see the module docstring).

    As the process's entry point (``argv`` None: the ``rollflow`` script, ``python -m rollflow``), when the
    command leaves user callbacks behind that are still running (a reward abandoned past
    ``data.reward_timeout_s`` or at Ctrl-C/SIGTERM: its thread cannot be killed, and an ordinary exit would
    wait for it), the process ends at once with ``os._exit`` once its output is flushed; and glibc's malloc
    arenas are limited first (``limit_malloc_arenas``). Called with ``argv`` (from Python), it returns as
    usual and changes neither.
    """
    from rollflow.malloc_arenas import limit_malloc_arenas
    from rollflow.rollout.callbacks import abandoned_calls

    if argv is not None:
        return _main(argv)
    # The process is ours: few malloc arenas, before any thread starts (rollflow.malloc_arenas says why).
    limit_malloc_arenas()
    try:
        status = _main(argv)
    except BaseException as error:
        if not abandoned_calls():
            raise
        if isinstance(error, SystemExit):
            status = error.code if isinstance(error.code, int) else EXIT_FAILURE
        else:
            import traceback

            traceback.print_exc()
            status = EXIT_INTERRUPTED if isinstance(error, KeyboardInterrupt) else EXIT_FAILURE
    if abandoned_calls():
        _exit_now(status)
    return status


def _exit_now(status: int) -> None:
    """End the process without joining the threads of abandoned callbacks (they cannot be stopped)."""
    from rollflow.rollout.callbacks import abandoned_calls

    sys.stderr.write(
        f"exiting without waiting for {abandoned_calls()} abandoned user callback call(s) still running "
        "(a reward past data.reward_timeout_s, or one the stop cut off)\n"
    )
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def _main(argv: list[str] | None) -> int:
    # Background jobs of non-interactive shells start with SIGINT ignored; `kill -INT` (Ctrl-C) must still
    # stop a run cleanly.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    args = _parser().parse_args(argv)
    configure_logging(args.log_level)
    if args.command in ("run", "generate", "eval"):
        _Termination.install()
    try:
        if args.command in _ARTIFACT_COMMANDS:
            return _ARTIFACT_COMMANDS[args.command](args)
        if args.command == "run":
            return _run(args)
        if args.command == "serve":
            return _serve(args)
        if args.command == "router":
            return _router(args)
        if args.command == "proxy":
            return _proxy(args)
        if args.command == "generate":
            return _generate(args)
        if args.command == "trace":
            return _trace(args)
        if args.command == "eval":
            return _eval(args)
    except ConfigError as error:
        sys.stderr.write(f"config error: {error}\n")
        return EXIT_USAGE
    except RunDirectoryInUseError as error:
        sys.stderr.write(f"error: {error}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:  # before or after the event loop (inside it, each command has its own)
        sys.stderr.write("\ninterrupted\n")
        return _Termination.exit_status()
    except RollflowError as error:
        sys.stderr.write(f"error: {error}\n")
        return EXIT_FAILURE
    return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
