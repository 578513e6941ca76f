"""Buffers shared with other processes of the host (the disaggregated refit's shared transport):
a CPU buffer written by another process is seen in place by its owner, an ack board raised there
is seen here, and a wait on a reader that never gets there fails naming the readers behind."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

from mcore_zoo.distributed.shared_buffers import AckBoard, open_buffer, share_buffer, shared_empty
from mcore_zoo.errors import ZooError

from ..conftest import ROOT

SRC = str(ROOT / "src")

READER = textwrap.dedent("""
    import pickle, sys
    import torch
    from mcore_zoo.distributed.shared_buffers import AckBoard, open_buffer
    shared, acks = pickle.loads(sys.stdin.buffer.read())
    view = open_buffer(shared)
    total = int(view.to(torch.int64).sum())
    view[:4] = torch.tensor([7, 8, 9, 10], dtype=torch.uint8)
    AckBoard.open(acks).raise_to(1, 5)
    print(total)
""")


def test_another_process_reads_and_writes_a_shared_buffer_in_place():
    buffer, shared = shared_empty(64, torch.device("cpu"))
    buffer.copy_(torch.arange(64, dtype=torch.uint8))
    board, acks = AckBoard.create(2)
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", READER], input=pickle.dumps((shared, acks)), capture_output=True,
                          timeout=120, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert int(done.stdout) == sum(range(64))  # it read what this process wrote
    assert buffer[:4].tolist() == [7, 8, 9, 10]  # and wrote where this process reads
    board.wait([1], 5, timeout=1.0, what="test")  # its slot reached 5
    with pytest.raises(ZooError, match=r"reader\(s\) \[0\] did not get to 1"):
        board.wait([0, 1], 1, timeout=0.05, what="test")


def test_only_a_whole_contiguous_cuda_byte_buffer_is_shared_as_it_is():
    with pytest.raises(ZooError, match="contiguous uint8"):
        share_buffer(torch.zeros(4, dtype=torch.float32))
    with pytest.raises(ZooError, match="contiguous uint8"):
        share_buffer(torch.zeros(8, dtype=torch.uint8)[2:])
    with pytest.raises(ZooError, match="shared_empty"):
        share_buffer(torch.zeros(8, dtype=torch.uint8))  # a CPU buffer is made shared, not converted


def test_a_shared_file_goes_with_its_buffer():
    buffer, shared = shared_empty(16, torch.device("cpu"))
    buffer.fill_(3)
    assert open_buffer(shared).sum() == 48 and os.path.exists(shared.handle)
    del buffer
    assert not os.path.exists(shared.handle)
