"""Load a model written by ``simplefsdp export`` in plain PyTorch and generate text.

    simplefsdp train
    simplefsdp export --checkpoint outputs/debug --out model.safetensors
    python examples/load_exported_model.py --model model.safetensors --prompt "def "

The export is one safetensors file of full (unsharded) tensors under the plain
state-dict names of ``simplefsdp.models.llama3.Transformer`` (torchtitan's
Llama names: ``tok_embeddings.weight``, ``layers.0.attention.wq.weight``, ...)
and a ``model.config.json`` next to it with the model's arguments and the
training job. No process group, GPU or simplefsdp wrapping is involved: the
model is an ordinary ``nn.Module``. The script prints the model's next-token
loss on the prompt and a greedy continuation (no KV cache: the whole window
is recomputed for each new token, which is fine for a few dozen tokens).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from simplefsdp.checkpoint import model_args_from_config
from simplefsdp.data import load_tokenizer
from simplefsdp.models.llama3 import Transformer


def load_model(weights: Path, config_path: Path, device: str) -> tuple[Transformer, dict]:
    """The exported model, in float32 on ``device``, in eval mode; and its config."""
    config = json.loads(config_path.read_text())
    with torch.device(device):
        model = Transformer(model_args_from_config(config))  # randomly initialised ...
    model.load_state_dict(load_file(str(weights), device=device), strict=True)  # ... then loaded
    return model.eval(), config


@torch.no_grad()
def prompt_loss(model: Transformer, ids: list[int], device: str) -> float | None:
    """Mean next-token cross-entropy over the prompt (``None`` for a 1-token prompt)."""
    if len(ids) < 2:
        return None
    tokens = torch.tensor([ids[-model.args.max_seq_len :]], device=device)
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits[0].float(), tokens[0, 1:]).item()


@torch.no_grad()
def generate(
    model: Transformer, ids: list[int], max_new_tokens: int, eos_id: int | None, device: str
) -> list[int]:
    """Greedy decoding: the most likely next token, ``max_new_tokens`` times or until EOS."""
    out = list(ids)
    for _ in range(max_new_tokens):
        window = torch.tensor([out[-model.args.max_seq_len :]], device=device)
        next_id = int(model(window)[0, -1].argmax())
        if next_id == eos_id:
            break
        out.append(next_id)
    return out[len(ids) :]


def printable(text: str) -> str:
    """``text`` with control characters (an undertrained model emits some) shown as U+FFFD."""
    return "".join(c if c.isprintable() or c in "\n\t" else "\ufffd" for c in text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="the .safetensors file of the export")
    parser.add_argument(
        "--config", default=None, help="its config JSON (default: <model>.config.json beside it)"
    )
    parser.add_argument("--prompt", default="def ", help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--device", default="cpu", help="e.g. cpu or cuda")
    args = parser.parse_args()

    weights = Path(args.model)
    if weights.suffix != ".safetensors":
        parser.error(f"--model {args.model!r} is not a .safetensors file")
    config_path = Path(args.config or weights.with_name(weights.stem + ".config.json"))
    if not weights.is_file() or not config_path.is_file():
        parser.error(f"need both {weights} and {config_path} (written by simplefsdp export)")

    model, config = load_model(weights, config_path, args.device)
    # The tokenizer the model was trained with: "byte" (ByteTokenizer) or a local path.
    tokenizer = load_tokenizer(config["job"]["data"]["tokenizer"])
    n_params = sum(p.numel() for p in model.parameters())
    a = model.args
    print(
        f"loaded {weights}: {n_params / 1e6:.2f}M parameters, trained {config.get('step')} steps "
        f"(dim {a.dim}, {a.n_layers} layers, vocab {a.vocab_size}, tokenizer {tokenizer!r})"
    )

    ids = tokenizer.encode(args.prompt)
    if not ids:
        parser.error("--prompt encodes to no tokens")
    loss = prompt_loss(model, ids, args.device)
    if loss is not None:
        print(
            f"prompt loss {loss:.4f} (perplexity {math.exp(loss):.1f}) over {len(ids) - 1} tokens"
        )
    new = generate(model, ids, args.max_new_tokens, tokenizer.eos_id, args.device)
    print(f"generated {len(new)} tokens (greedy):")
    print(printable(args.prompt + tokenizer.decode(new)))


if __name__ == "__main__":
    main()
