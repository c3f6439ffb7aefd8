"""`--checkpoint DIR`: save and resume the demo with `torch.distributed.checkpoint` (every rank
writes its own shards of the model and AdamW state; a resume may use another mesh). The one-device
model of `--compare` lives on rank 0 only and is saved beside it with `torch.save`."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

__all__ = ["load_checkpoint", "save_checkpoint"]

_ONE_DEVICE_FILE = "one_device.pt"


def _resume_error(directory: Path) -> RuntimeError:
    return RuntimeError(
        f"--checkpoint {directory} holds no one-device model to resume --compare with (it was saved "
        f"without --compare); resume without --compare, or start from an empty directory"
    )


def save_checkpoint(directory: str, model, optimizer, step: int, reference=None, reference_optimizer=None) -> None:
    """Every rank calls; the step count is saved with the states.

    A resumed run saves over the checkpoint it resumed from, on purpose: the writer is told so
    (`overwrite=True`, whose default torch announces it will flip), and its warning on every rank that
    it overwrites a checkpoint is left out of the demo's output.
    """
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": torch.tensor(step, device="cpu")}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint", category=UserWarning)
        dcp.save(state, checkpoint_id=directory, storage_writer=dcp.FileSystemWriter(directory, overwrite=True))
    if reference is not None:
        one_device = {"model": reference.state_dict(), "optimizer": reference_optimizer.state_dict()}
        torch.save(one_device, Path(directory) / _ONE_DEVICE_FILE)


def load_checkpoint(directory: str, model, optimizer, reference=None, reference_optimizer=None) -> int:
    """Load the states saved in `directory` if there are any; returns the step to continue from."""
    path = Path(directory)
    if not (path / ".metadata").is_file():
        return 0
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": torch.tensor(0, device="cpu")}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    if reference is not None:
        if not (path / _ONE_DEVICE_FILE).is_file():
            raise _resume_error(path)
        one_device = torch.load(path / _ONE_DEVICE_FILE)
        reference.load_state_dict(one_device["model"])
        reference_optimizer.load_state_dict(one_device["optimizer"])
    return int(state["step"])
