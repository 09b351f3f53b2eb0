"""``rollflow config --explain``: the reference is generated from the field docs of the rollflow.config modules."""

from __future__ import annotations

import msgspec
import pytest

from rollflow.cli import main
from rollflow.config import RunConfig, to_dict
from rollflow.config_docs import config_reference, explain
from rollflow.errors import ConfigError


def test_reference_covers_every_key_with_its_default():
    reference = {doc.key: doc for doc in config_reference()}
    defaults = to_dict(RunConfig())

    def leaves(data, prefix=""):
        for key, value in data.items():
            if isinstance(value, dict) and value:
                yield from leaves(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    for key, value in leaves(defaults):
        assert key in reference, key
        assert msgspec.to_builtins(reference[key].default) == value, key
    assert "Peak AdamW learning rate" in reference["trainer.lr"].doc
    assert reference["logging.samples_every"].type == "int >= 0"


def test_explain_a_key_a_section_and_an_unknown_key(capsys):
    assert main(["config", "--explain", "trainer.lr"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("trainer.lr = 0.001  (float > 0)\n") and "learning rate" in out
    text = explain("logging")
    assert text.startswith("[logging]") and "logging.wandb_mode" in text and "trainer." not in text
    assert "model.renderer" in explain()
    with pytest.raises(ConfigError, match="did you mean trainer.lr"):
        explain("trainer.lrr")
    assert main(["config", "--explain", "nope.key"]) == 2
    assert "no such config key" in capsys.readouterr().err


def test_every_key_is_documented_where_it_is_declared():
    sections = {name for name, value in to_dict(RunConfig()).items() if isinstance(value, dict)}
    undocumented = [doc.key for doc in config_reference() if doc.key not in sections and not doc.doc.strip()]
    assert undocumented == []
