"""Small scenario settings the matrix, store and cluster tests share: seconds per run on a CPU."""

TINY_RUN = """
dataset = "synthetic-images"
model = "simple-cnn"
partition = "iid"
n = 4
rounds = 6
batch_size = 8
eval_every = 3
"""
