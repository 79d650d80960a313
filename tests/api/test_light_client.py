"""The client side installs as one name, specq, and runs without the model stack: no torch,
no transformers, from importing the client to submitting prompts that must be tokenized."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from specq.api.tokenizer import prompt_tokenizer, target_context
from specq.configs.presets import get_preset
from specq.configs.settings import Settings
from specq.schema.generation import Request, RequestError

# too long to fit the tiny model's 512-token context by size alone (one token per byte at
# most), short enough to fit once tokenized: the tokenizer must be loaded to tell
LONG = ("Rewrite this formally: " + "the quick brown fox jumps over the lazy dog " * 11)[:495]
MESSAGES = [[{"role": "system", "content": "You rewrite text."},
             {"role": "user", "content": LONG[:400]}],
            [{"role": "user", "content": "Héllo wörld — ünïcode, emoji 🙂 and\ttabs"}]]


def _python(code: str, cwd, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={**_env(), **env})


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("SPECQ_")}


def test_one_import_name_and_no_model_stack_on_import(tmp_path):
    out = _python("import json, sys\n"
                  "from specq import Client, Job, InputError\n"
                  "import specq.api.cli, specq.api.formats, specq.api.synthesis\n"
                  "print(json.dumps([m for m in ('torch', 'transformers') if m in sys.modules]))",
                  tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []
    for name in ("api", "worker", "db", "configs"):  # nothing generic is claimed
        missing = _python(f"import {name}", tmp_path)
        assert missing.returncode != 0 and "ModuleNotFoundError" in missing.stderr


def test_submitting_prompts_that_need_the_tokenizer_loads_no_model_stack(tmp_path, data_dir):
    code = (
        "import sys, json\n"
        "from specq import Client, Settings\n"
        f"c = Client(Settings(data_dir={str(data_dir)!r}, "
        f"database_url='sqlite:///{tmp_path / 'x.db'}'), auto_migrate=True)\n"
        f"job = c.submit([{LONG!r}] * 3 + {MESSAGES!r}, pair='tiny', max_new_tokens=8, "
        "enqueue=False)\n"
        "print(json.dumps([job.status(check_workers=False).total, 'tokenizers' in sys.modules, "
        "'torch' in sys.modules, 'transformers' in sys.modules]))\n")
    out = _python(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == [5, True, False, False]


def test_the_light_tokenizer_encodes_as_the_engine_does(data_dir, tiny_tokenizer):
    from specq.worker.engine.speculative import encode_prompt

    settings = Settings(data_dir=data_dir)
    preset = get_preset("tiny")
    light, context = prompt_tokenizer(preset, settings), target_context(preset, settings)
    assert context == 512
    requests = [Request(prompt=p, max_new_tokens=4) for p in ("Hi", "  spaced  out ", LONG[:200])]
    requests += [Request(messages=m[-1:], max_new_tokens=4) for m in MESSAGES]
    for r in requests:
        assert light.encode(r, 10**9) == encode_prompt(tiny_tokenizer, r, 10**9)
    with pytest.raises(RequestError, match="prompt: .* tokens, the model's context is 512"):
        light.encode(Request(prompt=LONG * 3, max_new_tokens=4), context)


def test_the_light_tokenizer_refuses_a_prompt_far_too_long_untokenized(data_dir):
    """What the engine refuses by size (check_size), a submission refuses the same way,
    before the tokenizer sees it."""
    import dataclasses

    settings = Settings(data_dir=data_dir)
    preset = get_preset("tiny")
    light, context = prompt_tokenizer(preset, settings), target_context(preset, settings)
    seen: list[int] = []

    class Spy:
        def encode(self, text, **kwargs):
            seen.append(len(text))
            return light.tokenizer.encode(text, **kwargs)

        def get_vocab(self):
            return light.tokenizer.get_vocab()

    spying = dataclasses.replace(light, tokenizer=Spy(), longest_token=0)
    assert spying.longest_token == light.longest_token > 1
    huge = "the quick brown fox " * 400_000
    for request in (Request(prompt=huge, max_new_tokens=4),
                    Request(messages=[{"role": "user", "content": huge}], max_new_tokens=4)):
        with pytest.raises(RequestError, match="prompt: at least .* the model's context is 512"):
            spying.encode(request, context)
    assert seen == []
    assert spying.encode(Request(prompt="Hi", max_new_tokens=4), context) == light.encode(
        Request(prompt="Hi", max_new_tokens=4), context)
