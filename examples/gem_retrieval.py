"""A retrieval-style embedding network with a learnt GeM head on pool_tuner's fused GeM pooling.

Image retrieval, re-identification and place recognition models end in generalized-mean pooling
with a learnt exponent (Radenovic et al., TPAMI 2018), usually written as PyTorch's composition
``F.adaptive_avg_pool2d(x.clamp(min=eps).pow(p), 1).pow(1/p)``.  Swapping in pool_tuner's op is
one line on the model's pooling attribute::

    model.pool = pt.torch.AdaptiveGeMPool2d(1)

(``replace_pooling`` does not guess GeM modules: user classes vary.)  This script builds a
backbone -- torchvision's ResNet-18 (random weights, nothing downloaded) where torchvision is
installed, else a small convolutional one -- with a GeM head, trains it a few steps on random
triplets, checks the fused head against the composition, and prints the learnt p and the time of a
training step with each head.

    python examples/gem_retrieval.py [--steps 5] [--batch 8] [--size 128]
"""

import argparse
import copy
import time

import torch
import torch.nn.functional as F

import pool_tuner as pt
import pool_tuner.torch  # noqa: F401 -- pt.torch


class ComposedGeM(torch.nn.Module):
    """GeM as it is usually written: four PyTorch operations, two full-size temporaries."""

    def __init__(self, p=3.0, eps=1e-6):
        super().__init__()
        self.p, self.eps = torch.nn.Parameter(torch.full((1,), p)), eps

    def forward(self, x):
        return F.adaptive_avg_pool2d(x.clamp(min=self.eps).pow(self.p), 1).pow(1.0 / self.p)


class Embedder(torch.nn.Module):
    """Backbone features -> GeM -> linear whitening -> L2-normalised embedding."""

    def __init__(self, backbone: torch.nn.Module, channels: int, dim: int = 128):
        super().__init__()
        self.backbone, self.pool, self.whiten = backbone, ComposedGeM(), torch.nn.Linear(channels, dim)

    def forward(self, x):
        return F.normalize(self.whiten(self.pool(self.backbone(x)).flatten(1)), dim=1)


def backbone() -> tuple:
    """(feature extractor, its channels): ResNet-18's trunk if torchvision is installed, else a
    small convolutional stack."""
    try:
        import torchvision
    except ModuleNotFoundError:
        layers, channels = [], 3
        for width in (32, 64, 128, 256):
            layers += [torch.nn.Conv2d(channels, width, 3, stride=2, padding=1), torch.nn.BatchNorm2d(width),
                       torch.nn.ReLU()]
            channels = width
        return torch.nn.Sequential(*layers), channels
    resnet = torchvision.models.resnet18(weights=None)
    return torch.nn.Sequential(*list(resnet.children())[:-2]), 512


def train_step(model, optimizer, anchors, positives, negatives):
    optimizer.zero_grad(set_to_none=True)
    loss = F.triplet_margin_loss(model(anchors), model(positives), model(negatives), margin=1.0)
    loss.backward()
    optimizer.step()
    return loss.item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=128)
    args = parser.parse_args()
    torch.manual_seed(0)
    features, channels = backbone()
    stock = Embedder(features, channels)
    fused = copy.deepcopy(stock)
    fused.pool = pt.torch.AdaptiveGeMPool2d(1)  # the one-line swap
    print(fused.pool)
    anchors = torch.rand(args.batch, 3, args.size, args.size)
    images = [anchors, anchors + 0.1 * torch.randn_like(anchors), torch.rand_like(anchors)]  # positives near
    stock.eval(), fused.eval()
    with torch.no_grad():
        difference = (stock(images[0]) - fused(images[0])).abs().max().item()
    print(f"max |composed - fused| embedding difference: {difference:.2e}")
    for name, model in (("composed GeM", stock), ("pool_tuner GeM", fused)):
        model.train()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        train_step(model, optimizer, *images)  # first call: builds
        start = time.perf_counter()
        for _ in range(args.steps):
            loss = train_step(model, optimizer, *images)
        ms = (time.perf_counter() - start) * 1e3 / args.steps
        print(f"{name}: {ms:.1f} ms per training step, loss {loss:.4f}, learnt p {float(model.pool.p.detach()):.4f}")


if __name__ == "__main__":
    main()
