"""Train a Hugging Face Llama (transformers' LlamaForCausalLM) with fully_shard x tensor parallelism.

The model is built from a small config (no download) with tied input and output embeddings. Its
tensor-parallel plan is the model's own (`model.tp_plan`: "colwise" for the q/k/v, gate and up
projections, "rowwise" for o_proj and down_proj, "embedding_rowwise", "colwise_gather_output" for
the head), read as shardtensor styles by `hf_tp_plan` and applied over "tp"; every decoder layer,
then the whole model, is `fully_shard`ed over "dp", which splits the batch. Every rank also trains
the same model on one device, and the script checks both give the same losses and weights.

A pretrained model works the same way: `LlamaForCausalLM.from_pretrained(directory)` in place of
`LlamaForCausalLM(config)`, on every rank, before `parallelize`.

Run: python examples/hf_llama.py   (needs `pip install transformers`; four ranks are spawned locally)
"""

from collections import Counter

import torch
from torch.testing import assert_close
from transformers import LlamaConfig, LlamaForCausalLM

from shardtensor import comm, init_device_mesh
from shardtensor.dispatch import fallback_counts
from shardtensor.fsdp import fully_shard
from shardtensor.launch import spawn
from shardtensor.parallel import hf_tp_plan, parallelize_module

STEPS = 3
BATCH, LENGTH = 4, 12


def make_model() -> LlamaForCausalLM:
    """A two-layer Llama with grouped-query attention (8 query heads share 4 key/value heads)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=98, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=LENGTH,
        tie_word_embeddings=True,
    )
    # float64, so that the comparison with one device is exact up to rounding, AdamW included
    return LlamaForCausalLM(config).to(torch.float64)


def make_batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 98, (BATCH, LENGTH), generator=generator) for _ in range(STEPS)]


def parallelize(model: LlamaForCausalLM, mesh) -> LlamaForCausalLM:
    """The model's own tensor-parallel plan over "tp"; each decoder layer and the rest sharded over "dp"."""
    parallelize_module(model, mesh["tp"], hf_tp_plan(model, mesh["tp"]))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model


def train(model, batches, dp_rank: int = 0, dp_size: int = 1) -> list[torch.Tensor]:
    """AdamW steps on this data-parallel rank's share of each batch; the loss of each step."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    losses = []
    for tokens in batches:
        tokens = tokens.tensor_split(dp_size)[dp_rank]
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def main() -> str:
    fallbacks_before = Counter(fallback_counts)  # the process may have run other programs before this one
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    batches = make_batches()
    model = parallelize(make_model(), mesh)
    embedding = model.model.embed_tokens.weight
    assert model.lm_head.weight is embedding, "the tied head and embedding share one parameter"
    dp_rank, dp_size = mesh.get_coordinate()[0], mesh.size(0)
    losses = train(model, batches, dp_rank, dp_size)
    # each dp rank's loss is the mean over its half of the batch: their mean is the whole batch's
    mean_losses = comm.all_reduce(torch.stack(losses), mesh, 0, reduce_op="avg")
    reference = make_model()
    reference_losses = train(reference, batches)
    assert_close(mean_losses, torch.stack(reference_losses))
    for name, parameter in model.named_parameters():
        assert_close(parameter.full_tensor(), reference.get_parameter(name).detach(), msg=name)
    fallbacks = ", ".join(sorted(Counter(fallback_counts) - fallbacks_before)) or "none"
    return (f"rank {mesh.get_rank()}: embedding {embedding.placements} on {tuple(mesh.shape)}; "
            f"losses {[round(loss, 4) for loss in mean_losses.tolist()]}; ops without a sharding rule: {fallbacks}")


if __name__ == "__main__":
    for line in spawn(main, 4):
        print(line)
    print("ok: the Hugging Face Llama on the 2x2 mesh gives the single-device losses and weights")
