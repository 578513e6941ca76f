"""Progress bars on long work: on a terminal only, never with -q; messages through logging."""

from __future__ import annotations

import io
import logging
import sys

import pytest

import mcore_zoo
from mcore_zoo import progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def terminal(monkeypatch):
    """A terminal as standard error (installed by :func:`_attach` inside the test: pytest's own
    capture swaps ``sys.stderr`` between setup and the call)."""
    monkeypatch.delenv(progress.ENV_QUIET, raising=False)
    progress.set_quiet(False)  # whatever an earlier CLI call in this process asked for
    yield _Terminal()
    progress.set_quiet(False)


def _attach(monkeypatch, stream):
    monkeypatch.setattr(sys, "stderr", stream)


def test_bars_on_a_terminal_for_load_and_export(mpu, reference_checkpoint, tmp_path, terminal, monkeypatch):
    _attach(monkeypatch, terminal)
    ckpt = reference_checkpoint("LlamaForCausalLM")
    model = mcore_zoo.build_model(ckpt, backend="local", load=ckpt)
    mcore_zoo.save_hf_checkpoint(model, tmp_path / "out")
    text = terminal.getvalue()
    assert "loading HF weights" in text and "writing HF checkpoint" in text


def test_quiet_and_non_terminal_have_no_bars(mpu, reference_checkpoint, tmp_path, terminal, monkeypatch):
    _attach(monkeypatch, terminal)
    progress.set_quiet(True)
    ckpt = reference_checkpoint("LlamaForCausalLM")
    model = mcore_zoo.build_model(ckpt, backend="local", load=ckpt)
    mcore_zoo.save_hf_checkpoint(model, tmp_path / "out")
    assert terminal.getvalue() == ""
    progress.set_quiet(False)
    _attach(monkeypatch, io.StringIO())  # not a terminal
    assert not progress.enabled()


def test_the_cli_quiet_flag(mpu, reference_checkpoint, tmp_path, terminal, monkeypatch):
    _attach(monkeypatch, terminal)
    from mcore_zoo.cli import main

    assert main(["-q", "convert", "--hf", str(reference_checkpoint("LlamaForCausalLM")), "--out", str(tmp_path / "m")]) == 0
    assert "hf -> mcore" not in terminal.getvalue()
    assert main(["convert", "--mcore", str(tmp_path / "m"), "--out", str(tmp_path / "h")]) == 0
    assert "mcore -> hf" in terminal.getvalue()


def test_messages_go_through_module_loggers(mpu, reference_checkpoint, caplog):
    ckpt = reference_checkpoint("LlamaForCausalLM")
    with caplog.at_level(logging.INFO, logger="mcore_zoo"):
        mcore_zoo.build_model(ckpt, backend="local", load=ckpt)
    assert any(r.name == "mcore_zoo.distributed.load" and "loaded" in r.getMessage() for r in caplog.records)
