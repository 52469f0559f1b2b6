"""distlearn in twenty lines: the README's first example, runnable.

python examples/quickstart.py http://127.0.0.1:8000/train.csv          # one process
torchrun --nproc-per-node=4 examples/quickstart.py http://127.0.0.1:8000/train.csv
"""

import sys

import torch
import torch.nn.functional as F

from distlearn import AllReduceSGD, ipc
from distlearn.dataset import Dataset
from distlearn.dataset.processors import Image

tree = ipc.Tree.from_env()  # torchrun or Slurm; one process when neither
ds = Dataset(sys.argv[1], partition=tree.node_index, partitions=tree.num_nodes)
batches = ds.sampled_batcher(batch_size=32, input_dims=(1, 28, 28),
                             sampler="permutation", processor=Image(mode="L"))  # fmt: skip
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
sgd = AllReduceSGD(tree)
sgd.synchronize_parameters(model)  # everyone starts from the root's weights
for epoch in range(3):
    seen = torch.zeros(2)  # loss sum, items
    for batch in batches:  # one epoch of this rank's partition
        opt.zero_grad()
        loss = F.cross_entropy(model(batch.input), batch.target)
        loss.backward()
        sgd.sum_and_normalize_gradients(model)  # mean over the nodes that contributed
        opt.step()
        seen += torch.tensor([loss.item() * len(batch.target), len(batch.target)])
    sgd.synchronize_parameters(model, opt)  # uneven step counts end equal, no hang
    tree.all_reduce(seen)
    if tree.node_index == 0:
        print(f"epoch {epoch}: loss {seen[0] / seen[1]:.4f} over {seen[1]:.0f} items")
tree.close()
