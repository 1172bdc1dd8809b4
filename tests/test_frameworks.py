"""Training frameworks on the "overcast" backend, each started as its users start it, two CPU
processes, against the same run on gloo: Lightning's Trainer (DDP, and FSDP2 through
ModelParallelStrategy) and Fabric, and Hugging Face accelerate. The losses and the metrics
logged with sync_dist, every bit; nothing left running and no file left behind."""

import pathlib
import re
import sys
import tempfile

import pytest

from conftest import run_marked
from overcast.cluster.launch import free_port

ROOT = pathlib.Path(__file__).resolve().parent.parent
SAID = re.compile(r"^(backend|step|loss|train_loss|val_loss) ")


def said(argv: list[str]) -> list[str]:
    """What the run's rank 0 said of its backend, losses and metrics; the run leaves no process
    and no file (it runs in an empty folder of its own)."""
    with tempfile.TemporaryDirectory() as folder:
        run, left = run_marked(argv, {}, timeout=180, cwd=folder)
        written = sorted(p.name for p in pathlib.Path(folder).iterdir())
    assert run.returncode == 0, run.stderr[-3000:]
    assert left == [] and written == [], (left, written)
    return [line for line in run.stdout.splitlines() if SAID.match(line)]


def lightning(way: str, backend: str) -> list[str]:
    return said([sys.executable, str(ROOT / "examples" / "lightning_train.py"), "--way", way,
                 "--backend", backend])


@pytest.mark.parametrize("way,parameters", [("trainer", "Tensor"),
                                            ("model-parallel", "DTensor")])
def test_lightning_trainer_trains_and_validates_with_gloos_losses_and_metrics(way, parameters):
    mine, theirs = lightning(way, "overcast"), lightning(way, "gloo")
    assert mine[0] == f"backend overcast, parameters {parameters}", mine
    assert theirs[0] == f"backend gloo, parameters {parameters}", theirs
    # 2 epochs of 4 steps, then the metrics logged with sync_dist
    assert [line.split()[0] for line in mine[1:]] == ["step"] * 8 + ["train_loss", "val_loss"]
    assert mine[1:] == theirs[1:]


def test_lightning_fabric_trains_with_gloos_losses():
    mine, theirs = lightning("fabric", "overcast"), lightning("fabric", "gloo")
    assert (mine[0], theirs[0]) == ("backend overcast", "backend gloo")
    assert len(mine) == 9 and mine[1:] == theirs[1:], (mine, theirs)


def accelerate(backend: str) -> list[str]:
    """examples/accelerate_train.py under accelerate's launcher, on a free port (its default,
    29500, may be another job's)."""
    return said([str(pathlib.Path(sys.executable).parent / "accelerate"), "launch",
                  "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                  "--main_process_port", str(free_port()), "--mixed_precision", "no",
                  "--dynamo_backend", "no", str(ROOT / "examples" / "accelerate_train.py"),
                  "--backend", backend])


def test_accelerate_under_its_launcher_trains_with_gloos_losses():
    mine, theirs = accelerate("overcast"), accelerate("gloo")
    assert mine[-1] == "backend overcast, 2 processes", mine
    assert theirs[-1] == "backend gloo, 2 processes", theirs
    assert len(mine) == 5 and mine[:-1] == theirs[:-1], (mine, theirs)
