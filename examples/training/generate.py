"""generate() on a model with moonep expert parallelism: every rank must run as many forward passes.

    mpiexec -n 2 python examples/training/generate.py

Each forward is collective (tokens travel to the experts' ranks), so a rank whose sequences finish first
must keep joining until every rank is done: ``synced_gpus=True``.  Without it, the ranks that stopped and
those still decoding all raise ``moonep.MoonepError`` at once, saying so.
"""
from __future__ import annotations

import torch

import moonep
from moonep.integrations import patch_hf_moe


def main(argv=None) -> list:
    import transformers

    rt = moonep.init()
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     num_local_experts=4 * rt.world_size, num_experts_per_tok=2)
    torch.manual_seed(0)
    model = patch_hf_moe(transformers.MixtralForCausalLM(cfg).to(rt.device).eval(), rt)
    g = torch.Generator().manual_seed(rt.rank)
    prompt = torch.randint(0, 64, (1, 5), generator=g).to(rt.device)
    new = 3 + rt.rank  # ranks stop at different lengths
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0, synced_gpus=True)
    print(f"rank {rt.rank}: generated {out[0, prompt.shape[1]:].tolist()}", flush=True)
    return out[0].tolist()


if __name__ == "__main__":
    main()
