"""Datasets as prompts: JSONL, parquet and split directories, TRL/verl layouts, dotted keys, epochs, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollflow import load_config
from rollflow.errors import ConfigError
from rollflow.rollout.datasets import DatasetTask, read_rows, steps_for_epochs, task_from_config
from rollflow.rollout.tasks import CaseTask

from .helpers.data import case_rows, write_jsonl, write_parquet


def data_config(tmp_path: Path, *overrides: str):
    return load_config([], [f"output_dir='{tmp_path}'", *overrides]).data


def test_jsonl_and_parquet_read_the_same_rows(tmp_path):
    rows = case_rows(5)
    assert read_rows(str(write_jsonl(tmp_path / "d.jsonl", rows))) == rows
    assert read_rows(str(write_parquet(tmp_path / "d.parquet", rows))) == rows


def test_trl_conversational_and_verl_layouts_read_without_conversion(tmp_path):
    trl = [
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
            "answer": "4",
        }
    ]
    task = task_from_config(data_config(tmp_path, f"data.path='{write_jsonl(tmp_path / 't.jsonl', trl)}'"))
    assert task.item(0).messages == trl[0]["prompt"]
    assert task.item(0).answer == "4"
    verl = [
        {
            "data_source": "gsm8k",
            "prompt": [{"role": "user", "content": "1+1?"}],
            "reward_model": {"style": "rule", "ground_truth": "2"},
        }
    ]
    (tmp_path / "verl").mkdir()
    write_parquet(tmp_path / "verl" / "test.parquet", verl)
    data = data_config(tmp_path, f"data.path='{tmp_path / 'verl'}'", "data.split='test'")
    item = task_from_config(data).item(0)
    assert item.messages == [{"role": "user", "content": "1+1?"}]
    assert item.answer == "2"  # reward_model.ground_truth, found without data.answer_key


def test_dotted_keys_reach_nested_columns(tmp_path):
    rows = [{"q": {"text": "hi"}, "meta": {"gold": {"value": 7}}}]
    path = write_jsonl(tmp_path / "n.jsonl", rows)
    data = data_config(
        tmp_path, f"data.path='{path}'", "data.prompt_key='q.text'", "data.answer_key='meta.gold.value'"
    )
    item = task_from_config(data).item(0)
    assert item.messages == [{"role": "user", "content": "hi"}]
    assert item.answer == 7


def test_each_epoch_visits_every_row_once_in_its_own_order(tmp_path):
    task = DatasetTask(case_rows(7), seed=3)
    epochs = [[task.item(e * 7 + i).metadata["row"] for i in range(7)] for e in range(3)]
    assert all(sorted(order) == list(range(7)) for order in epochs)
    assert epochs[0] != epochs[1] or epochs[1] != epochs[2]  # shuffled afresh per epoch
    again = DatasetTask(case_rows(7), seed=3)
    assert [again.item(i).metadata["row"] for i in range(21)] == [r for order in epochs for r in order]
    unshuffled = DatasetTask(case_rows(7), seed=3, shuffle=False)
    assert [unshuffled.item(i).metadata["row"] for i in range(7)] == list(range(7))
    assert steps_for_epochs(2, 7, 4) == 4


def test_unknown_column_lists_the_columns(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "meta": {"a": 1}}])
    with pytest.raises(ConfigError, match=r"data.prompt_key = 'prompt'.*question, meta, meta.a"):
        task_from_config(data_config(tmp_path, f"data.path='{path}'"))
    with pytest.raises(ConfigError, match=r"data.answer_key = 'gold'.*question, meta, meta.a"):
        task_from_config(
            data_config(
                tmp_path, f"data.path='{path}'", "data.prompt_key='question'", "data.answer_key='gold'"
            )
        )


def test_bad_rows_fail_naming_the_row_or_are_counted_and_skipped(tmp_path):
    rows = [
        {"prompt": "a", "answer": 1},
        {"prompt": 5, "answer": 2},
        {"prompt": "c"},
        {"prompt": "d", "answer": 4},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(ConfigError, match=r"row 1: 'prompt' is missing or neither.*on_bad_row = 'skip'"):
        task_from_config(data_config(tmp_path, f"data.path='{path}'"))
    task = task_from_config(data_config(tmp_path, f"data.path='{path}'", "data.on_bad_row='skip'"))
    assert task.skipped == 2
    assert sorted(task.rows) == [0, 3]


@pytest.mark.parametrize(
    ("make", "split", "message"),
    [
        (lambda d: d / "missing.jsonl", None, "no such file"),
        (lambda d: write_jsonl(d / "empty.jsonl", []), None, "empty"),
        (lambda d: (d / "x.csv").write_text("a,b\n") and d / "x.csv", None, "unknown data format '.csv'"),
        (
            lambda d: (d / "bad.jsonl").write_text('{"prompt": "a"}\n{oops\n') and d / "bad.jsonl",
            None,
            "line 2",
        ),
        (
            lambda d: write_jsonl(d / "one.jsonl", case_rows(1)),
            "test",
            "data.split = 'test' applies to a directory",
        ),
        (lambda d: d, "dev", "neither dev.jsonl nor dev.parquet"),
    ],
)
def test_bad_data_paths_are_clear_errors(tmp_path, make, split, message):
    path = make(tmp_path)
    overrides = [f"data.path='{path}'"] + ([f"data.split='{split}'"] if split else [])
    with pytest.raises(ConfigError, match=message):
        task_from_config(data_config(tmp_path, *overrides))


def test_saved_datasets_directory_and_its_splits(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = case_rows(4)
    saved = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(case_rows(2, seed=1))}
    )
    saved.save_to_disk(str(tmp_path / "saved"))
    assert read_rows(str(tmp_path / "saved")) == rows  # train by default
    assert read_rows(str(tmp_path / "saved"), "test") == case_rows(2, seed=1)
    with pytest.raises(ConfigError, match="the splits are train, test"):
        read_rows(str(tmp_path / "saved"), "dev")


def test_hf_name_missing_from_the_local_cache_is_a_clear_error(tmp_path, monkeypatch):
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(ConfigError, match="hf:nobody/nothing' is not in the local HF datasets cache"):
        read_rows("hf:nobody/nothing")


def test_saved_dataset_without_the_datasets_library_names_the_install(tmp_path, monkeypatch):
    import sys

    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "dataset_dict.json").write_text('{"splits": ["train"]}')
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(ConfigError, match="pip install datasets"):
        read_rows(str(tmp_path / "saved"))
    with pytest.raises(ConfigError, match="pip install datasets"):
        read_rows("hf:openai/gsm8k")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.epochs=2"], "data.epochs = 2 counts passes over a dataset"),
        (["data.reward='math'", "data.rewards=[{fn='exact'}]"], "data.reward = 'math' and data.rewards"),
        (["data.on_bad_row='ignore'"], "data.on_bad_row"),
        (["data.rewards=[{weight=1.0}]"], "fn"),
        (["data.path='x.jsonl'", "data.args={a=1}"], r"\[data.args\] is for custom task factories"),
    ],
)
def test_data_config_errors_name_the_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config([], [f"output_dir='{tmp_path}'", *overrides])


def make_task(seed: int, scale: int = 1):
    return CaseTask(seed + scale)


def test_data_args_reach_a_custom_task_factory(tmp_path):
    data = data_config(
        tmp_path, "data.task='tests.test_datasets:make_task'", "data.args={scale=5}", "data.seed=1"
    )
    assert task_from_config(data).seed == 6
    data = data_config(tmp_path, "data.task='tests.test_datasets:make_task'", "data.args={nope=5}")
    with pytest.raises(ConfigError, match=r"\[data.args\] \(nope\) failed"):
        task_from_config(data)
