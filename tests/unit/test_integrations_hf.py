"""patch_hf_moe in one process, over every MoE model type of the installed transformers (found at run time):
each one matches the unpatched model (logits and gradients) or is refused at patch time.

    .venv/bin/python -m pytest -s tests/unit/test_integrations_hf.py    # -s prints the table
"""
import copy
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from moonep.integrations import hf_experts as hf_mod  # noqa: E402
from moonep.integrations import hf_survey, hf_tiny, patch_hf_moe  # noqa: E402
from moonep.training import full_state_dict  # noqa: E402

TYPES = dict(hf_tiny.moe_model_types())


def _model(t):
    if t not in TYPES:
        pytest.skip(f"transformers has no {t}")
    return hf_tiny.build(t, TYPES[t])


@pytest.fixture(scope="module")
def survey_rows():
    return hf_survey.survey()


def test_every_moe_model_type_matches_or_is_refused(survey_rows):
    rows = survey_rows
    print("\n" + hf_survey.table(rows))
    bad = [r for r in rows if not r.ok]
    assert not bad, "\n" + hf_survey.table(bad)
    assert len(rows) >= 10, [r.model_type for r in rows]
    status = {r.model_type: r.status for r in rows}
    for t in ("mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss", "llama4_text", "longcat_flash"):
        assert status.get(t, "matched") == "matched", (t, status.get(t))
    assert "transformers " in hf_survey.table(rows, markdown=True).splitlines()[0]


def test_the_documented_survey_is_current(survey_rows):
    """docs/integrations.md's table was made with the installed transformers, and every type's result (matched,
    refused, not built) is what the survey finds now."""
    import transformers

    doc = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    block = doc.split("<!-- hf_survey:begin -->")[1].split("<!-- hf_survey:end -->")[0].strip()
    stamp = block.splitlines()[0].split(",")[0]
    regen = "regenerate it: mpiexec -n 2 python -m moonep.integrations.hf_survey --markdown"
    installed = f"transformers {transformers.__version__}"
    assert stamp == installed, f"docs/integrations.md: made with {stamp}, {installed} is installed; {regen}"
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in block.splitlines()
             if line.startswith("| ") and not line.startswith("| model type")]
    documented = {c[0]: c[1] for c in cells}
    found = {r.model_type: r.status for r in survey_rows}
    differ = {t: (documented.get(t), found.get(t)) for t in set(documented) | set(found)
              if documented.get(t) != found.get(t)}
    assert not differ, f"docs/integrations.md differs from the survey (documented, found): {differ}; {regen}"


def test_other_expert_maths_is_refused_and_nothing_changes(monkeypatch):
    model = _model("gpt_oss")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    classes = [type(m) for m in model.modules()]

    def plain_swiglu(ex, h):  # not GPT-OSS's clamped, alpha-scaled gate on interleaved columns
        gate, up = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    monkeypatch.setattr(hf_mod, "_gate", plain_swiglu)
    with pytest.raises(ValueError, match=r"model type 'gpt_oss': model\.layers\.0\.mlp\.experts \(GptOssExperts\): "
                                         r"on a probe input its output differs"):
        patch_hf_moe(model)
    assert [type(m) for m in model.modules()] == classes
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_unknown_moe_structure_is_refused():
    with pytest.raises(ValueError, match=r"model type 'jetmoe': .*\(JetMoeMoA\) is an MoE part with no fused"):
        patch_hf_moe(_model("jetmoe"))
    with pytest.raises(ValueError, match="no MoE block with a fused `experts` module found"):
        patch_hf_moe(torch.nn.Linear(3, 3))


@pytest.mark.parametrize("t", ["gpt_oss", "llama4_text", "longcat_flash"])
def test_state_dict_round_trip(t):
    model = _model(t)
    full = model.state_dict()
    patch_hf_moe(model)
    got = full_state_dict(model)
    assert got.keys() == full.keys() and all(torch.equal(got[k], full[k]) for k in full), t
    other = _model(t)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    patch_hf_moe(other)
    other.load_state_dict(full)  # a full checkpoint loads into a patched model
    ids = torch.randint(0, 64, (2, 5))
    torch.testing.assert_close(other(ids, use_cache=False).logits, model(ids, use_cache=False).logits)


def test_experts_call_conventions():
    """Arguments by the original's keyword names, and one expert chosen twice (DeepSeek-V4 hash routing)."""
    model = _model("gpt_oss")
    ex = copy.deepcopy(model.model.layers[0].mlp.experts)
    patch_hf_moe(model)
    pat = model.model.layers[0].mlp.experts
    x = torch.randn(5, ex.hidden_size)
    idx = torch.tensor([[0, 1], [2, 2], [3, 0], [1, 1], [7, 6]])
    w = torch.rand(5, 2)
    want = ex(x, idx, w)
    torch.testing.assert_close(pat(x, router_indices=idx, routing_weights=w), want)
    torch.testing.assert_close(pat(hidden_states=x, router_indices=idx, routing_weights=w), want)


def test_unknown_keyword_refused_at_patch_time():
    with pytest.raises(ValueError, match="slak: expected a keyword argument of moonep.ExpertParallel"):
        patch_hf_moe(_model("mixtral"), slak=0.1)


def test_router_kept_eager_changes_nothing_eagerly():
    """The router's subclass (moonep/integrations/hf_router.py, for torch.compile) is invisible eagerly: same
    class name, an instance of the original class, the same state-dict keys and outputs."""
    model = _model("mixtral")
    ref = copy.deepcopy(model)
    patch_hf_moe(model)
    gate, want = model.model.layers[0].mlp.gate, ref.model.layers[0].mlp.gate
    assert type(gate).__name__ == type(want).__name__ and isinstance(gate, type(want)) and type(gate) is not type(want)
    assert list(gate.state_dict()) == list(want.state_dict())
    x = torch.randn(5, model.config.hidden_size)
    for a, b in zip(gate(x), want(x)):
        assert torch.equal(a, b)
