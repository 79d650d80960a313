"""Where submitters find a target's tokenizer: one folder per target model in the data
directory, ``DATA_DIR/tokenizers/KEY`` (KEY: a hash of the preset's target source).

A submission checks that each prompt fits the target's context without the model stack and
without the hub (api/tokenizer.py). A worker writes the folder when it starts, from the
tokenizer and config it has just loaded (worker/pairs.py: cache_tokenizer);
`specq cache-tokenizer --pair NAME` writes it on a machine that shares no data directory
with a worker. The folder holds what transformers' ``save_pretrained`` writes
(tokenizer.json, tokenizer_config.json, maybe chat_template.jinja) and CONTEXT_FILE, the
target's context length. A GGUF model's tokenizer converted by a submitter lands in the
same folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from specq.configs.presets import ModelSource

TOKENIZERS = "tokenizers"  # under the data directory
CONTEXT_FILE = "context.json"  # {"context_length": N, "model": LABEL}
NEEDED = ("tokenizer.json", "tokenizer_config.json", CONTEXT_FILE)


def cache_dir(source: ModelSource, data_dir: Path) -> Path:
    """The folder of ``source``'s tokenizer (whether it exists or not)."""
    key = hashlib.sha1(source.model_dump_json().encode()).hexdigest()
    return Path(data_dir) / TOKENIZERS / key


def is_complete(folder: Path) -> bool:
    """The folder holds all a prompt check needs: tokenizer, its config, the context."""
    return all((folder / name).is_file() for name in NEEDED)


def read_context(folder: Path) -> int | None:
    try:
        return int(json.loads((folder / CONTEXT_FILE).read_text())["context_length"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_context(folder: Path, context: int, label: str) -> None:
    (folder / CONTEXT_FILE).write_text(json.dumps({"context_length": context, "model": label}))


def install(tmp: Path, folder: Path) -> None:
    """Put the folder written at ``tmp`` in the place of ``folder``, unless it holds the
    same files already. Readers see the old folder, the new one or (for an instant) none,
    never half of one; of workers starting together, one wins."""
    if is_complete(folder) and all((tmp / n).read_bytes() == (folder / n).read_bytes()
                                   for n in NEEDED if (tmp / n).is_file()):
        shutil.rmtree(tmp, ignore_errors=True)
        return
    folder.parent.mkdir(parents=True, exist_ok=True)
    old = folder.with_name(f"{folder.name}.{os.getpid()}.old")
    try:
        if folder.exists():
            folder.rename(old)
        tmp.rename(folder)
    except OSError:  # another process's folder came first
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
