"""A Hugging Face folder picks its model family; any other causal LM is ``transformers``' own.

Tiny Gemma- and Mistral-style folders (``save_pretrained``, hidden 32, 2
layers) are read by the family ``transformers``: our model's logits equal
``transformers``' bitwise (built on the CPU, and on the meta device then
initialised and loaded), an export loads back with ``from_pretrained`` to the
same logits, and the record of a checkpoint rebuilds the configuration. A
Llama folder is the native family's, by ``model_type`` or by
``architectures``; a folder with its own code (``auto_map``) is refused in
one line unless ``trust_remote_code``; the resolve step checks the folder's
configuration (family, architecture, capabilities) before any process starts.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

VOCAB = 320  # holds the byte tokenizer's ids


def _tiny_configs() -> dict:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    return {
        "gemma": transformers.GemmaConfig(**common),  # tied embeddings, (1 + w) norms
        "mistral": transformers.MistralConfig(**common, sliding_window=8),
    }


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """``name -> (folder, the transformers model saved there)``."""
    out = {}
    for name, config in _tiny_configs().items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = (folder, model.eval())
    return out


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    from simplefsdp.checkpoint.hf import save_hf_checkpoint
    from simplefsdp.models.llama3 import Transformer, get_config

    args = get_config("debug", dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB)
    folder = tmp_path_factory.mktemp("llama")
    save_hf_checkpoint(Transformer(args).state_dict(), args, folder)
    return folder


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", ["gemma", "mistral"])
def test_logits_equal_transformers(folders, name):
    from simplefsdp.checkpoint.hf import hf_model_of_folder, load_hf_weights

    folder, reference = folders[name]
    spec, config = hf_model_of_folder(folder)
    assert spec.family == "transformers" and config.model_type == name
    tokens = _tokens()
    with torch.no_grad():
        expected = reference(tokens).logits
        for device in ("cpu", "meta"):
            with torch.device(device):
                model = spec.build(config)
            if device == "meta":  # as the recipe does: materialise, initialise
                model.to_empty(device="cpu")
                spec.init_weights(model, None)
            assert load_hf_weights(model, folder, args=config) > 0
            window = config.hf_config.get("sliding_window")
            if window and 2 * window < tokens.shape[1]:  # in chunks: rounding differs
                torch.testing.assert_close(model(tokens), expected, rtol=0, atol=1e-5)
            else:
                assert torch.equal(model(tokens), expected), (name, device)
    # the decoder layers are the repeated blocks (sharding, buckets, AC)
    from simplefsdp.bucket_plan import repeated_blocks

    assert [fqn for fqn, _ in repeated_blocks(model)] == ["model.layers.0", "model.layers.1"]
    if name == "gemma":  # tied embeddings stay one parameter
        assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("name", ["gemma", "mistral"])
def test_export_loads_back_with_from_pretrained(folders, name, tmp_path):
    from simplefsdp.checkpoint.hf import hf_model_of_folder, load_hf_weights, save_hf_checkpoint
    from simplefsdp.models.record import model_from_record, model_record

    folder, reference = folders[name]
    spec, config = hf_model_of_folder(folder)
    model = spec.build(config)
    load_hf_weights(model, folder, args=config)
    with torch.no_grad():  # a trained model differs from the one read
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    save_hf_checkpoint(model.state_dict(), config, tmp_path, max_shard_size=20_000)
    written = json.loads((tmp_path / "config.json").read_text())
    original = json.loads((folder / "config.json").read_text())
    assert written["architectures"] == original["architectures"]
    assert {k: v for k, v in written.items() if k not in ("dtype", "torch_dtype")} == {
        k: v for k, v in original.items() if k not in ("dtype", "torch_dtype")
    }
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = _tokens()
    with torch.no_grad():  # the mistral folder's window runs in chunks: rounding differs
        torch.testing.assert_close(loaded(tokens).logits, model(tokens), rtol=0, atol=1e-5)
        if name == "gemma":
            assert torch.equal(loaded(tokens).logits, model(tokens))
    # a checkpoint's record rebuilds the same family and configuration
    record = json.loads(json.dumps(model_record(spec, config)))
    assert model_from_record({"model": record}) == (spec, config)
    assert hash(model_from_record({"model": record})[1]) == hash(config)


def test_llama_folder_is_the_native_family(llama_folder, tmp_path):
    from simplefsdp.checkpoint.hf import hf_family_of, hf_model_of_folder

    spec, config = hf_model_of_folder(llama_folder)
    assert spec.family == "llama3" and config.dim == 32
    data = json.loads((llama_folder / "config.json").read_text())
    assert hf_family_of({"model_type": "mistral"}).family == "transformers"
    # another model_type, or none: the architecture names the family
    for model_type in ("my_llama", None):
        (tmp_path / "config.json").write_text(json.dumps({**data, "model_type": model_type}))
        assert hf_family_of({**data, "model_type": model_type}).family == "llama3"
        assert hf_model_of_folder(tmp_path) == (spec, config)


_CONFIGURATION = """from transformers import MistralConfig


class MineConfig(MistralConfig):
    model_type = "mine"
"""
_MODELING = """from transformers import MistralForCausalLM

from .configuration_mine import MineConfig


class MineForCausalLM(MistralForCausalLM):
    config_class = MineConfig
"""


def test_folder_with_its_own_code_needs_trust_remote_code(folders, tmp_path, monkeypatch):
    """A folder whose ``config.json`` maps to its own Python files (``auto_map``)."""
    from transformers import dynamic_module_utils

    from simplefsdp.checkpoint.hf import hf_model_of_folder, load_hf_weights

    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "configuration_mine.py").write_text(_CONFIGURATION)
    (folder / "modeling_mine.py").write_text(_MODELING)
    data = json.loads((folders["mistral"][0] / "config.json").read_text())
    data["model_type"] = "mine"
    data["auto_map"] = {
        "AutoConfig": "configuration_mine.MineConfig",
        "AutoModelForCausalLM": "modeling_mine.MineForCausalLM",
    }
    (folder / "config.json").write_text(json.dumps(data))
    (folder / "model.safetensors").symlink_to(folders["mistral"][0] / "model.safetensors")
    with pytest.raises(ValueError) as info:
        hf_model_of_folder(folder)
    assert str(info.value) == (
        f"{folder / 'config.json'}: model_type 'mine' comes with its own modeling code "
        "(auto_map), which runs only with --checkpoint.trust_remote_code true"
    )
    # with the flag the folder's code builds the model (copied to a scratch module cache)
    monkeypatch.setattr(dynamic_module_utils, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    spec, config = hf_model_of_folder(folder, trust_remote_code=True)
    assert config.trust_remote_code and config.code_folder == str(folder)
    model = spec.build(config)
    assert type(model.causal_lm).__name__ == "MineForCausalLM"
    load_hf_weights(model, folder, args=config)
    with torch.no_grad():
        assert torch.equal(model(_tokens()), folders["mistral"][1](_tokens()).logits)
    # its export carries the code its config.json names
    from simplefsdp.checkpoint.hf import save_hf_checkpoint

    save_hf_checkpoint(model.state_dict(), config, tmp_path / "out")
    assert (tmp_path / "out" / "modeling_mine.py").read_text() == _MODELING
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", trust_remote_code=True
    )
    with torch.no_grad():
        assert torch.equal(loaded.eval()(_tokens()).logits, model(_tokens()))


def test_a_model_without_sdpa_runs_its_own_attention_under_its_own_keys(tmp_path):
    # MPT: no SDPA path in transformers' code (its eager attention runs), the
    # layers under n_layers and the positions under max_seq_len.
    from simplefsdp.checkpoint.hf import hf_model_of_folder, load_hf_weights

    config = transformers.MptConfig(
        d_model=32, n_heads=4, n_layers=2, expansion_ratio=2, max_seq_len=64, vocab_size=VOCAB
    )
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reference.eval().save_pretrained(tmp_path)
    spec, ours = hf_model_of_folder(tmp_path)
    assert spec.family == "transformers" and ours.n_layers == 2 and ours.max_seq_len == 64
    model = spec.build(ours)
    assert model.attention_implementation == "eager"
    assert load_hf_weights(model, tmp_path, args=ours) > 0
    with torch.no_grad():
        assert torch.equal(model(_tokens()), reference(_tokens()).logits)
    assert spec.with_layers(ours, 1).n_layers == 1


def test_unknown_model_type_is_one_line(tmp_path):
    from simplefsdp.checkpoint.hf import hf_model_of_folder

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit", "vocab_size": 8}))
    with pytest.raises(ValueError, match=r"model_type 'vit' is not a causal language model"):
        hf_model_of_folder(tmp_path)


def _job(folder, *flags):
    from simplefsdp.train.config import load_config

    return load_config(None, ["--checkpoint.init_from_hf", str(folder), *flags])


def test_resolve_takes_the_family_and_config_from_the_folder(folders, llama_folder):
    from simplefsdp.train.resolve import job_errors, resolve

    resolved = resolve(_job(folders["mistral"][0], "--data.seq_len", "32"), 2)
    assert resolved.spec.family == "transformers" and resolved.config.model_type == "mistral"
    resolved = resolve(_job(llama_folder, "--data.seq_len", "32"), 2)
    assert resolved.spec.family == "llama3" and resolved.config.dim == 32
    # the folder's max_position_embeddings, not a default flavor's max_seq_len
    errors, _ = job_errors(_job(folders["gemma"][0], "--data.seq_len", "128"), 2)
    assert errors == [
        "data.seq_len 128 exceeds max_position_embeddings 64 of the 'gemma' model; "
        "valid: at most 64 (or raise model.max_seq_len)"
    ]
    # what the family does not compose with: one line
    folder = folders["gemma"][0]
    errors, _ = job_errors(_job(folder, "--data.seq_len", "32", "--parallel.pp", "2"), 2)
    assert errors == [
        f"parallel.pp 2: model {str(folder)!r} (family 'transformers') does not compose with "
        "pipeline parallelism; use parallel.pp 1 (the family composes with: cp, hf, tp)"
    ]
    # tensor parallelism: the model's own plan, whole sequences
    errors, _ = job_errors(_job(folder, "--data.seq_len", "32", "--parallel.tp", "2"), 2)
    assert errors == [
        "parallel.sequence_parallel true with parallel.tp 2: the transformers family's tensor "
        "parallelism keeps whole sequences and logits; use --parallel.sequence_parallel false"
    ]
    flags = ("--data.seq_len", "32", "--parallel.sequence_parallel", "false")
    assert job_errors(_job(folder, *flags, "--parallel.tp", "2"), 2)[0] == []
    errors, _ = job_errors(_job(folder, *flags, "--parallel.tp", "4"), 4)
    assert errors == [
        "parallel.tp 4 does not divide the num_key_value_heads 2 of the 'gemma' model; "
        "valid: a divisor of 2"
    ]
    # a named model of another family
    errors, _ = job_errors(
        _job(folders["mistral"][0], "--data.seq_len", "32", "--model.name", "llama3_small"), 2
    )
    assert len(errors) == 1 and errors[0].endswith(
        "is of family 'llama3' but "
        f"{folders['mistral'][0] / 'config.json'} holds a 'transformers' model; "
        "leave out model.name to take the model from it"
    )


def test_train_refuses_a_folder_with_code_in_one_line(folders, tmp_path, capsys):
    """``simplefsdp train`` on a folder with its own code: one line, nothing started."""
    from simplefsdp.train import cli

    folder = tmp_path / "mine"
    folder.mkdir()
    data = json.loads((folders["mistral"][0] / "config.json").read_text())
    data["auto_map"] = {"AutoModelForCausalLM": "modeling_mine.MineForCausalLM"}
    (folder / "config.json").write_text(json.dumps(data))
    out = ["--metrics.output_dir", str(tmp_path / "runs"), "--data.seq_len", "32"]
    assert cli.main(["--nproc", "2", "--checkpoint.init_from_hf", str(folder), *out]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"simplefsdp train: error: checkpoint.init_from_hf {str(folder)!r}: "
        f"{folder / 'config.json'}: model_type 'mistral' comes with its own modeling code "
        "(auto_map), which runs only with --checkpoint.trust_remote_code true"
    )
    assert not (tmp_path / "runs").exists()


def test_experts_picked_by_the_data_need_an_engine_that_gathers_blocks(tmp_path):
    """A transformers mixture-of-experts block runs only the experts its
    tokens picked: the engines that need the same reads on every rank
    refuse it in one line; the eager executor (whole blocks) takes it."""
    from simplefsdp.train.resolve import job_errors

    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        max_position_embeddings=64,
    )  # fmt: skip
    config.save_pretrained(tmp_path)  # config.json is all the resolve step reads
    errors, _ = job_errors(_job(tmp_path, "--data.seq_len", "32"), 2)
    assert errors == [
        f"parallel.engine simplefsdp: model {str(tmp_path)!r} runs only the experts its "
        "tokens picked, so ranks with different data would read different parameters; "
        "use parallel.engine simplefsdp_eager (it gathers and reduces whole blocks)"
    ]
    errors, _ = job_errors(_job(tmp_path, "--data.seq_len", "32", "--parallel.engine", "fsdp2"), 2)
    assert len(errors) == 1 and errors[0].startswith("parallel.engine fsdp2: ")
    flags = ("--data.seq_len", "32", "--parallel.engine", "simplefsdp_eager")
    assert job_errors(_job(tmp_path, *flags), 2)[0] == []


def test_flops_per_token_counts_the_experts_a_token_is_routed_to():
    """MFU of a transformers mixture-of-experts model counts ``top_k`` of
    its routed experts (Mixtral's ``num_experts_per_tok`` of
    ``num_local_experts``; DBRX's under ``ffn_config``); shared experts and a
    dense model count whole, as does ``is_moe: false``."""
    from simplefsdp.models.hf_transformers.config import config_from_hf
    from simplefsdp.models.hf_transformers.spec import SPEC, routed_experts, routes_to_experts

    hidden, inter, layers, experts, top_k = 32, 64, 2, 4, 2
    mixtral = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=experts,
        num_experts_per_tok=top_k, max_position_embeddings=64,
    ).to_dict()  # fmt: skip
    config = config_from_hf(mixtral)
    assert routed_experts(config) == (experts, top_k)
    total = SPEC.num_params(config, exclude_embeddings=True)
    per_expert = 3 * hidden * inter
    unused = layers * (experts - top_k) * per_expert
    assert SPEC.active_params(config, exclude_embeddings=True) == total - unused
    attention = 12 * layers * hidden * 16
    assert SPEC.flops_per_token(config, 16) == 6 * (total - unused) + attention

    # Qwen2-MoE: its shared expert is used by every token
    qwen = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=hidden, moe_intermediate_size=inter,
        shared_expert_intermediate_size=2 * inter, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, num_experts=experts,
        num_experts_per_tok=1, max_position_embeddings=64,
    ).to_dict()  # fmt: skip
    config = config_from_hf(qwen)
    total = SPEC.num_params(config, exclude_embeddings=True)
    unused = layers * (experts - 1) * per_expert
    assert SPEC.active_params(config, exclude_embeddings=True) == total - unused

    # DBRX keeps its routing under ffn_config and its experts stacked in one
    # parameter each; its loop skips the experts no token picked
    dbrx = config_from_hf({
        "model_type": "dbrx", "vocab_size": VOCAB, "d_model": hidden, "n_heads": 4,
        "n_layers": layers, "max_seq_len": 64,
        "attn_config": {"kv_n_heads": 2},
        "ffn_config": {"ffn_hidden_size": inter, "moe_num_experts": experts, "moe_top_k": 1},
    })  # fmt: skip
    assert routed_experts(dbrx) == (experts, 1) and routes_to_experts(dbrx)
    total = SPEC.num_params(dbrx, exclude_embeddings=True)
    assert SPEC.active_params(dbrx, exclude_embeddings=True) == total - unused

    dense = {k: v for k, v in mixtral.items() if "expert" not in k}
    dense = config_from_hf({**dense, "model_type": "mistral"})
    assert routed_experts(dense) is None
    assert SPEC.active_params(dense) == SPEC.num_params(dense)
    doge = config_from_hf({**mixtral, "model_type": "doge", "is_moe": False, "num_experts": 64})
    assert routed_experts(doge) is None and not routes_to_experts(doge)


def _attention_calls(model, tokens, keys=None):
    """``(masked, is_causal)`` of each SDPA call of ``model``'s compiled
    forward; the keys of each call appended to ``keys`` where given."""
    calls = []

    def backend(gm, _inputs):
        for node in gm.graph.nodes:
            if node.target is torch.nn.functional.scaled_dot_product_attention:
                causal = node.kwargs.get("is_causal", False)
                calls.append((node.kwargs.get("attn_mask") is not None, causal))
                if keys is not None:
                    keys.append(node.args[1].meta["example_value"].shape[-2])
        return gm

    torch._dynamo.reset()
    with torch.no_grad():
        logits = torch.compile(model, backend=backend, fullgraph=True)(tokens)
    return calls, logits


def test_compiled_causal_attention_runs_without_a_mask(folders):
    """Compiled, plain causal attention over whole sequences calls SDPA with
    ``is_causal`` and no mask (the flash kernel on a GPU), as ``transformers``
    does eagerly; a sliding window under half the sequence runs in chunks
    (Note: [Sliding windows of transformers models in chunks]);
    a model that reads the mask itself (Doge) keeps ``transformers``' masks
    and stays causal. The logits equal ``transformers``' either way."""
    from simplefsdp.checkpoint.hf import hf_model_of_folder, load_hf_weights

    tokens = _tokens()  # 24 tokens
    folder, reference = folders["gemma"]
    spec, config = hf_model_of_folder(folder)
    model = spec.build(config).eval()
    load_hf_weights(model, folder, args=config)
    assert model.whole_sequence_mask
    calls, logits = _attention_calls(model, tokens)
    assert calls == [(False, True), (False, True)]
    with torch.no_grad():
        assert torch.allclose(logits, reference(tokens).logits, atol=1e-5, rtol=0)

    folder, reference = folders["mistral"]  # sliding_window 8, under half of 24 tokens
    spec, config = hf_model_of_folder(folder)
    model = spec.build(config).eval()
    load_hf_weights(model, folder, args=config)
    keys = []
    calls, logits = _attention_calls(model, tokens, keys)
    assert calls == [(True, False), (True, False)]
    assert keys == [16, 16]  # chunks of 8 queries against two chunks of keys, not all 24
    with torch.no_grad():
        assert torch.allclose(logits, reference(tokens).logits, atol=1e-5, rtol=0)
        assert torch.allclose(model(tokens), reference(tokens).logits, atol=1e-5, rtol=0)

    from simplefsdp.models.hf_transformers.config import config_from_hf

    doge = transformers.DogeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    ).to_dict()  # fmt: skip
    torch.manual_seed(0)
    model = spec.build(config_from_hf(doge)).eval()
    assert not model.whole_sequence_mask
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % VOCAB
    with torch.no_grad():
        assert torch.equal(model(tokens)[:, :-1], model(changed)[:, :-1])  # causal


def test_a_model_whose_init_needs_real_tensors_builds_on_meta(tmp_path):
    """Bamba's (and Granite 4.0's) ``_init_weights`` assigns a host tensor to
    ``A_log.data``, which fails on a meta parameter: the meta build skips
    ``transformers``' initialisation (done once materialized), and the model
    loads the folder's weights to ``transformers``' logits."""
    from simplefsdp.checkpoint.hf import hf_model_of_folder, load_hf_weights

    config = transformers.BambaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=16,
        mamba_d_state=8, mamba_expand=2, attn_layer_indices=[1], use_mamba_kernels=False,
        max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config).eval()
    reference.save_pretrained(tmp_path)
    spec, read = hf_model_of_folder(tmp_path)
    with torch.device("meta"):
        model = spec.build(read)
    model.to_empty(device="cpu")
    spec.init_weights(model, None)
    assert load_hf_weights(model, tmp_path, args=read) > 0
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(model.eval()(tokens), reference(input_ids=tokens).logits)


def test_a_model_that_reads_the_mask_itself_keeps_it(monkeypatch):
    """The mask is dropped only where nothing but ``transformers``' SDPA
    function reads it: an attention whose own code computes with the mask
    before passing it on keeps ``transformers``' masks."""
    from transformers.models.mistral import modeling_mistral

    from simplefsdp.models.hf_transformers import model as hf_model
    from simplefsdp.models.hf_transformers.config import config_from_hf

    config = config_from_hf(
        transformers.MistralConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            max_position_embeddings=64, sliding_window=None, rope_theta=12345.0,
        ).to_dict()
    )  # fmt: skip
    assert hf_model._mask_reaches_only_sdpa(config)
    forward = modeling_mistral.MistralAttention.forward

    def reading(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs):
        if attention_mask is not None:
            attention_mask.logical_not()  # a read of its own, the mask passed on unchanged
        return forward(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs)

    monkeypatch.setattr(modeling_mistral.MistralAttention, "forward", reading)
    other = config.replace(hf_config={**config.hf_config, "rope_theta": 54321.0})  # not cached
    assert not hf_model._mask_reaches_only_sdpa(other)


_WINDOWED = {  # one sliding and one full layer where the model alternates them
    "gemma3_text": {"head_dim": 8, "query_pre_attn_scalar": 8,
                    "layer_types": ["sliding_attention", "full_attention"]},
    "qwen2": {"use_sliding_window": True, "max_window_layers": 0,
              "layer_types": ["sliding_attention", "sliding_attention"]},
    "starcoder2": {},
}  # fmt: skip


@pytest.mark.parametrize("model_type", sorted(_WINDOWED))
def test_sliding_windows_run_in_chunks_as_transformers_masks_them(model_type, monkeypatch):
    """A window under half the sequence (8 of 24 tokens) runs as chunks of
    8 queries against 16 keys (Note: [Sliding windows of transformers
    models in chunks]), full attention over all 24; the logits equal
    ``transformers``' own over its sliding-window mask."""
    import torch.nn.functional as F

    from simplefsdp.models.hf_transformers.config import config_from_hf
    from simplefsdp.models.hf_transformers.spec import SPEC

    config_class = type(transformers.AutoConfig.for_model(model_type))
    hf = config_class(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        sliding_window=8, pad_token_id=0, **_WINDOWED[model_type],
    )  # fmt: skip
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(hf, attn_implementation="sdpa")
    model = SPEC.build(config_from_hf(hf.to_dict())).eval()
    model.load_state_dict(reference.state_dict())
    assert model.whole_sequence_mask
    keys = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, *args, **kwargs):
        keys.append(k.shape[-2])
        return sdpa(q, k, *args, **kwargs)

    tokens = _tokens()
    with torch.no_grad():
        expected = reference.eval()(tokens).logits
        monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
        logits = model(tokens)
    full = 24 if "full_attention" in (getattr(hf, "layer_types", None) or ()) else 16
    assert keys == [16, full]
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("model_type", ["gemma3_text", "mistral"])
@pytest.mark.parametrize("restart", [False, True])
def test_document_masks_give_each_document_its_own_logits(model_type, restart):
    """Packed documents (``data.mask_document_boundaries``) through the
    sequence context (Note: [A sequence context through transformers'
    code]): each document's logits equal ``transformers``' model run on that
    document alone (positions along the row, or restarting at 0), sliding
    window layers (8 of 24 tokens) and full ones alike."""
    from simplefsdp.context_parallel import SequenceOptions
    from simplefsdp.models.hf_transformers.config import config_from_hf
    from simplefsdp.models.hf_transformers.spec import SPEC

    config_class = type(transformers.AutoConfig.for_model(model_type))
    extra = _WINDOWED.get(model_type, {})
    hf = config_class(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        sliding_window=8, pad_token_id=0, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(hf, attn_implementation="sdpa")
    model = SPEC.build(config_from_hf(hf.to_dict())).eval()
    model.load_state_dict(reference.state_dict())
    tokens = _tokens().clamp(min=1)
    ends = {0: [4, 15], 1: [9]}  # the end-of-document token 0 closes a document
    for row, positions in ends.items():
        tokens[row, positions] = 0
    options = SequenceOptions(eos_id=0, restart_positions=restart)
    with torch.no_grad():
        logits = model(tokens, context=options.prepare(tokens)[2])
        for row, row_ends in ends.items():
            for start, end in zip(
                [0, *(e + 1 for e in row_ends)], [*(e + 1 for e in row_ends), 24]
            ):
                positions = torch.arange(end - start) + (0 if restart else start)
                alone = reference(
                    input_ids=tokens[row : row + 1, start:end], position_ids=positions[None]
                ).logits
                torch.testing.assert_close(
                    logits[row : row + 1, start:end], alone, rtol=0, atol=2e-5
                )


def test_models_that_cannot_take_a_sequence_context_are_refused_in_one_line():
    """GPT-2 does not pass its keywords to its attention, LFM2 mixes tokens by
    convolutions (and reads its mask), attention dropout is not run: each is
    one line of the resolve step for document masks or context parallelism;
    a Mistral folder takes them."""
    from simplefsdp.engines.resolve import job_errors
    from simplefsdp.layout import Layout
    from simplefsdp.models.hf_transformers.config import config_from_hf
    from simplefsdp.models.hf_transformers.spec import SPEC

    def errors(model_type: str, cp: int = 1, documents: bool = True, **extra) -> list[str]:
        hf = type(transformers.AutoConfig.for_model(model_type))(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **extra,
        )  # fmt: skip
        layout = Layout(cp=cp)
        return job_errors(SPEC, config_from_hf(hf.to_dict()), layout, cp, "simplefsdp",
                          seq_len=32, document_masks=documents, model_name=model_type)  # fmt: skip

    assert errors("mistral") == [] and errors("mistral", cp=2, documents=False) == []
    (gpt2,) = errors("gpt2", n_embd=32, n_layer=2, n_head=4)
    assert gpt2 == (
        "document masks: model 'gpt2' cannot take a sequence context: transformers' code for "
        "model_type 'gpt2' does not hand its keyword arguments to the attention function of "
        "every layer (0 of 2 layers); use no document masks"
    )
    (lfm2,) = errors("lfm2", cp=2, documents=False, layer_types=["conv", "full_attention"])
    assert (
        lfm2.startswith("cp 2: model 'lfm2' cannot take a sequence context: ")
        and "use cp 1" in lfm2
    )
    (dropout,) = errors("mistral", cp=2, attention_dropout=0.1)
    assert "its attention_dropout is 0.1" in dropout
    assert dropout.endswith("use cp 1 and no document masks")


def test_attention_softcapping_is_kept_as_transformers_eager_attention_keeps_it():
    """Gemma 2 caps its attention scores (``attn_logit_softcapping``), which
    SDPA cannot: the family computes those layers' scores itself, and the
    logits equal ``transformers``' eager attention, which the model was
    trained with (``transformers``' SDPA function drops the cap); a sequence
    context is refused in one line."""
    from simplefsdp.engines.resolve import job_errors
    from simplefsdp.layout import Layout
    from simplefsdp.models.hf_transformers.config import config_from_hf
    from simplefsdp.models.hf_transformers.spec import SPEC

    hf = transformers.AutoConfig.for_model(
        "gemma2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
        max_position_embeddings=64, sliding_window=8, attn_logit_softcapping=0.5,
        layer_types=["sliding_attention", "full_attention"], pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(hf, attn_implementation="eager").eval()
    with torch.no_grad():  # scores well beyond the cap
        for name, param in eager.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                param.mul_(8.0)
    uncapped_hf = transformers.AutoConfig.for_model(
        **{**hf.to_dict(), "attn_logit_softcapping": None}
    )
    uncapped_model = transformers.AutoModelForCausalLM.from_config(
        uncapped_hf, attn_implementation="eager"
    ).eval()
    uncapped_model.load_state_dict(eager.state_dict())
    config = config_from_hf(hf.to_dict())
    model = SPEC.build(config).eval()
    model.load_state_dict(eager.state_dict())
    tokens = _tokens()
    with torch.no_grad():
        expected, uncapped, logits = (
            eager(tokens).logits,
            uncapped_model(tokens).logits,
            model(tokens),
        )
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    assert (uncapped - expected).abs().max() > 1e-3  # the cap matters here
    (refusal,) = job_errors(SPEC, config, Layout(cp=2), 2, "simplefsdp", seq_len=32,
                            document_masks=False, model_name="gemma2")  # fmt: skip
    assert "attn_logit_softcapping 0.5" in refusal and refusal.endswith("use cp 1")


def test_an_encoder_trains_only_as_a_decoder():
    """BERT is in ``transformers``' causal-LM mapping, but its attention sees
    later tokens unless its config sets ``is_decoder``: refused in one line
    without it; with it, a token changes no earlier logits."""
    from simplefsdp.models.hf_transformers.config import config_from_hf
    from simplefsdp.models.hf_transformers.spec import SPEC

    hf = transformers.AutoConfig.for_model(
        "bert", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=64,
    ).to_dict()  # fmt: skip
    with pytest.raises(ValueError, match="^config.json: model_type 'bert' attends to later") as e:
        config_from_hf(hf)
    assert "\n" not in str(e.value) and '"is_decoder": true' in str(e.value)
    model = SPEC.build(config_from_hf({**hf, "is_decoder": True})).eval()
    tokens = _tokens()
    changed = tokens.clone()
    changed[:, 12] = (changed[:, 12] + 1) % VOCAB
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :12], after[:, :12]) and not torch.equal(before, after)
    bart = transformers.AutoConfig.for_model("bart", vocab_size=VOCAB).to_dict()
    assert config_from_hf(bart).hf_config["model_type"] == "bart"  # its decoder sets the flag


def test_a_model_the_mask_check_cannot_run_says_why():
    """Mixtral's layers loop over the experts their tokens picked, which a
    fake tensor cannot tell: the refusal of a sequence context names that,
    not a missing SDPA attention."""
    from simplefsdp.models.hf_transformers.config import config_from_hf
    from simplefsdp.models.hf_transformers.model import sequence_context_refusal

    hf = transformers.AutoConfig.for_model(
        "mixtral", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    refusal = sequence_context_refusal(config_from_hf(hf.to_dict()))
    assert "does not run on fake tensors" in refusal and "nonzero" in refusal, refusal
