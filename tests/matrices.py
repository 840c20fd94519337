"""What the matrix, store and cluster tests share: small scenario settings (seconds per run
on a CPU) and a fixed torch thread count for bit-for-bit comparisons."""

from contextlib import contextmanager

import torch

TINY_RUN = """
dataset = "synthetic-images"
model = "simple-cnn"
partition = "iid"
n = 4
rounds = 6
batch_size = 8
eval_every = 3
"""


@contextmanager
def torch_threads(n: int):
    """Bit-for-bit equality between executors needs the same torch thread count on both
    sides (CPU reductions split by thread)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
