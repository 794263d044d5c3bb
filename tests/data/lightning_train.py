"""A Lightning training script that knows nothing of mempool.

    python tests/data/lightning_train.py OUTDIR [STEPS]

torchvision's ResNet-18 trained by Lightning's own ``Trainer`` loop on random 64 x 64 images:
bf16 mixed precision, ``benchmark=True`` (Lightning turns on cuDNN benchmark, whose algorithm
search asks the allocator's ``cacheInfo`` and empties its cache), and ``DeviceStatsMonitor``,
which logs ``torch.cuda.memory_stats()`` before and after every batch to a CSV file, as the
memory panels of a training dashboard do. Prints one JSON line: the allocator backend
PyTorch reports, the losses, and the memory statistics Lightning logged.
"""
import csv
import glob
import json
import os
import sys

import torch
import torchvision
from torch import nn

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, DeviceStatsMonitor
    from lightning.pytorch.loggers import CSVLogger
except ImportError:   # the older package name
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import Callback, DeviceStatsMonitor
    from pytorch_lightning.loggers import CSVLogger


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torchvision.models.resnet18(weights=None, num_classes=10)

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = nn.functional.cross_entropy(self.net(images), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class Losses(Callback):
    def __init__(self):
        self.values = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.values.append(float(loss.item()))


def logged_memory(log_dir):
    """{column: [values]} of the memory statistics DeviceStatsMonitor wrote."""
    out = {}
    for path in glob.glob(os.path.join(log_dir, "**", "metrics.csv"), recursive=True):
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                for key, value in row.items():
                    if "allocated_bytes.all" in key and value not in ("", None):
                        out.setdefault(key, []).append(float(value))
    return out


def main(outdir, steps):
    pl.seed_everything(0, workers=True)
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(steps * 32, 3, 64, 64, generator=generator)
    labels = torch.randint(0, 10, (steps * 32,), generator=generator)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images, labels),
                                         batch_size=32, shuffle=False, num_workers=0)
    losses = Losses()
    trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=steps,
                         precision="bf16-mixed", benchmark=True,
                         callbacks=[DeviceStatsMonitor(), losses],
                         logger=CSVLogger(outdir), log_every_n_steps=1,
                         enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(Classifier(), loader)
    print(json.dumps({
        "backend": torch.cuda.memory.get_allocator_backend(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "losses": losses.values,
        "logged": logged_memory(outdir),
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "summary_lines": len(torch.cuda.memory_summary().splitlines()),
    }))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 20)
