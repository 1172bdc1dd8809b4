"""Lightning on the "overcast" backend: Fabric and the Trainer with DDP, and the Trainer's
ModelParallelStrategy (FSDP2 over its data-parallel mesh dimension), two CPU processes started
by Lightning itself. The only overcast line is the import, at the top of the script: Lightning
runs the script again for each other process, and each must have registered the backend before
Lightning makes the process group.

    python examples/lightning_train.py --way trainer
    python examples/lightning_train.py --way trainer --backend gloo
    python examples/lightning_train.py --way fabric
    python examples/lightning_train.py --way model-parallel

The Trainer logs its training and validation losses with `self.log(..., sync_dist=True)`, which
averages them over the processes on the backend. Rank 0 prints the backend, each training step's
loss and, at the end, each logged metric, as float.hex: the same on overcast and gloo, bit for
bit (the Trainer's parameters are DTensors under ModelParallelStrategy, sharded by FSDP2).
"""

import argparse

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import overcast.distributed  # noqa: F401  (registers the "overcast" backend)

ROWS, PER_STEP = 64, 8  # rows in the data set; rows per process per step


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 4))


def data(seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    rows = TensorDataset(torch.randn(ROWS, 16, generator=g), torch.randn(ROWS, 4, generator=g))
    return DataLoader(rows, batch_size=PER_STEP)


class Regressor(L.LightningModule):
    def __init__(self, sharded: bool):
        super().__init__()
        self.net, self.sharded = model(), sharded

    def configure_model(self):
        if self.sharded:  # ModelParallelStrategy: FSDP2 over the mesh's data-parallel dimension
            from torch.distributed.fsdp import fully_shard
            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[2], self.net[4]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def on_fit_start(self):
        if self.global_rank == 0:
            print(f"backend {dist.get_backend()}, parameters "
                  f"{type(next(self.parameters()).data).__name__}", flush=True)

    def training_step(self, batch, index):
        loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def on_train_batch_end(self, outputs, batch, index):
        if self.global_rank == 0:
            print(f"step {self.global_step}  loss {outputs['loss'].item().hex()}", flush=True)

    def validation_step(self, batch, index):
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]),
                 sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def trainer(backend: str, way: str) -> None:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    strategy = (ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                      process_group_backend=backend)
                if way == "model-parallel" else DDPStrategy(process_group_backend=backend))
    fit = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2,
                    logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
    fit.fit(Regressor(way == "model-parallel"), data(1), data(2))
    if fit.global_rank == 0:
        for name, value in sorted(fit.callback_metrics.items()):
            print(f"{name} {value.item().hex()}", flush=True)


def fabric(backend: str) -> None:
    from lightning.fabric.strategies import DDPStrategy
    run = L.Fabric(accelerator="cpu", devices=2, strategy=DDPStrategy(
        process_group_backend=backend))
    run.launch()
    if run.global_rank == 0:
        print(f"backend {dist.get_backend()}", flush=True)
    net = model()
    net, opt = run.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    for epoch in range(2):
        for x, y in run.setup_dataloaders(data(1)):
            loss = nn.functional.mse_loss(net(x), y)
            run.backward(loss)
            opt.step()
            opt.zero_grad()
            mean = run.all_reduce(loss.detach(), reduce_op="mean")
            if run.global_rank == 0:
                print(f"loss {mean.item().hex()}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="overcast", choices=("overcast", "gloo"))
    parser.add_argument("--way", default="trainer", choices=("trainer", "fabric",
                                                              "model-parallel"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.way == "fabric":
        fabric(args.backend)
    else:
        trainer(args.backend, args.way)


if __name__ == "__main__":
    main()
