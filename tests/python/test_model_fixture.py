"""The tiny copy-task fixture model loads offline and its answer comes from the prompt's KV cache.

Run: .venv/bin/python -m pytest tests/python/test_model_fixture.py -q
Needs torch and transformers (in .venv); reads only tests/fixtures/tiny-copy-model.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"
MODEL_DIR = FIXTURES / "tiny-copy-model"
sys.path.insert(0, str(FIXTURES))

import model_task  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch", reason="torch is not installed in this environment")
transformers = pytest.importorskip("transformers",
                                   reason="transformers is not installed in this environment")

# Held-out prompts: the training script evaluates with seed 7 and trains on its own stream.
HELD_OUT_SEED = 4242
N_PROMPTS = 32
# The fixture scores ~0.98+ (metadata.json); anything below this means a broken fixture.
MIN_ACCURACY = 0.85


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(str(MODEL_DIR), local_files_only=True)


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    m = transformers.AutoModelForCausalLM.from_pretrained(
        str(MODEL_DIR), local_files_only=True, dtype=torch.float32)
    m.eval()
    return m


def _ids(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=True)["input_ids"]


def _greedy(model, tok, prompt: str, max_new: int = model_task.MAX_KEY_LEN + 1) -> str:
    ids = torch.tensor([_ids(tok, prompt)])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=max_new, do_sample=False,
                             pad_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_fixture_files_present():
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "model.safetensors", "metadata.json"):
        assert (MODEL_DIR / name).is_file(), f"missing {name} in {MODEL_DIR}"
    cfg = json.loads((MODEL_DIR / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["vocab_size"] == len(model_task.vocab())
    assert cfg["head_dim"] in (32, 64, 80, 96, 112, 128), "head_dim must suit vLLM CPU attention"


def test_tokenizer_is_character_level_without_added_specials(tok):
    prompt = "ab0[XYZ]q?"
    ids = _ids(tok, prompt)
    assert len(ids) == len(prompt), "one token per character, no BOS/EOS added"
    assert ids == [model_task.vocab().index(c) for c in prompt]
    assert tok.decode(ids) == prompt
    assert tok.eos_token_id == model_task.vocab().index(model_task.EOS_TOKEN)
    assert len(_ids(tok, "?")) == 1


def test_greedy_accuracy_on_held_out_prompts(model, tok):
    lengths = model_task.eval_lengths(N_PROMPTS, HELD_OUT_SEED, block_size=32)
    exs = model_task.examples(HELD_OUT_SEED, lengths)
    pairs = [(ex, _greedy(model, tok, ex.prompt)) for ex in exs]
    correct, scored = model_task.accuracy(pairs)
    assert scored >= N_PROMPTS - 1
    wrong = [(ex.answer, out, len(ex.prompt)) for ex, out in pairs
             if model_task.score(ex, out) is False]
    assert correct / scored >= MIN_ACCURACY, f"accuracy {correct}/{scored}; wrong: {wrong}"


def test_one_token_prompt_generates(model, tok):
    # Unscored, but it must run (the e2e test sends a 1-token prompt).
    out = _greedy(model, tok, "?", max_new=4)
    assert isinstance(out, str)


def test_answer_follows_the_key_not_the_suffix(model, tok):
    # Same filler around the key, different keys: the answers differ and follow the keys.
    rng = random.Random(11)
    filler = "".join(rng.choice(model_task.FILLER_CHARS) for _ in range(150))
    a = filler[:40] + "[QWERTY]" + filler[40:] + "?"
    b = filler[:40] + "[ZXCVBN]" + filler[40:] + "?"
    assert _greedy(model, tok, a) == "QWERTY"
    assert _greedy(model, tok, b) == "ZXCVBN"


def _prefill_cache(model, ids: list[int]):
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
    return out.past_key_values


def _next_token_from_cache(model, cache, last_id: int, pos: int) -> int:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([[last_id]]), past_key_values=cache,
                    cache_position=torch.tensor([pos]), use_cache=True)
    return int(out.logits[0, -1].argmax())


def _layers_kv(cache):
    """(key, value) tensors per layer, shape [batch, kv_heads, tokens, head_dim]."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return [(cache.key_cache[i], cache.value_cache[i]) for i in range(len(cache.key_cache))]


def test_decode_step_reads_the_answer_from_the_kv_cache(model, tok):
    """What a decode instance does after a KV transfer: it computes only the last prompt token
    on top of KV it did not compute. The right KV gives the key; another request's KV (same
    length, different key) gives that request's key; corrupting the block that holds the key
    changes the answer."""
    block = 32  # vLLM CPU block size used by the e2e tests
    rng = random.Random(5)
    ex_a = model_task.make_example(rng, 4 * block + 1)
    ex_b = model_task.make_example(rng, 4 * block + 1)
    assert ex_a.answer and ex_b.answer and ex_a.answer[0] != ex_b.answer[0]
    ids_a, ids_b = _ids(tok, ex_a.prompt), _ids(tok, ex_b.prompt)
    n = len(ids_a) - 1
    first_a = tok.convert_tokens_to_ids(ex_a.answer[0])
    first_b = tok.convert_tokens_to_ids(ex_b.answer[0])

    # Correct KV ("transferred" from a separate prefill of all but the last token).
    cache = _prefill_cache(model, ids_a[:n])
    assert _next_token_from_cache(model, cache, ids_a[n], n) == first_a

    # KV of another request with the same length: the answer follows the KV, not the last token.
    cache = _prefill_cache(model, ids_b[:n])
    assert _next_token_from_cache(model, cache, ids_a[n], n) == first_b

    # Zeroed KV in the block that holds request A's key.
    cache = _prefill_cache(model, ids_a[:n])
    kb = ex_a.key_pos // block
    for k, v in _layers_kv(cache):
        k[:, :, kb * block:(kb + 1) * block, :] = 0
        v[:, :, kb * block:(kb + 1) * block, :] = 0
    assert _next_token_from_cache(model, cache, ids_a[n], n) != first_a
