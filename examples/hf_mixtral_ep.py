"""A Hugging Face Mixtral model with its experts run through moonep expert parallelism.

    pip install -e ".[hf]"
    mpiexec -n 4 python examples/hf_mixtral_ep.py      # CPU ranks
    torchrun --standalone --nproc-per-node 2 examples/hf_mixtral_ep.py   # GPUs, unchanged

A tiny randomly initialised Mixtral (no download) is built identically on every rank. Each rank feeds its
own prompts; after ``patch_hf_moe`` the experts are sharded by home rank (E/R each) and every MoE layer
dispatches tokens across ranks. The script checks that the patched logits equal the unpatched model's on
every rank, then greedy-decodes a few tokens with the KV cache (the token count per call changes).
"""
from __future__ import annotations

import torch
import transformers

import moonep
from moonep.integrations import patch_hf_moe


def main():
    rt = moonep.init()
    R, dev = rt.world_size, rt.device
    cfg = transformers.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     num_local_experts=8 * R, num_experts_per_tok=2, max_position_embeddings=128)
    torch.manual_seed(0)  # the same model on every rank
    model = transformers.MixtralForCausalLM(cfg).to(dev).eval()
    g = torch.Generator().manual_seed(rt.rank)  # each rank its own prompts, of its own batch size
    ids = torch.randint(0, cfg.vocab_size, (1 + rt.rank % 2, 12), generator=g).to(dev)
    with torch.no_grad():
        ref = model(ids).logits
        patch_hf_moe(model, rt)
        got = model(ids).logits
        err = (got - ref).abs().max().item()
        # Every rank runs the same number of forwards (no early stop), since each one is collective.
        out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    experts = model.model.layers[0].mlp.experts
    print(f"rank {rt.rank}/{R}: experts here {experts.gate_up_proj.shape[0]} of {cfg.num_local_experts}, "
          f"max |patched - unpatched| logits = {err:.2e}, generated {out[0, ids.shape[1]:].tolist()}",
          flush=True)
    assert err < 1e-4, err
    rt.shutdown()


if __name__ == "__main__":
    main()
