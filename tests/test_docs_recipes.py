"""The runnable recipes of docs/*.md, executed as written on 4 real ranks and checked against one device.

A recipe is the fenced python block of a doc whose first line names this file; it builds its own meshes.
"""

import re
from pathlib import Path

import torch
from spmd import spmd

from shardtensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from shardtensor.debug import CommDebugMode

DOCS = Path(__file__).resolve().parent.parent / "docs"
MARK = "(tests/test_docs_recipes.py runs this block)"


def run_recipe(doc: str, first_line: str) -> dict:
    """Execute the block of docs/`doc` that starts with `first_line` (and the mark); return its names."""
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / doc).read_text(), flags=re.DOTALL)
    chosen = [block for block in blocks if block.startswith(f"{first_line} {MARK}\n")]
    assert len(chosen) == 1, f"docs/{doc} has {len(chosen)} blocks starting with {first_line!r} {MARK}"
    names: dict = {}
    exec(compile(chosen[0], f"docs/{doc}", "exec"), names)
    return names


@spmd(meshes=[(2, 2)], timeout=120)
def test_pipeline_hand_off_recipe_gives_one_device_gradients(mesh):
    """docs/redistribute.md: stage 1's loss and both stages' weight gradients are one device's."""
    names = run_recipe("redistribute.md", "# 4 ranks: two pipeline stages of 2")
    w0, w1 = (names[name].clone().requires_grad_() for name in ("w0", "w1"))
    expected_loss = ((names["batch"] @ w0).tanh() @ w1).pow(2).sum()
    expected_loss.backward()
    pp, weight = names["pp"], names["weight"]
    assert weight.device_mesh == names["stages"][pp] == names["world"]["tp"]
    assert weight.grad.placements == weight.placements == ((Shard(1),) if pp == 0 else (Replicate(),))
    torch.testing.assert_close(weight.grad.full_tensor(), (w0, w1)[pp].grad)
    if pp == 1:
        torch.testing.assert_close(names["loss"], expected_loss.detach())


@spmd(meshes=[(2, 2)], timeout=120)
def test_optimizer_in_backward_recipe_sees_partial_and_steps_as_one_device(mesh):
    """docs/debug.md: the hook sees a Partial gradient each step, the step all-reduces it once (one
    all_reduce per step besides the loss's full_tensor; distribute_tensor broadcasts rank 0's tensor, as
    torch's does), and the weight is one device's after 3 AdamW steps."""
    with CommDebugMode() as mode:
        names = run_recipe("debug.md", "# 4 ranks")
    assert names["seen"] == [(Partial(),)] * 3
    assert mode.get_comm_counts() == {"broadcast": 1, "all_reduce": 2 * 3}, mode.get_comm_counts()
    assert names["weight"].grad is None
    reference = torch.nn.Parameter(names["start"].clone())
    optimizer = torch.optim.AdamW([reference], lr=0.1)
    for _ in range(3):
        (names["inputs"] @ reference).tanh().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.testing.assert_close(names["weight"].to_local(), reference.detach())


@spmd(meshes=[(4,)], timeout=120)
def test_hooks_see_partial_and_an_unzeroed_gradient_ends_backward_replicate(mesh):
    """docs/debug.md's prose around the recipe: a gradient hook sees the Partial gradient too; a step in a
    post-accumulate-grad hook that does not zero leaves `.grad` Partial, reduced at the end of backward."""
    generator = torch.Generator().manual_seed(7)
    inputs, start = torch.randn(4, 3, generator=generator), torch.randn(3, generator=generator)
    weight = torch.nn.Parameter(distribute_tensor(start, mesh, [Replicate()]))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    seen = []
    weight.register_hook(lambda grad: seen.append(("hook", grad.placements)))

    def step_in_backward(parameter):
        optimizer.step()
        seen.append(("after step", parameter.grad.placements))

    weight.register_post_accumulate_grad_hook(step_in_backward)
    share = (inputs[mesh.get_rank()] @ weight.to_local(grad_placements=[Partial()])).tanh()
    DTensor.from_local(share, mesh, [Partial()]).full_tensor().backward()
    assert seen == [("hook", (Partial(),)), ("after step", (Partial(),))], seen
    reference = torch.nn.Parameter(start.clone())
    (inputs @ reference).tanh().sum().backward()
    assert weight.grad.placements == (Replicate(),)
    torch.testing.assert_close(weight.grad.to_local(), reference.grad)
    torch.testing.assert_close(weight.to_local(), (reference - 0.1 * reference.grad).detach())
