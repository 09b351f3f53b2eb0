"""``[logging] backends``: a real run writes TensorBoard event files, an offline wandb run and an MLflow file
store, each read back with its own reader; samples tables; bad config and missing packages are clear errors."""

from __future__ import annotations

import asyncio
import glob
import json
import socket
import struct
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rollflow import Orchestrator, load_config
from rollflow.errors import ConfigError
from rollflow.tracking import SAMPLE_COLUMNS, check_backends

# Whole runs, whose config takes $ROLLFLOW_INFERENCE_MODE (the tracked runs): the http pass runs them over HTTP.
pytestmark = pytest.mark.follows_mode

STEPS = 2


def run_config(tmp_path, *overrides: str):
    return load_config(
        [],
        [
            f"output_dir='{tmp_path / 'runs'}'",
            "name=tracked",
            f"orchestrator.steps={STEPS}",
            "orchestrator.prompts_per_step=2",
            "sampling.samples_per_prompt=2",
            "sampling.max_tokens=4",
            "data.task='digit'",
            "inference.router_port=0",  # runs in http mode start a router; tests run side by side
            *overrides,
        ],
    )


async def train(config) -> None:
    async with Orchestrator(config) as orchestrator:
        await orchestrator.run()


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, monkeypatch_module):
    tmp_path = tmp_path_factory.mktemp("tracked")
    # wandb reads its settings from the environment too: keep it away from ~/.config and the network.
    monkeypatch_module.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch_module.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch_module.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch_module.setenv("WANDB_SILENT", "true")
    config = run_config(
        tmp_path,
        "logging.backends=['jsonl', 'tensorboard', 'wandb', 'mlflow']",
        "logging.samples_every=2",
        "logging.samples_max=3",
    )
    asyncio.run(train(config))
    metrics = [json.loads(line) for line in (config.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    return config.run_dir, metrics


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.mark.slow
def test_tensorboard_event_files_read_back(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, metrics = tracked_run
    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    for key in ("reward_mean", "loss", "tokens_per_s", "logprob_mismatch"):
        scalars = events.Scalars(key)
        assert [s.step for s in scalars] == [m["step"] for m in metrics], key
        assert [s.value for s in scalars] == pytest.approx([m[key] for m in metrics], rel=1e-6), key
    # One samples table, at step 2 (samples_every = 2), as Markdown text.
    (text,) = events.Tensors("samples/text_summary")
    assert text.step == 2
    table = text.tensor_proto.string_val[0].decode()
    assert table.startswith("| " + " | ".join(SAMPLE_COLUMNS)) and len(table.splitlines()) == 2 + 3


def read_wandb_records(path):
    """The protobuf records of a wandb transaction log (``run-*.wandb``): a 7-byte header, then LevelDB-log
    style 32 KiB blocks of chunks (crc32, length, type: full, first, middle, last)."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    block, position, pending, records = 32768, 7, b"", []
    while position + 7 <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if left < 7 or (kind == 0 and length == 0):
            position += left
            continue
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_offline_wandb_run_reads_back(tracked_run):
    run_dir, metrics = tracked_run
    (log_file,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    records = read_wandb_records(log_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.display_name == "tracked"
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert [h["_step"] for h in history] == [m["step"] for m in metrics]
    for key in ("reward_mean", "tokens_per_s", "loss"):
        assert [h[key] for h in history] == pytest.approx([m[key] for m in metrics]), key
    # The samples table of step 2, written as a wandb table file.
    (table_file,) = glob.glob(
        str(run_dir / "wandb" / "offline-run-*" / "files" / "media" / "table" / "*.json")
    )
    table = json.loads(Path(table_file).read_text())
    assert table["columns"] == list(SAMPLE_COLUMNS) and len(table["data"]) == 3
    assert all(row[0] == 2 for row in table["data"])


def test_mlflow_local_store_reads_back(tracked_run):
    from mlflow.tracking import MlflowClient

    run_dir, metrics = tracked_run
    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir.absolute() / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("rollflow")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    assert run.data.params["orchestrator.steps"] == str(STEPS)
    for key in ("reward_mean", "tokens_per_s", "loss"):
        history = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        assert [m.step for m in history] == [m["step"] for m in metrics], key
        assert [m.value for m in history] == pytest.approx([m[key] for m in metrics]), key
    assert (run_dir / "mlartifacts").is_dir()
    samples = json.loads(
        Path(client.download_artifacts(run.info.run_id, "samples/step_000002.json")).read_text()
    )
    assert len(samples) == 3 and set(samples[0]) == set(SAMPLE_COLUMNS)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("logging.backends=['jsonl', 'comet']", "logging.backends"),
        ("logging.samples_every=-1", "logging.samples_every"),
        ("logging.samples_max=0", "logging.samples_max"),
        ("logging.wandb_mode='cloud'", "logging.wandb_mode"),
    ],
)
def test_bad_logging_values_name_the_key(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message):
        run_config(tmp_path, override)


def test_missing_package_and_duplicates_are_clear_errors(tmp_path, monkeypatch):
    import rollflow.tracking

    monkeypatch.setitem(rollflow.tracking._PACKAGES, "wandb", ("rollflow_no_such_wandb", "pip install wandb"))
    config = run_config(tmp_path, "logging.backends=['wandb']")
    with pytest.raises(ConfigError, match=r"logging.backends includes 'wandb'.*pip install wandb"):
        check_backends(config)
    # ... and the run refuses before loading anything or writing its run directory.
    with pytest.raises(ConfigError, match="pip install wandb"):
        asyncio.run(train(config))
    assert not (config.run_dir / "config.json").exists()
    with pytest.raises(ConfigError, match="more than once"):
        check_backends(run_config(tmp_path, "logging.backends=['tensorboard', 'tensorboard']"))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_prometheus_endpoint_serves_the_latest_step_while_the_run_lives(tmp_path):
    port = free_port()
    config = run_config(tmp_path, f"logging.prometheus_port={port}")
    url = f"http://127.0.0.1:{port}/metrics"

    async def scenario():
        orchestrator = await Orchestrator.start(config)
        try:
            assert await asyncio.to_thread(scrape, url) == {}  # no step yet
            scraped = []
            for _ in range(STEPS):
                (metrics,) = await orchestrator.run(steps=1)
                scraped.append((metrics, await asyncio.to_thread(scrape, url)))
        finally:
            await orchestrator.stop()
        return scraped

    for metrics, values in asyncio.run(scenario()):
        assert values["rollflow_step"] == metrics["step"]
        for key in ("reward_mean", "loss", "tokens_per_s", "staleness_mean"):
            assert values[f"rollflow_{key}"] == pytest.approx(metrics[key]), key
    with pytest.raises(urllib.error.URLError):  # closed with the run
        scrape(url)


def test_prometheus_port_in_use_is_a_clear_error(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"logging.prometheus_port = {port}: cannot listen"):
            asyncio.run(train(run_config(tmp_path, f"logging.prometheus_port={port}")))


def history_steps(log_file) -> list[dict]:
    records = read_wandb_records(log_file)
    return [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_wandb_and_mlflow_runs(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    for name, value in (
        ("DIR", tmp_path),
        ("CONFIG_DIR", tmp_path / "cfg"),
        ("CACHE_DIR", tmp_path / "cache"),
    ):
        monkeypatch.setenv(f"WANDB_{name}", str(value))
    monkeypatch.setenv("WANDB_SILENT", "true")
    config = run_config(
        tmp_path,
        "orchestrator.steps=4",
        "checkpoint.every=2",
        "logging.backends=['jsonl', 'wandb', 'mlflow']",
        "logging.samples_every=1",
        "logging.samples_max=1",
    )

    async def scenario():
        async with Orchestrator(config) as orchestrator:
            first = await orchestrator.run(steps=3)  # checkpoint at step 2; step 3 is redone after the resume
        async with Orchestrator(config, resume=True) as orchestrator:
            assert orchestrator.state.step == 2
            second = await orchestrator.run()
        return first, second

    first, second = asyncio.run(scenario())
    assert [m["step"] for m in first] == [1, 2, 3] and [m["step"] for m in second] == [3, 4]
    # What the tracked curves hold: each step once, the redone step 3 with its first values.
    logged = first + second[1:]

    # wandb: one run id over both processes (an offline directory each, joined by `wandb sync`); the second
    # logs no step at or below the first's last one, which wandb would drop.
    directories = sorted(glob.glob(str(config.run_dir / "wandb" / "offline-run-*")))
    assert len(directories) == 2
    run_ids = set()
    history = []
    for directory in directories:
        (log_file,) = glob.glob(f"{directory}/run-*.wandb")
        records = read_wandb_records(log_file)
        run_ids |= {r.run.run_id for r in records if r.WhichOneof("record_type") == "run"}
        history.append(history_steps(log_file))
    assert len(run_ids) == 1 and run_ids == {
        json.loads((config.run_dir / "wandb_run.json").read_text())["id"]
    }
    assert [[h["_step"] for h in part] for part in history] == [[1, 2, 3], [4]]
    assert [h["reward_mean"] for part in history for h in part] == pytest.approx(
        [m["reward_mean"] for m in logged]
    )
    tables = glob.glob(
        str(config.run_dir / "wandb" / "offline-run-*" / "files" / "media" / "table" / "*.json")
    )
    assert len(tables) == 4, "a samples table per step, the redone step's once"

    # MLflow: one run, finished, each step once.
    client = MlflowClient(tracking_uri=f"sqlite:///{config.run_dir.absolute() / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("rollflow").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.info.run_id == json.loads((config.run_dir / "mlflow_run.json").read_text())["run_id"]
    for key in ("reward_mean", "loss"):
        points = sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.step)
        assert [p.step for p in points] == [1, 2, 3, 4], key
        assert [p.value for p in points] == pytest.approx([m[key] for m in logged]), key

    # A new run in another directory starts new tracking runs.
    other = run_config(tmp_path, "name=other", "logging.backends=['jsonl', 'mlflow']")
    asyncio.run(train(other))
    assert json.loads((other.run_dir / "mlflow_run.json").read_text())["run_id"] != run.info.run_id
