"""kuai.data.Tokenizer: a tokenizer.json read from Python gives the ids the CLI's `kuai tokenize`
gives, decodes back to the text, and names what is wrong with a bad file; kuai's byte tokenizer
through get_tokenizer."""

import json
import pathlib
import subprocess

import pytest

import kuai

SP = "\u2581"
ROOT = pathlib.Path(__file__).resolve().parents[2]


def small_tokenizer_json():
    """LLaMA-2's layout, small: specials, the 256 byte tokens, ▁, ASCII and a few merges."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    vocab[SP] = len(vocab)
    for c in range(33, 127):
        vocab[chr(c)] = len(vocab)
    merges = []
    for word in ["the", "and", "God"]:
        left = SP
        for ch in word:
            merges.append(f"{left} {ch}")
            left += ch
            vocab.setdefault(left, len(vocab))
    special = lambda i, c: {"id": i, "content": c, "single_word": False, "lstrip": False,
                            "rstrip": False, "normalized": False, "special": True}
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": SP},
            {"type": "Replace", "pattern": {"String": " "}, "content": SP}]},
        "pre_tokenizer": None,
        "post_processor": {"type": "TemplateProcessing",
                           "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                      {"Sequence": {"id": "A", "type_id": 0}}],
                           "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": SP}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": True, "byte_fallback": True,
                  "vocab": vocab, "merges": merges},
    }


TEXTS = ["the God and the earth", "  spaces  ", "naïve café 日本 🎉", ""]


@pytest.fixture()
def tokenizer_file(tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(small_tokenizer_json()), encoding="utf-8")
    return path


def test_encode_decode_match_the_cli(tokenizer_file, kuai_bin, tmp_path):
    tok = kuai.data.Tokenizer.from_file(str(tokenizer_file))
    assert tok.get_vocab_size() == 3 + 256 + 1 + 94 + 9
    assert tok.encode("the") == [1, tok.token_to_id(SP + "the")]
    assert tok.encode("the", add_special_tokens=False) == [tok.token_to_id(SP + "the")]
    assert tok.id_to_token(1) == "<s>"
    assert tok.token_to_id("nope") is None
    text_file = tmp_path / "lines.txt"
    text_file.write_bytes("\n".join(TEXTS).encode() + b"\n")
    cli = subprocess.run([kuai_bin, "tokenize", "--tokenizer", str(tokenizer_file),
                          "--file", str(text_file)], check=True, capture_output=True, text=True)
    expected = [[int(x) for x in line.split()] for line in cli.stdout.splitlines()]
    assert [tok.encode(t) for t in TEXTS] == expected
    assert tok.encode_batch(TEXTS) == expected
    for t in TEXTS:
        assert tok.decode(tok.encode(t)) == t
    assert tok.decode(tok.encode("the"), skip_special_tokens=False) == "<s> the"
    # A character cut between its byte tokens: str gets U+FFFD, decode_bytes the bytes.
    ids = tok.encode("🎉", add_special_tokens=False)
    assert tok.decode_bytes(ids[:2]) == "🎉".encode()[:1]
    assert tok.decode(ids[:2]) == "\ufffd"


def test_bad_files_name_the_problem(tmp_path):
    j = small_tokenizer_json()
    j["normalizer"] = {"type": "NFKC"}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(j))
    with pytest.raises(RuntimeError, match=r'bad\.json: normalizer: the normalizer "NFKC"'):
        kuai.data.Tokenizer.from_file(str(bad))
    with pytest.raises(RuntimeError, match="cannot open"):
        kuai.data.Tokenizer.from_file(str(tmp_path / "missing.json"))


def test_get_tokenizer_byte_and_path(tokenizer_file):
    byte = kuai.data.get_tokenizer("byte")
    assert byte.encode("aé") == [97, 0xC3, 0xA9]
    assert byte.decode([97, 0xC3, 0xA9]) == "aé"
    with pytest.raises(ValueError, match="needs a tokenizer.json"):
        byte.token_to_id("a")
    by_dir = kuai.data.get_tokenizer(str(tokenizer_file.parent))
    assert by_dir.encode("the and") == kuai.data.Tokenizer.from_file(str(tokenizer_file)).encode("the and")
