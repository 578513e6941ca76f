"""Clear errors instead of raw exceptions: a busy MASTER_PORT, a failed write (disk full, file
size limit), a non-float refit dtype, an SGLang answer of the wrong form."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

import mcore_zoo
from mcore_zoo.errors import ZooError


def test_busy_master_port_is_named_and_a_single_process_needs_none():
    """Under torchrun's environment a busy MASTER_PORT is a ZooError naming it; a single process
    (no RANK / WORLD_SIZE) takes no port, so an inherited busy MASTER_PORT does not matter."""
    code = ("from mcore_zoo.parallel import ensure_process_group\n"
            "from mcore_zoo.errors import ZooError\n"
            "try:\n    ensure_process_group('gloo')\n    print('OK')\nexcept ZooError as e:\n    print('ZOO', e)\n")  # fmt: skip
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.pop("RANK", None)
        env.pop("WORLD_SIZE", None)
        single = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        ranked = subprocess.run([sys.executable, "-c", code], env=dict(env, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"),
                                capture_output=True, text=True, timeout=120)  # fmt: skip
    assert single.stdout.strip() == "OK", single.stdout + single.stderr
    assert "ZOO" in ranked.stdout and f"127.0.0.1:{port}" in ranked.stdout and "MASTER_PORT" in ranked.stdout, ranked.stdout + ranked.stderr


def test_write_failure_under_a_file_size_limit_names_the_file_and_the_limit(reference_checkpoint, tmp_path):
    """``convert --hf`` with ``ulimit -f`` below the checkpoint's size: one line naming the output,
    the file and the limit (not torch's flattened traceback)."""
    ckpt = reference_checkpoint("LlamaForCausalLM")
    code = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, resource.RLIM_INFINITY))\n"
            "from mcore_zoo.cli import main\n"
            f"sys.exit(main(['convert', '--hf', {str(ckpt)!r}, '--out', {str(tmp_path / 'out')!r}]))\n")  # fmt: skip
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    err = run.stderr.strip().splitlines()[-1]
    assert "writing failed" in err and "file size limit 200000 bytes" in err and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_refit_dtype_must_be_a_float(mpu, reference_checkpoint):
    from mcore_zoo.rollout import DictAdapter

    ckpt = reference_checkpoint("LlamaForCausalLM")
    model = mcore_zoo.build_model(ckpt, backend="portable", load=ckpt, params_dtype=torch.float32)
    with pytest.raises(ZooError, match="int8.*floating-point"):
        mcore_zoo.refit(model, DictAdapter(), dtype=torch.int8)


def test_sglang_answer_of_the_wrong_form_is_named(mpu, reference_checkpoint):
    from mcore_zoo.rollout import SGLangAdapter

    class Engine:
        def __init__(self, answer):
            self.answer = answer

        def update_weights_from_tensor(self, named, flush_cache=False):
            return self.answer

    ckpt = reference_checkpoint("LlamaForCausalLM")
    model = mcore_zoo.build_model(ckpt, backend="portable", load=ckpt, params_dtype=torch.float32)
    for answer in [(), ("yes", "ok"), (True, "ok", "extra")]:
        adapter = SGLangAdapter(Engine(answer))
        if answer == (True, "ok", "extra"):
            mcore_zoo.refit(model, adapter)  # success with a longer message: fine
            continue
        with pytest.raises(ZooError, match="expected \\(success, message\\)"):
            mcore_zoo.refit(model, adapter)
    with pytest.raises(ZooError, match="SGLang refused bucket 0.*full"):
        mcore_zoo.refit(model, SGLangAdapter(Engine((False, "engine memory full"))))


def test_train_step_and_forward_inputs_are_named(mpu, reference_checkpoint):
    """token_data of the wrong kind or length and non-positive micro-batching options are
    InputErrors naming the argument, not raw IndexError / TypeError / AttributeError."""
    from mcore_zoo.errors import InputError

    ckpt = reference_checkpoint("LlamaForCausalLM")
    model = mcore_zoo.build_model(ckpt, backend="portable", load=ckpt, params_dtype=torch.float32)
    seqs = [torch.arange(5), torch.arange(7)]
    loss = lambda t: (-(t.logprobs * t.mask).sum(), {})  # noqa: E731
    for token_data, words in [({"w": [torch.ones(4)]}, "1 values for 2 sequences"),
                              ({"w": "x"}, "one value per sequence"),
                              ([1, 2], "must be a dict"),
                              ({"w": [torch.ones(4), "a"]}, r"token_data\['w'\]\[1\] is a str")]:  # fmt: skip
        with pytest.raises(InputError, match=words):
            mcore_zoo.train_step(model, seqs, loss, token_data=token_data)
    with pytest.raises(InputError, match="num_microbatches=0"):
        mcore_zoo.packed_forward(model, seqs, num_microbatches=0)
    with pytest.raises(InputError, match="max_tokens_per_microbatch=-1"):
        mcore_zoo.train_step(model, seqs, loss, max_tokens_per_microbatch=-1)
