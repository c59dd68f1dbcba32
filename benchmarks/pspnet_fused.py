"""segmentation_models_pytorch's PSPNet, stock against ``replace_pooling(model, fuse=True)``: inference
and a training step, on the CPU.

The fused model runs the pyramid pooling module's four adaptive average poolings (1, 2, 3, 6) of the
encoder's last feature map as one pool_tuner pyramid (one read of it forward, one write of its
gradient backward); everything else is PyTorch's.  Both models are built from one seed and
``encoder_weights=None`` (nothing downloaded); each case times loops of calls, the two models
interleaved in a fresh random order every round (medians, quartiles, round-by-round ratios), and
checks first that both give the same outputs.

Needs segmentation_models_pytorch (``pip install segmentation-models-pytorch``).

    python benchmarks/pspnet_fused.py [--encoder resnet34] [--batch 4] [--size 512] [--rounds 5] [--out report.json]
"""

from __future__ import annotations

import copy

import numpy as np
import torch

import common
import pool_tuner.torch as ptt
from pool_tuner.bench import Candidate


def main(argv=None) -> int:
    parser = common.parser(__doc__)
    parser.add_argument("--encoder", default="resnet34")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--size", type=int, default=512, help="input height and width (default 512)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loop-s", type=float, default=1.0, help="seconds per timed loop (default 1)")
    common.add_output_argument(parser)
    args = parser.parse_args(argv)
    import segmentation_models_pytorch as smp

    torch.manual_seed(0)
    stock = smp.PSPNet(args.encoder, encoder_weights=None, classes=21)
    fused = ptt.replace_pooling(copy.deepcopy(stock), fuse=True)
    x = torch.randn(args.batch, 3, args.size, args.size)
    target = torch.randint(0, 21, (args.batch, args.size, args.size))
    stock.eval(), fused.eval()
    with torch.no_grad():
        difference = (stock(x) - fused(x)).abs().max().item()
    info = common.circumstances(torch)
    print(common.describe_circumstances(info))
    print(f"PSPNet({args.encoder}) batch {args.batch} at {args.size}x{args.size}; the pooled map is "
          f"{args.batch}x{stock.encoder.out_channels[-1]}x{args.size // 8}x{args.size // 8}; "
          f"max |stock - fused| output difference {difference:.2e}")

    def infer(model):
        def run():
            with torch.no_grad():
                model(x)
        return Candidate(run, lambda: None)

    def train_step(model):
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)

        def run():
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), target).backward()
            optimizer.step()
        return Candidate(run, lambda: None)

    rng = np.random.default_rng(0)
    report = {"circumstances": info, "encoder": args.encoder, "batch": args.batch, "size": args.size,
              "max_output_difference": difference, "cases": {}}
    for case, make, training in (("inference", infer, False), ("training step", train_step, True)):
        stock.train(training), fused.train(training)
        timings = common.interleave({"stock": make(stock), "fused": make(fused)}, args.rounds, args.loop_s, rng,
                                    warmup=1)
        ratio = timings.ratio("stock", "fused")
        print(f"\n{case}")
        print(common.format_table(["model", "ms per call (q1-q3)"],
                                  [[n, common.fmt_spread(timings.summary(n))] for n in ("stock", "fused")]))
        print(f"stock / fused: {ratio['of_medians']:.3f} (round by round {ratio['q1']:.3f}-{ratio['q3']:.3f})")
        report["cases"][case] = {"ms": {n: timings.summary(n) for n in ("stock", "fused")}, "stock_over_fused": ratio}
    return common.finish(info, report, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
