"""``simplefsdp plan`` on every native flavor: context parallelism in the
analytic (expert) plan, defaults that fit for the largest flavors, the fused
loss's memory, and the published rows grouped by the traces they share."""

from __future__ import annotations

import dataclasses
import json

import pytest

import plan_profiles
from simplefsdp.models.registry import resolve_flavor, spec_for_config
from simplefsdp.plan import cli as plan_cli
from simplefsdp.plan import predict
from simplefsdp.plan import reference as ref
from simplefsdp.plan.analytic import ExpertLayout
from simplefsdp.plan.hardware import PROFILES
from simplefsdp.plan.predict import Layout

GiB = 2**30
FIXED = dataclasses.replace(plan_profiles.FIXED, memory_bytes=640 * GiB)


def _moe(name, **layout):
    spec, config = resolve_flavor(name)
    return predict(spec, config, ExpertLayout(**layout), FIXED), config


def test_analytic_cp_splits_tokens_and_gathers_keys_and_values() -> None:
    # CP 2 on the same GPUs: half the tokens per rank, the same sequence;
    # attention's work per local token is the whole sequence's, so the step
    # is not halved exactly; the keys and values are gathered per attention.
    base, config = _moe("qwen3_30b_a3b", gpus=8, batch=1, seq=4096, ep=2)
    cp2, _ = _moe("qwen3_30b_a3b", gpus=8, batch=1, seq=4096, ep=2, cp=2, cp_backend="torch")
    assert base.time["cp_comm_total"] == 0 and cp2.time["cp_comm_total"] > 0
    assert cp2.layout.describe().startswith("dp4 cp2 torch ep2")
    kv = 2 * 2 * config.n_kv_heads * config.head_dim * 2048  # bf16 K and V, local tokens
    one = FIXED.comm_seconds("all_gather", 2, 2 * kv, 2)
    assert cp2.time["cp_comm_total"] == pytest.approx(config.n_layers * 2 * one)
    # Sharded state is the same (FSDP over dp x cp); activations about halve,
    # plus the other rank's keys and values saved per block.
    for part in ("parameters", "gradients", "optimizer", "gathered"):
        assert cp2.memory[part] == base.memory[part], part
    saved = base.memory["activations"] / 2 + config.n_layers * kv
    assert cp2.memory["activations"] == pytest.approx(saved)
    # Full AC: one block's gathered keys and values at a time.
    full, _ = _moe(
        "qwen3_30b_a3b", gpus=8, batch=1, seq=4096, ep=2, cp=2, ac="full", cp_backend="torch"
    )
    none, _ = _moe("qwen3_30b_a3b", gpus=8, batch=1, seq=4096, ep=2, cp=1, ac="full")
    assert full.memory["temporary"] == pytest.approx(none.memory["temporary"] / 2 + kv)
    # simplefsdp's allgather backend: the (T/cp x T) mask and its bf16 bias
    # while an attention runs, and the masked kernel's time.
    ours, _ = _moe("qwen3_30b_a3b", gpus=8, batch=1, seq=4096, ep=2, cp=2, ac="full")
    assert ours.memory["temporary"] - full.memory["temporary"] == pytest.approx(3 * 2048 * 4096)
    assert ours.time["compute"] > full.time["compute"]
    assert any("boolean mask" in n for n in ours.notes)
    # without AC every block keeps its mask's bf16 bias
    kept, _ = _moe("qwen3_30b_a3b", gpus=8, batch=1, seq=4096, ep=2, cp=2, ac="none")
    ring, _ = _moe(
        "qwen3_30b_a3b", gpus=8, batch=1, seq=4096, ep=2, cp=2, ac="none", cp_backend="torch"
    )
    biases = config.n_layers * 2 * 2048 * 4096
    assert kept.memory["activations"] - ring.memory["activations"] == pytest.approx(biases)


@pytest.mark.parametrize(
    "flavor", ["deepseek_v3_671b", "qwen3_235b_a22b", "gpt_oss_120b", "qwen3_moe_debug"]
)
@pytest.mark.parametrize("cp", ["1", "2"])
def test_every_expert_flavor_plans_with_its_defaults(flavor, cp, capsys) -> None:
    # The GPUs, the EP degree and (where selective AC cannot fit) full AC
    # default to a layout that fits the flavor's state.
    assert plan_cli.main(["--model", flavor, "--cp", cp]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "DOES NOT FIT" not in out and "defaults (generic)" in out


def test_a_generic_ep_default_is_the_fastest_degree_that_fits(capsys) -> None:
    # No published layout: the EP degree left out is the fastest of those
    # that fit; one given is planned as given.
    import json

    def plan(*argv: str) -> dict:
        assert plan_cli.main(["--model", "gpt_oss_120b", *argv, "--json"]) == 0
        return json.loads(capsys.readouterr().out)["predictions"][0]

    chosen = plan()
    assert any("the fastest EP degree that fits" in n for n in chosen["notes"])
    gpus, experts = chosen["layout"]["gpus"], resolve_flavor("gpt_oss_120b")[1].num_experts
    speeds = {}
    for ep in (d for d in range(1, gpus + 1) if gpus % d == 0 and experts % d == 0):
        pred = plan("--ep", str(ep))
        assert pred["layout"]["ep"] == ep
        if pred["fits"]:
            speeds[ep] = pred["tokens_per_s_per_gpu"]
    assert len(speeds) > 1 and max(speeds, key=speeds.get) == chosen["layout"]["ep"]
    assert chosen["tokens_per_s_per_gpu"] == speeds[chosen["layout"]["ep"]]


def test_generic_defaults_grow_with_the_model() -> None:
    usable = PROFILES["h100"].memory_bytes * PROFILES["h100"].usable_memory_fraction
    spec, config = resolve_flavor("deepseek_v3_671b")
    values = plan_cli.generic_defaults(spec, config, usable)
    assert values["gpus"] == 512 and values["ep"] == 8
    assert 16 * spec.num_params(config) / values["gpus"] <= usable / 2
    assert 16 * spec.num_params(config) / (values["gpus"] // 2) > usable / 2
    spec, config = resolve_flavor("qwen3_debug")
    values = plan_cli.generic_defaults(spec, config, usable)
    assert values["gpus"] == 8 and values["seq"] == config.max_seq_len  # below 8192
    assert plan_cli.generic_defaults(spec, config) == values  # small: no GPU needed


@pytest.mark.parametrize("tp, held", [(1, 6), (2, 10)])
def test_fused_loss_saves_eight_bytes_per_logit(tp, held) -> None:
    # (twelve under loss parallelism, whose eager backward holds more)
    spec, config = resolve_flavor("llama3_debug")
    layout = Layout(gpus=2 * tp, batch=2, seq=64, ac="none", tp=tp, loss_parallel=tp > 1)
    eager = predict(spec, config, layout, FIXED)
    fused = predict(spec, config, dataclasses.replace(layout, fused_loss=True), FIXED)
    logits = 2 * 64 * config.vocab_size // tp
    assert eager.memory["activations"] - fused.memory["activations"] == 2 * logits
    assert eager.memory["temporary"] - fused.memory["temporary"] == held * logits
    assert fused.step_s == eager.step_s and "fused-loss" in fused.layout.describe()


def test_traced_vocabulary_parallel_loss_is_cross_entropy_and_saves_log_probs() -> None:
    # The ops the plan traces for loss parallelism (torch's loss_parallel
    # decomposition, one rank's shard) compute F.cross_entropy and its
    # gradient, and save the fp32 log-probabilities, as torch's handlers do.
    import torch
    import torch.nn.functional as F

    from simplefsdp.plan.trace import _VocabParallelCrossEntropy

    torch.manual_seed(0)
    logits = torch.randn(6, 11, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 11, (6,))
    saved = []

    def pack(x):
        saved.append(x)
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        ours = _VocabParallelCrossEntropy.apply(logits, target)
    (grad,) = torch.autograd.grad(ours, logits)
    ref = F.cross_entropy(logits, target)
    assert torch.allclose(ours, ref)
    assert torch.allclose(grad, torch.autograd.grad(ref, logits)[0])
    assert torch.allclose(saved[0], logits.log_softmax(-1))


def test_reference_rows_share_traces_and_keep_their_order(monkeypatch) -> None:
    # The CP rows of Table 2 trace one shape (FSDP 8, 32k tokens per rank).
    table2 = [r for r in ref.REFERENCE_ROWS if r.table == "2"]
    assert len(table2) == 4 and len({ref._trace_shape(r) for r in table2}) == 1
    calls = []

    def fake(rows, hw):
        calls.append(rows)
        return [(r.note, float(r.gpus), 1.0) for r in rows]

    monkeypatch.setattr(ref, "_predict_group", fake)
    rows = ref.REFERENCE_ROWS
    results = ref.predict_rows(rows)
    assert [r[:2] for r in results] == [(r.note, float(r.gpus)) for r in rows]
    assert len(calls) == len({ref._trace_shape(r) for r in rows}) < len(rows)
    assert spec_for_config(resolve_flavor("llama3_8b")[1]).family == "llama3"


@pytest.mark.parametrize("flavor", ["qwen3_debug", "qwen3_moe_debug"])
def test_a_hugging_face_folder_plans_as_its_family(flavor, tmp_path, capsys) -> None:
    # The folder's config.json picks the family and its shapes, as
    # simplefsdp train --checkpoint.init_from_hf does; one traced (dense),
    # one analytic (experts).
    import json

    spec, config = resolve_flavor(flavor)
    (tmp_path / "config.json").write_text(json.dumps(spec.hf_adapter.config_to_hf(config)))
    argv = ["--gpus", "2", "--hardware", "h100", "--seq", "256", "--json"]
    assert plan_cli.main(["--model", str(tmp_path), *argv]) == 0, capsys.readouterr().err
    from_folder = json.loads(capsys.readouterr().out)
    assert plan_cli.main(["--model", flavor, *argv]) == 0
    from_flavor = json.loads(capsys.readouterr().out)
    from_folder.pop("planning_s"), from_flavor.pop("planning_s")  # wall time
    assert from_folder == from_flavor


def test_a_longer_sequence_than_the_model_takes_is_raised_by_a_config(tmp_path, capsys) -> None:
    # Beyond max_seq_len: one line saying how to raise it, and a --config
    # naming a model folder as its base raises it for that folder.
    import json

    spec, config = resolve_flavor("qwen3_debug")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(spec.hf_adapter.config_to_hf(config)))
    longer = 2 * config.max_seq_len
    argv = ["--gpus", "2", "--hardware", "h100", "--seq", str(longer), "--json"]
    assert plan_cli.main(["--model", str(folder), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--seq {longer} exceeds max_seq_len" in err[0]
    assert 'raise max_seq_len with --config FILE.json (holding {"max_seq_len": N})' in err[0]
    raised = tmp_path / "long.json"
    raised.write_text(json.dumps({"base": str(folder), "max_seq_len": longer}))
    assert plan_cli.main(["--model", str(folder), "--config", str(raised), *argv]) == 0
    assert json.loads(capsys.readouterr().out)["predictions"][0]["layout"]["seq"] == longer
    raised.write_text(json.dumps({"base": str(folder), "max_seq_length": longer}))
    assert plan_cli.main(["--config", str(raised), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "max_seq_length not a field" in err[0] and "max_seq_len" in err[0]


def _folder(tmp_path, **fields) -> str:
    import json

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(fields))
    return str(tmp_path)


def _mistral_as_llama_debug() -> dict:
    """Llama 3's debug flavor as a ``config.json`` of another model type (no
    sliding window: the same architecture), which simplefsdp trains through
    transformers' own modeling code."""
    spec, config = resolve_flavor("llama3_debug")
    fields = spec.hf_adapter.config_to_hf(config)
    return {**fields, "model_type": "mistral", "architectures": ["MistralForCausalLM"],
            "sliding_window": None}  # fmt: skip


@pytest.fixture(scope="module")
def mistral_plan(tmp_path_factory):
    """``(spec, config, prediction)`` of Llama 3's debug flavor as a Mistral
    folder, trained through transformers' code: 2 GPUs, batch 2 x 64."""
    folder = _folder(tmp_path_factory.mktemp("mistral"), **_mistral_as_llama_debug())
    spec, config = plan_cli.resolve_model(plan_cli._parser().parse_args(["--model", folder]))
    layout = Layout(gpus=2, batch=2, seq=64)
    return spec, config, predict(spec, config, layout, plan_profiles.FIXED)


def test_transformers_modeling_code_plans_as_the_native_family_does(mistral_plan, tmp_path) -> None:
    # The same architecture through transformers' code and through ours: the
    # same sharded state, and activations, peak and tokens/s within a few
    # percent (transformers computes its rotary tables per step, in fp32).
    spec, config, theirs = mistral_plan
    assert spec.family == "transformers" and spec.with_layers(config, 2).n_layers == 2
    layout = Layout(gpus=2, batch=2, seq=64)
    llama, debug = resolve_flavor("llama3_debug")
    ours = predict(llama, debug, layout, plan_profiles.FIXED)
    for part in ("parameters", "gradients", "optimizer"):
        assert theirs.memory[part] == ours.memory[part]
    assert theirs.memory["activations"] == pytest.approx(ours.memory["activations"], rel=0.02)
    assert theirs.peak_bytes == pytest.approx(ours.peak_bytes, rel=0.05)
    assert theirs.tokens_per_s_per_gpu == pytest.approx(ours.tokens_per_s_per_gpu, rel=0.05)
    # FSDP2's groups: the embedding, one per decoder layer (model.model.layers.N),
    # the final norm and output.
    fsdp2 = dataclasses.replace(layout, engine="fsdp2")
    groups = predict(spec, config, fsdp2, plan_profiles.FIXED).buckets
    assert len(groups) == len(predict(llama, debug, fsdp2, plan_profiles.FIXED).buckets)
    assert groups[0] == ["model.model.embed_tokens.weight"]
    assert groups[1][0].startswith("model.model.layers.0.")
    assert "model.model.norm.weight" in groups[-1]
    # Tied input and output embeddings: the engine keeps one root group, first.
    tied_folder = tmp_path / "tied"
    tied_folder.mkdir()
    fields = {**_mistral_as_llama_debug(), "tie_word_embeddings": True}
    tied = plan_cli.resolve_model(
        plan_cli._parser().parse_args(["--model", _folder(tied_folder, **fields)])
    )
    groups = predict(*tied, fsdp2, plan_profiles.FIXED).buckets
    assert "model.model.embed_tokens.weight" in groups[0] and "model.model.norm.weight" in groups[0]
    assert groups[1][0].startswith("model.model.layers.0.")


def test_transformers_planning_cuts_per_layer_lists_and_drops_dropout(tmp_path, capsys) -> None:
    from simplefsdp.models.hf_transformers.config import TransformersConfig
    from simplefsdp.models.hf_transformers.model import MASK_CHECKED
    from simplefsdp.models.hf_transformers.spec import with_layers

    four = TransformersConfig(
        hf_config={
            "num_hidden_layers": 4,
            "layer_types": list("abcd"),
            "attn_layer_indices": [1, 3],
            "no_rope_layers": [1, 1, 0, 1],
        }  # fmt: skip
    )
    cut = dict(with_layers(four, 2).hf_config)
    assert cut.pop(MASK_CHECKED) is False  # the whole model's check (not a model here)
    assert cut == {"num_hidden_layers": 2, "layer_types": ["a", "b"], "attn_layer_indices": [1],
                   "no_rope_layers": [1, 1]}  # fmt: skip
    gpt2 = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=128, n_embd=32,
                n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.1)  # fmt: skip
    argv = ["--model", _folder(tmp_path, **gpt2), "--gpus", "2", "--seq", "64", "--json"]
    assert plan_cli.main([*argv, "--hardware", "h100"]) == 0, capsys.readouterr().err
    notes = json.loads(capsys.readouterr().out)["predictions"][0]["notes"]
    assert any(n.startswith("dropout: planned without it") for n in notes)


def test_a_model_keeping_its_layers_under_its_own_key_plans_every_layer(tmp_path, capsys) -> None:
    # GPT-2 keeps the layers in n_layer, the positions in n_positions (its
    # config class's attribute_map); MPT the layers in n_layers and the
    # positions in max_seq_len, which no map names.
    from simplefsdp.models.hf_transformers.config import config_from_hf, field_keys

    gpt2 = dict(model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=128, n_embd=32,
                n_layer=4, n_head=4, n_positions=128, activation_function="gelu")  # fmt: skip
    spec, config = plan_cli.resolve_model(
        plan_cli._parser().parse_args(["--model", _folder(tmp_path, **gpt2)])
    )
    assert config.n_layers == 4 and config.max_seq_len == 128
    assert spec.with_layers(config, 1).hf_config["n_layer"] == 1
    assert "num_hidden_layers" not in spec.with_layers(config, 1).hf_config
    layout = Layout(gpus=2, batch=2, seq=64)
    pred = predict(spec, config, layout, plan_profiles.FIXED)
    # every block's fp32 shard, not the one- and two-block traces'
    assert pred.memory["parameters"] == pytest.approx(4 * spec.num_params(config) / 2, rel=0.01)
    assert 0 < pred.mfu < 1
    assert plan_cli.main(["--model", str(tmp_path), "--gpus", "2", "--seq", "256"]) == 2
    assert "exceeds max_position_embeddings 128" in capsys.readouterr().err
    mpt = {"model_type": "mpt", "n_layers": 2, "d_model": 32, "n_heads": 4, "max_seq_len": 64}
    assert field_keys(mpt, {"num_hidden_layers": "n_layers", "hidden_size": "d_model"}) == {
        "num_hidden_layers": "n_layers", "hidden_size": "d_model",
        "num_attention_heads": "n_heads", "max_position_embeddings": "max_seq_len",
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"config.json: no number of decoder layers .* got None"):
        config_from_hf({"model_type": "gpt2", "vocab_size": 128})


def test_transformers_code_without_sdpa_or_that_does_not_trace(tmp_path, capsys) -> None:
    # MPT's code has no SDPA path: its eager attention is planned (the scores
    # saved for backward: the activations grow with the square of the
    # sequence). OPT's code branches on a random number (layerdrop), a graph
    # break the plan's one-graph trace does not take: one line naming it.
    mpt = dict(model_type="mpt", architectures=["MptForCausalLM"], vocab_size=128, d_model=32,
               n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=256)  # fmt: skip
    folder = _folder(tmp_path / "mpt", **mpt)
    argv = ["--model", folder, "--gpus", "2", "--batch", "1", "--ac", "none", "--json"]
    activations = []
    for seq in ("128", "256"):
        assert plan_cli.main([*argv, "--seq", seq, "--hardware", "h100"]) == 0
        pred = json.loads(capsys.readouterr().out)["predictions"][0]
        assert any(
            n.startswith("attention: the model's code has no SDPA path") for n in pred["notes"]
        )
        activations.append(pred["memory_bytes"]["activations"])
    assert activations[1] > 3 * activations[0]  # the (seq x seq) scores dominate
    # BLOOM builds its ALiBi slopes with torch.tensor on the input's (meta)
    # device, which Dynamo keeps as a real meta tensor: the trace builds such
    # constants on the host and moves them.
    bloom = dict(model_type="bloom", architectures=["BloomForCausalLM"], vocab_size=128,
                 hidden_size=32, n_layer=2, n_head=4)  # fmt: skip
    argv = ["--model", _folder(tmp_path / "bloom", **bloom), "--gpus", "2", "--seq", "64"]
    assert plan_cli.main([*argv, "--batch", "1", "--hardware", "h100", "--json"]) == 0
    notes = json.loads(capsys.readouterr().out)["predictions"][0]["notes"]
    assert any(n.startswith("attention: the model's code has no SDPA path") for n in notes)
    opt = dict(model_type="opt", architectures=["OPTForCausalLM"], vocab_size=128, hidden_size=32,
               ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32,
               max_position_embeddings=128)  # fmt: skip
    assert plan_cli.main(["--model", _folder(tmp_path / "opt", **opt), "--seq", "64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "transformers' code for model_type 'opt' breaks the graph" in err[0]
    assert "--compile.fullgraph false" in err[0]
    # a config.json its own code does not build from (a needed field None)
    broken = {**_mistral_as_llama_debug(), "model_type": "ministral", "head_dim": None,
              "architectures": ["MinistralForCausalLM"]}  # fmt: skip
    assert plan_cli.main(["--model", _folder(tmp_path / "ministral", **broken)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "code for model_type 'ministral' fails to build the model of this config.json" in err[0]


def test_a_sliding_window_shorter_than_the_sequence_plans_the_masked_kernel(
    mistral_plan, tmp_path
) -> None:
    # transformers runs a window shorter than the sequence as SDPA with a
    # boolean mask: the memory-efficient kernel over every (query, key) pair,
    # the mask saved for backward.
    import torch

    from simplefsdp.plan.trace import _flash_sdpa, _planning_attention_ops

    plain = mistral_plan[2]
    fields = {**_mistral_as_llama_debug(), "sliding_window": 32}
    spec, config = plan_cli.resolve_model(
        plan_cli._parser().parse_args(["--model", _folder(tmp_path, **fields)])
    )
    masked = predict(spec, config, Layout(gpus=2, batch=2, seq=64), plan_profiles.FIXED)
    assert masked.time["compute"] > plain.time["compute"] * 1.01
    mask = 2 * 64 * 64  # bool (B, 1, T, T)
    assert masked.memory["activations"] >= plain.memory["activations"] + mask
    # recomputed (full AC), the masked attention is a planning op with a backward
    _planning_attention_ops()
    q, k, v = (torch.empty(2, 4, 16, 8, device="meta", requires_grad=True) for _ in range(3))
    bias = torch.ones(1, 1, 16, 16, dtype=torch.bool, device="meta")
    out = _flash_sdpa(full_ac=True)(q, k, v, attn_mask=bias)
    out.sum().backward()
    assert out.shape == q.shape and k.grad.shape == k.shape


def test_transformers_mixture_of_experts_is_refused_in_one_line(tmp_path, capsys) -> None:
    mixtral = {**_mistral_as_llama_debug(), "model_type": "mixtral", "num_local_experts": 4,
               "architectures": ["MixtralForCausalLM"]}  # fmt: skip
    assert plan_cli.main(["--model", _folder(tmp_path, **mixtral)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'transformers'" in err[0] and "routed experts" in err[0]


def test_layer_kinds_of_a_config_and_their_measures() -> None:
    """Kinds from per-layer lists and index lists; a variant of one kind;
    and the blended measures: what lies outside the blocks once (each
    kind's own addition too), then each block as its kind's."""
    import dataclasses as dc

    from simplefsdp.models.hf_transformers.config import TransformersConfig
    from simplefsdp.models.hf_transformers.model import MASK_CHECKED
    from simplefsdp.models.hf_transformers.spec import layer_kinds, with_layer_kind
    from simplefsdp.plan.predict import GraphMeasures, blocks_of_kinds

    config = TransformersConfig(
        hf_config={
            "num_hidden_layers": 4,
            "layer_types": ["s", "f", "s", "s"],
            "attn_layer_indices": [1, 2],
            "no_rope_layers": [1, 1, 1, 1],
        }  # fmt: skip
    )
    kinds = layer_kinds(config)
    a = (("layer_types", "s"), ("no_rope_layers", 1), ("attn_layer_indices", False))
    b = (("layer_types", "f"), ("no_rope_layers", 1), ("attn_layer_indices", True))
    c = (("layer_types", "s"), ("no_rope_layers", 1), ("attn_layer_indices", True))
    assert [dict(k) for k in kinds] == [dict(a), dict(b), dict(c), dict(a)]
    variant = dict(with_layer_kind(config, kinds[1], 2).hf_config)
    assert variant.pop(MASK_CHECKED) is False
    assert variant == {"num_hidden_layers": 2, "layer_types": ["f", "f"],
                       "attn_layer_indices": [0, 1], "no_rope_layers": [1, 1]}  # fmt: skip
    assert layer_kinds(TransformersConfig(hf_config={"num_hidden_layers": 2})) is None

    zero = GraphMeasures(**{f.name: 0.0 for f in dc.fields(GraphMeasures)})

    def m(flops: float, saved: float) -> GraphMeasures:
        return dc.replace(zero, fw_flops=flops, saved_bytes=saved)

    # outside: 100 FLOPs, and a mask of 7 bytes that only kind "s" builds
    per_kind = {"s": m(10, 1), "f": m(30, 2)}
    ones = {"s": m(110, 8), "f": m(130, 2)}
    one, two = blocks_of_kinds(ones, per_kind, ("s", "f", "s", "s"))
    whole = one.extrapolate(two, 4)
    assert (whole.fw_flops, whole.saved_bytes) == (100 + 3 * 10 + 30, 7 + 3 * 1 + 2)
    one, two = blocks_of_kinds(ones, per_kind, ("f", "s", "s", "s"))  # "f" first
    assert one.extrapolate(two, 4).saved_bytes == 7 + 3 * 1 + 2


@pytest.mark.slow
@pytest.mark.heavy  # 5 traces, 20 s on 2 CPU cores; run with -m heavy
def test_blocks_of_several_kinds_add_up_to_a_full_trace(tmp_path) -> None:
    """LFM2 with convolution and attention blocks (different parameters and
    work per kind): traced with 1 and 2 blocks of each kind, the blended
    measures at 3 blocks equal a trace of all 3 (extrapolating from the
    first two, ``[conv, attention]``, would count 2 attention blocks)."""
    from simplefsdp.compiler.cost_model import CostModel
    from simplefsdp.plan.predict import TraceKey, blocks_of_kinds, measure, traced

    fields = dict(
        model_type="lfm2", architectures=["Lfm2ForCausalLM"], vocab_size=256, hidden_size=64,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, num_hidden_layers=3,
        layer_types=["conv", "full_attention", "conv"],
    )  # fmt: skip
    spec, config = plan_cli.resolve_model(
        plan_cli._parser().parse_args(["--model", _folder(tmp_path, **fields)])
    )
    kinds = spec.layer_kinds(config)
    assert len(set(kinds)) == 2

    def measured(variant):
        return measure(traced(TraceKey(spec.family, variant, 1, 1, 2, 64, "none")),
                       CostModel(), fused=True)  # fmt: skip

    ones = {kind: measured(spec.with_layer_kind(config, kind, 1)) for kind in dict.fromkeys(kinds)}
    per_kind = {
        kind: one.per_block(measured(spec.with_layer_kind(config, kind, 2)))
        for kind, one in ones.items()
    }
    one, two = blocks_of_kinds(ones, per_kind, kinds)
    whole = measured(config)
    guess = one.extrapolate(two, 3)
    for name in ("fw_flops", "bw_flops", "param_bytes", "saved_bytes", "grad_bytes"):
        assert getattr(guess, name) == pytest.approx(getattr(whole, name), rel=1e-9), name
    for name in ("fw_s", "bw_s"):
        assert getattr(guess, name) == pytest.approx(getattr(whole, name), rel=0.02), name
    conv, attention = (per_kind[kind].param_bytes for kind in dict.fromkeys(kinds))
    assert conv != pytest.approx(attention, rel=1e-3)  # the kinds differ


def test_a_window_across_ranks_gathers_what_its_layer_computed(mistral_plan, tmp_path) -> None:
    """Under CP (allgather), a window in chunks reads its keys repeated to
    the query heads and each chunk's reach again; across ranks it gathers
    the keys and values its layer computed, as full attention does: the
    same CP traffic. (One CP rank's trace is the fixture's: 2 ranks x 64
    tokens.)"""
    layout = Layout(gpus=2, batch=2, seq=128, cp=2)
    plans = {}
    for window in (None, 16):  # the window runs in chunks of 16 over runs of 32
        fields = {**_mistral_as_llama_debug(), "sliding_window": window}
        folder = _folder(tmp_path / str(window), **fields)
        spec, config = plan_cli.resolve_model(plan_cli._parser().parse_args(["--model", folder]))
        plans[window] = predict(spec, config, layout, plan_profiles.FIXED)
    full, window = plans[None], plans[16]
    assert window.time["cp_comm_total"] == pytest.approx(full.time["cp_comm_total"], rel=1e-6)
    assert full.memory["temporary"] > 0 and window.time["compute"] < full.time["compute"]
    assert any("window runs in chunks" in note for note in window.notes), window.notes
