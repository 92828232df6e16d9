"""Chat fine-tuning data: conversations rendered by a tokenizer's chat template.

``simplefsdp data prepare --format chat --tokenizer DIR`` reads records with
``messages: [{"role": ..., "content": ...}, ...]`` (JSON Lines or Parquet),
renders each conversation with the chat template of the Hugging Face
tokenizer in ``DIR`` (``transformers.AutoTokenizer``, local files only) and
keeps, beside the token ids, a loss mask: 1 for the tokens of the
assistant's turns (their text and the template's end-of-turn marker), 0 for
everything else. Training predicts only the masked tokens.

Note: [Assistant spans]
    Templates rarely mark the assistant's tokens, but they render a
    conversation's prefix as a prefix of the whole: the text of assistant
    turn ``k`` is what ``messages[:k + 1]`` renders beyond what
    ``messages[:k]`` renders with the generation prompt (the header that
    opens the assistant's turn). The whole conversation is tokenised once
    with character offsets, and a token is the assistant's when its first
    character lies in such a span. A template that does not render prefixes
    as prefixes is refused with one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: The field of a record holding its conversation.
DEFAULT_MESSAGES_FIELD = "messages"


def _check_messages(value: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: messages must be a non-empty list of {{role, content}}")
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
            raise ValueError(f"{where}: every message needs a string 'role' (got {m!r:.60})")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: every message needs a string 'content' (got {m!r:.60})")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def read_conversations(path: Path, rel: str, field: str) -> list[tuple[str, list[dict[str, str]]]]:
    """``(name, messages)`` of every record of a JSON Lines or Parquet file.

    Raises:
        ValueError: not JSON Lines / Parquet, a record without ``field`` or
            with malformed messages (one line naming the file and record).
    """
    suffix = path.suffix.lower()
    out: list[tuple[str, list[dict[str, str]]]] = []
    if suffix in (".jsonl", ".ndjson"):
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}: line {lineno}"
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise ValueError(f"{where} is not JSON ({exc})") from None
                if not isinstance(record, dict) or field not in record:
                    fields = sorted(record)[:10] if isinstance(record, dict) else []
                    raise ValueError(
                        f"{where} has no field {field!r} (fields: {fields}); pass "
                        "--text-field with the field that holds the messages"
                    )
                out.append((f"{rel}:{lineno}", _check_messages(record[field], where)))
        return out
    if suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(
                f"{path} is Parquet, which needs the 'pyarrow' package: pip install pyarrow"
            ) from None
        schema = pq.read_schema(path)
        if field not in schema.names:
            raise ValueError(
                f"{path} has no column {field!r} (columns: {list(schema.names)[:10]}); pass "
                "--text-field with the column that holds the messages"
            )
        rows = pq.read_table(path, columns=[field]).column(field).to_pylist()
        for row, value in enumerate(rows):
            out.append((f"{rel}:{row}", _check_messages(value, f"{path}: row {row}")))
        return out
    raise ValueError(
        f"{path}: --format chat reads JSON Lines (.jsonl) or Parquet files with a "
        f"{DEFAULT_MESSAGES_FIELD!r} field"
    )


class ChatRenderer:
    """Renders conversations with a Hugging Face tokenizer's chat template.

    Args:
        spec: A local Hugging Face tokenizer folder (with its chat template).

    Raises:
        ValueError: ``transformers`` is missing, the folder cannot be loaded,
            or the tokenizer has no chat template (one line each).
    """

    def __init__(self, spec: str) -> None:
        try:
            import transformers
        except ImportError:
            raise ValueError(
                "--format chat renders conversations with the tokenizer's chat template, "
                "which needs the 'transformers' package: pip install transformers"
            ) from None
        if not Path(spec).expanduser().is_dir():
            raise ValueError(
                f"--format chat needs --tokenizer to be a Hugging Face tokenizer folder "
                f"(with a chat template), not {spec!r}"
            )
        try:
            self.tok = transformers.AutoTokenizer.from_pretrained(
                str(Path(spec).expanduser()), local_files_only=True
            )
        except (OSError, ValueError) as exc:
            raise ValueError(f"tokenizer {spec!r} cannot be loaded: {exc}") from None
        if not getattr(self.tok, "chat_template", None):
            raise ValueError(
                f"tokenizer {spec!r} has no chat template (tokenizer_config.json "
                "'chat_template' or chat_template.jinja); use a chat model's tokenizer"
            )
        if not getattr(self.tok, "is_fast", False):
            raise ValueError(f"tokenizer {spec!r}: --format chat needs a fast tokenizer")
        self.spec = spec

    def _render(self, messages: list[dict[str, str]], prompt: bool = False) -> str:
        if not messages:
            return ""
        return str(
            self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        )

    def render(self, messages: list[dict[str, str]], name: str = "") -> tuple[list[int], list[int]]:
        """``(ids, mask)`` of one conversation: mask 1 on assistant tokens
        (see [Assistant spans]).

        Raises:
            ValueError: the template does not render prefixes as prefixes.
        """
        full = self._render(messages)
        spans = []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._render(messages[:k], prompt=True)
            upto = self._render(messages[: k + 1])
            if not (full.startswith(upto) and upto.startswith(before)):
                raise ValueError(
                    f"{name}: the chat template of {self.spec!r} does not render the "
                    "conversation's beginning as the beginning of the whole, so the "
                    "assistant's tokens cannot be found"
                )
            spans.append((len(before), len(upto)))
        enc = self.tok(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = [int(i) for i in enc["input_ids"]]
        mask = [int(any(a <= start < b for a, b in spans)) for start, _ in enc["offset_mapping"]]
        return ids, mask
