"""Submitting needs only what the submitter is given: prompt lengths are checked with a
tokenizer cached on this machine (by a worker, or `specq cache-tokenizer`), or not checked,
with a note; the hub is never asked. And a hub error says which it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import yaml
from huggingface_hub import errors as hub
from transformers import AutoConfig, AutoTokenizer

from specq.configs import tokenizer_cache
from specq.configs.hub import hub_problem
from specq.configs.presets import get_preset
from specq.worker.pairs import cache_tokenizer

HUB_ID = "specq-test/no-such-model"  # a pair whose target lives on the hub only
LONG = ("Rewrite this formally: " + "the quick brown fox jumps over the lazy dog " * 11)[:495]
# Every connection to the hub (HF_ENDPOINT below) ends the process: the test sees it.
GUARD = """
import socket, sys
_connect = socket.socket.connect
def _guarded(self, address):
    if isinstance(address, tuple) and address[1] == 9:
        print("HUB CONTACTED", file=sys.stderr); sys.stderr.flush(); import os; os._exit(3)
    return _connect(self, address)
socket.socket.connect = _guarded
"""


@pytest.fixture
def hub_pair(tmp_path):
    """A presets file naming the pair hub-tiny (target: a hub id), and the environment of a
    machine with no hub: every request to it would go to a closed local port."""
    presets = tmp_path / "presets.yaml"
    presets.write_text(yaml.safe_dump({"hub-tiny": {"target": {"path": HUB_ID},
                                                    "drafter": "prompt_lookup"}}))
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SPECQ_", "HF_"))}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf"),
               SPECQ_PRESETS_FILE=str(presets), SPECQ_DATA_DIR=str(tmp_path / "data"),
               SPECQ_DATABASE_URL=f"sqlite:///{tmp_path / 'x.db'}")
    return presets, env


def _submit(env: dict, prompts: list, cwd) -> dict:
    code = GUARD + (
        "import json, sys\n"
        "from specq import Client, InputError\n"
        "c = Client(auto_migrate=True)\n"
        "try:\n"
        f"    job = c.submit({prompts!r}, pair='hub-tiny', max_new_tokens=8, enqueue=False)\n"
        "    out = {'total': job.status(check_workers=False).total, 'note': job.unchecked}\n"
        "except InputError as exc:\n"
        "    out = {'problems': exc.problems}\n"
        "out['torch'] = 'torch' in sys.modules\n"
        "print(json.dumps(out))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_submit_checks_prompts_with_a_tokenizer_a_worker_cached_and_never_asks_the_hub(
        hub_pair, data_dir, tmp_path):
    presets, env = hub_pair
    preset = get_preset("hub-tiny", presets)
    target = data_dir / "tiny" / "target"
    worker_side = SimpleNamespace(preset=preset, tokenizer=AutoTokenizer.from_pretrained(target),
                                  target=SimpleNamespace(config=AutoConfig.from_pretrained(target)))
    folder = cache_tokenizer(worker_side, tmp_path / "data")  # what a worker writes at start
    assert tokenizer_cache.is_complete(folder)
    assert tokenizer_cache.read_context(folder) == 512

    got = _submit(env, [LONG] * 3 + ["Fix: he go home"], tmp_path)
    assert got == {"total": 4, "note": None, "torch": False}
    got = _submit(env, ["Fix: he go home", LONG * 3], tmp_path)  # too long, once tokenized
    assert len(got["problems"]) == 1 and got["problems"][0].startswith("prompt 2: ")
    assert "the model's context is 512" in got["problems"][0]
    got = _submit({**env, "HF_HUB_OFFLINE": "1"}, [LONG], tmp_path)
    assert got["note"] is None


def test_without_a_cached_tokenizer_submit_says_prompts_were_not_checked(hub_pair, tmp_path):
    _, env = hub_pair
    got = _submit(env, [LONG, "Fix: he go home"], tmp_path)
    assert got["total"] == 2 and not got["torch"]
    assert got["note"].startswith("prompt lengths not checked: no cached tokenizer for "
                                  f"{HUB_ID}"), got["note"]
    assert "specq cache-tokenizer --pair hub-tiny" in got["note"]


def test_cache_tokenizer_fetches_what_submit_reads_and_says_why_it_cannot(hub_pair, data_dir,
                                                                        tmp_path):
    presets, env = hub_pair
    local = yaml.safe_load(presets.read_text())
    local["local-tiny"] = {"target": {"path": str(data_dir / "tiny" / "target")},
                           "drafter": "prompt_lookup"}
    presets.write_text(yaml.safe_dump(local))

    def cache(pair: str, **more) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", GUARD + "import sys\n"
                               "from specq.api.cli import main\n"
                               f"sys.exit(main(['cache-tokenizer', '--pair', {pair!r}]))"],
                              cwd=tmp_path, env={**env, **more}, capture_output=True,
                              text=True, timeout=120)

    done = cache("local-tiny")
    assert done.returncode == 0, done.stderr
    assert "context 512 tokens" in done.stderr
    folder = tokenizer_cache.cache_dir(get_preset("local-tiny", presets).target,
                                       tmp_path / "data")
    assert tokenizer_cache.is_complete(folder) and tokenizer_cache.read_context(folder) == 512

    done = cache("hub-tiny", HF_HUB_OFFLINE="1")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"error: {HUB_ID}: the hub cannot be reached (HF_HUB_OFFLINE is set) and config.json "
        "is not in the local cache (HF_HOME)"], done.stderr


def _error(cls: type[Exception]) -> Exception:
    """A hub error as transformers hands it on: an OSError caused by the hub's own."""
    inner = cls.__new__(cls)
    Exception.__init__(inner, "401 Client Error")
    outer = OSError("wrapped")
    outer.__cause__ = inner
    return outer


@pytest.mark.parametrize("error, says", [
    (_error(hub.GatedRepoError), "is a gated model: accept its terms"),
    (_error(hub.RepositoryNotFoundError), "no such model on the hub"),
    (_error(hub.RevisionNotFoundError), "no such revision"),
    (_error(hub.RemoteEntryNotFoundError), "the hub has no config.json"),
    (hub.LocalEntryNotFoundError("not cached"), "the hub cannot be reached"),
    (ConnectionError("refused"), "the hub cannot be reached (no connection)"),
    (ValueError("something else"), None),
])
def test_a_hub_error_says_gated_missing_or_unreachable(error, says, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    problem = hub_problem(error, "org/model", "config.json")
    assert (problem is None) if says is None else (says in problem and
                                                   problem.startswith("org/model"))


def test_a_note_says_what_kind_of_model_has_no_tokenizer_here(tmp_path):
    """A tiny test model not built yet, a local path that is not there and a hub id not in
    the hub's cache are each named as what they are (a tiny model is no 'hub model')."""
    from specq.api.tokenizer import TokenizerUnavailable, target_context
    from specq.configs.presets import ModelSource, PairPreset
    from specq.configs.settings import Settings

    settings = Settings(data_dir=tmp_path / "data")
    cases = {"a tiny test model not built": ModelSource(tiny="target"),
             "a local path that does not exist": ModelSource(path=str(tmp_path / "nowhere")),
             "a hub model not in this machine's hub cache":
                 ModelSource(path="someone/not-cached-anywhere")}
    for want, source in cases.items():
        preset = PairPreset(name="p", target=source, drafter="prompt_lookup")
        with pytest.raises(TokenizerUnavailable, match=want) as got:
            target_context(preset, settings)
        assert ("hub model" in str(got.value)) is want.startswith("a hub")


def test_a_gguf_context_is_read_from_the_header_alone(tmp_path):
    """The context of a GGUF file, as gguf's own reader gives it, without parsing the
    vocabulary: a file whose context key comes after a large token array, and one with
    none (2**31); a file that is not GGUF is refused, naming it."""
    import gguf

    from specq.api.tokenizer import TokenizerUnavailable, _gguf_context

    for context in (4096, None):
        path = tmp_path / f"m{context}.gguf"
        writer = gguf.GGUFWriter(str(path), "llama")
        writer.add_token_list([f"tok{i}" for i in range(5000)])
        writer.add_array("llama.some_numbers", list(range(100)))
        if context:
            writer.add_context_length(context)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.close()
        reader = gguf.GGUFReader(str(path))
        field = reader.fields.get("llama.context_length")
        want = int(field.parts[field.data[0]][0]) if field else 2**31
        assert _gguf_context(path) == want == (context or 2**31)
    (tmp_path / "x.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(TokenizerUnavailable, match="x.gguf: not a GGUF file"):
        _gguf_context(tmp_path / "x.gguf")
