"""pytorch/examples' MNIST loop over a torchvision-style dataset: uint8 images held in a host
tensor, each sample turned into a PIL image through ``.numpy()`` and back to a normalised tensor
(as torchvision's ``MNIST`` with ``ToTensor()`` and ``Normalize`` does), in a shuffled
``DataLoader`` with two worker processes, the device picked through ``torch.accelerator``.
With torchvision installed (``--torchvision``) its own ``transforms`` are used.

    python benchmarks/scripts/mnist_loader.py --batch-size 64 --samples 60000
"""

import argparse

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from collector.probe.core import StepProbe

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=64)
p.add_argument("--samples", type=int, default=60_000)
p.add_argument("--workers", type=int, default=2)
p.add_argument("--steps", type=int, default=4)
p.add_argument("--torchvision", action="store_true")
a = p.parse_args()


def to_tensor(pic):
    return torch.from_numpy(np.array(pic, np.uint8, copy=True)).view(1, 28, 28).float().div(255)


def normalize(t):
    return (t - 0.1307) / 0.3081


class MNISTLike(Dataset):
    def __init__(self, n: int, transform) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=g)
        self.targets = torch.randint(0, 10, (n,), generator=g)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        img, target = self.data[i], int(self.targets[i])
        img = Image.fromarray(img.numpy(), mode="L")
        return self.transform(img), target


if a.torchvision:
    from torchvision import transforms

    norm = transforms.Normalize((0.1307,), (0.3081,))
    transform = transforms.Compose([transforms.ToTensor(), norm])
else:

    def transform(img):
        return normalize(to_tensor(img))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(1, 32, 3, 1), nn.Conv2d(32, 64, 3, 1)
        self.fc1, self.fc2 = nn.Linear(9216, 128), nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        return F.log_softmax(self.fc2(F.relu(self.fc1(torch.flatten(x, 1)))), dim=1)


use_accel = torch.accelerator.is_available()
device = torch.accelerator.current_accelerator() if use_accel else torch.device("cpu")
kwargs = {"num_workers": a.workers, "pin_memory": True, "shuffle": True} if use_accel else {}
loader = DataLoader(MNISTLike(a.samples, transform), batch_size=a.batch_size, **kwargs)
model = Net().to(device)
optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
probe = StepProbe().watch(model, optimizer)
for i, (data, target) in enumerate(loader):
    if i == a.steps:
        break
    data, target = data.to(device), target.to(device)
    with probe.step(i):
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target)
        loss.backward()
        probe.phase("optimizer")
        optimizer.step()
    print(f"step {i}: batch {tuple(data.shape)} loss {loss.item():.6f}")
probe.close()
