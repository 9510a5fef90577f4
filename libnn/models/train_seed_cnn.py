"""Train SeedCNN's shipped weights: `python -m libnn.models.train_seed_cnn` (CPU, about a minute).

Needs PyTorch and scikit-learn, which libnn itself never imports: both are imported inside the
functions here, so the package and the model run without them.

1. scikit-learn's digits (1797 images, 8×8, 0..16; offline), preprocessed by seed_cnn.preprocess_digits
   (bilinear to 28×28, scaled to [-1, 1]), checked against torch.nn.functional.interpolate;
2. a stratified held-out split of 20% (fixed seed);
3. the torch model with SeedCNN's structure and key names, trained with Adam and random shifts of
   up to 2 pixels, in batch-norm's training mode;
4. writes libnn/models/data/seed_cnn.safetensors (fp32, PyTorch's keys without BatchNorm's
   num_batches_tracked counters) and digits_heldout.npz (the held-out images, preprocessed, and labels);
5. loads the file into libnn's SeedCNN on the reference path and checks it agrees with torch.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from libnn.models.seed_cnn import HELDOUT, WEIGHTS, SeedCNN, preprocess_digits
from libnn.nn import weights

SEED = 0
HELDOUT_FRACTION = 0.2
MAX_SHIFT = 2
TARGET_ACCURACY = 0.97


def torch_model():
    """SeedCNN in PyTorch; the key names are libnn's SeedCNN's (features.*, classifier.*)."""
    from collections import OrderedDict

    from torch import nn

    return nn.Sequential(OrderedDict(
        features=nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
                               nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(2)),
        classifier=nn.Sequential(nn.Flatten(), nn.Linear(64 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, 10),
                                 nn.LogSoftmax(dim=1))))


def _shifted(images, rng: np.random.Generator):
    """Each image moved by up to MAX_SHIFT pixels in each direction, the border filled with background."""
    import torch

    n, _, h, w = images.shape
    padded = torch.nn.functional.pad(images, (MAX_SHIFT,) * 4, value=-1.0)  # -1: a 0 pixel after scaling
    dy, dx = rng.integers(0, 2 * MAX_SHIFT + 1, (2, n))
    return torch.stack([padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w] for i in range(n)])


def write_npz(path, **arrays: np.ndarray) -> None:
    """np.savez_compressed with bzip2 in place of deflate: np.load reads either (zipfile decompresses),
    and the preprocessed images take 0.21 MB instead of 0.37, keeping the shipped data under 2 MB."""
    import zipfile

    with zipfile.ZipFile(path, "w", zipfile.ZIP_BZIP2) as archive:
        for name, value in arrays.items():
            with archive.open(f"{name}.npy", "w") as member:
                np.lib.format.write_array(member, value, allow_pickle=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m libnn.models.train_seed_cnn", description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=20, help="passes over the training split (default 20)")
    p.add_argument("--batch", type=int, default=32, help="batch size (default 32)")
    p.add_argument("--dry-run", action="store_true", help="train and report, write no files")
    args = p.parse_args(argv)

    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    torch.manual_seed(SEED)
    rng = np.random.default_rng(SEED)
    digits = load_digits()
    images, labels = preprocess_digits(digits.images), digits.target.astype(np.int64)
    by_torch = torch.nn.functional.interpolate(torch.tensor(digits.images[:, None] / 16.0), size=(28, 28),
                                               mode="bilinear", align_corners=False)
    assert np.abs((by_torch.numpy() - 0.5) / 0.5 - images).max() < 1e-5, "preprocess_digits differs from torch"
    x_train, x_test, y_train, y_test = train_test_split(images, labels, test_size=HELDOUT_FRACTION,
                                                        stratify=labels, random_state=SEED)
    print(f"digits: {len(x_train)} training, {len(x_test)} held-out images, 28x28")

    model = torch_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs)
    x_train_t, y_train_t = torch.tensor(x_train), torch.tensor(y_train)
    x_test_t = torch.tensor(x_test)
    start = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        order = torch.tensor(rng.permutation(len(x_train)))
        total = 0.0
        for i in range(0, len(order), args.batch):
            batch = order[i:i + args.batch]
            loss = torch.nn.functional.nll_loss(model(_shifted(x_train_t[batch], rng)), y_train_t[batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch)
        schedule.step()
        model.eval()
        with torch.no_grad():
            accuracy = (model(x_test_t).argmax(1).numpy() == y_test).mean()
        print(f"epoch {epoch + 1:2d}: loss {total / len(x_train):.4f}, held-out accuracy {accuracy:.2%}")
    print(f"trained in {time.perf_counter() - start:.1f} s; held-out accuracy {accuracy:.2%} "
          f"({round(accuracy * len(y_test))}/{len(y_test)})")
    if accuracy < TARGET_ACCURACY:
        print(f"held-out accuracy {accuracy:.2%} is below the target {TARGET_ACCURACY:.0%}: no files written",
              file=sys.stderr)
        return 1

    state = model.state_dict()
    with torch.no_grad():
        expected = model(x_test_t).numpy()
    # libnn takes the torch state_dict as it is, counters included, and gives torch's answer
    ours = SeedCNN(dtype="fp64", path="reference")
    ours.load_state_dict({k: v.numpy() for k, v in state.items()})
    got = ours(x_test.astype(np.float64))
    agree = (got.argmax(1) == expected.argmax(1)).mean()
    print(f"libnn reference path vs torch: max |log-prob difference| {np.abs(got - expected).max():.2e}, "
          f"argmax agreement {agree:.2%}")
    if args.dry_run:
        return 0

    WEIGHTS.parent.mkdir(parents=True, exist_ok=True)
    weights.write(WEIGHTS, {k: v.numpy().astype(np.float32) for k, v in state.items()
                            if not k.endswith("num_batches_tracked")})
    write_npz(HELDOUT, images=x_test.astype(np.float32), labels=y_test.astype(np.int64))
    for path in (WEIGHTS, HELDOUT):
        print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
