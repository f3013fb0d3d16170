"""Tiny tokenizers built in the test: a tokenizer.json directory, a sentencepiece directory, and a
sentencepiece vocabulary written into a GGUF file ("llama" tokenizer model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import sentencepiece
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from radixrelay.text.tokenizer import load_tokenizer

TRAINING_TEXT = [
    "the cat sat on the mat and the dog sat on the log",
    "a quick brown fox jumps over the lazy dog again and again",
    "tokenizers split text into pieces; pieces become ids",
    "numbers like 42 and 1234 appear in text too",
    "café crème brûlée, 中文 and emoji 😀 are rarer",
] * 20

SAMPLES = ["the cat sat", "  two  spaces ", "new\nline", "café 中文 😀 unseen ✓ chars", "42 dogs", ""]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf_tok")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<eot>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TRAINING_TEXT, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": "{{ messages }}"})
    )
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    return path


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sp_tok")
    corpus = path / "corpus.txt"
    corpus.write_text("\n".join(TRAINING_TEXT), encoding="utf-8")
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(path / "tokenizer"),
        model_type="bpe",
        vocab_size=320,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",  # as Llama: no NFKC, spaces kept
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    return path


def test_tokenizer_json_dir(hf_dir: Path) -> None:
    tok = load_tokenizer(hf_dir)
    assert tok.bos_token_id == 0 and tok.add_bos_token  # the post-processor adds <s>
    assert tok.eos_token_ids == {1, 2} and tok.eos_token == "</s>"
    assert tok.chat_template == "{{ messages }}"
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids[0] == 0 and tok.encode(text, add_special_tokens=False) == ids[1:]
        assert tok.decode(ids) == text
    assert tok.encode("<eot>x", add_special_tokens=False)[0] == 2


def test_sentencepiece_dir(sp_model: Path) -> None:
    tok = load_tokenizer(sp_model)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_model / "tokenizer.model"))
    assert tok.bos_token_id == sp.bos_id() and tok.eos_token_ids == {sp.eos_id()}
    assert tok.chat_template is None
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids == [sp.bos_id(), *sp.encode(text)]
        assert tok.decode(ids) == sp.decode(sp.encode(text))
    assert tok.encode("a</s>b", add_special_tokens=False) == [*sp.encode("a"), sp.eos_id(), *sp.encode("b")]
    assert tok.decode([sp.eos_id()], skip_special_tokens=False) == "</s>"


def _write_llama_gguf(sp_dir: Path, out: Path) -> None:
    gguf = pytest.importorskip("gguf")
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_dir / "tokenizer.model"))
    types = []
    for i in range(sp.get_piece_size()):
        if sp.is_unknown(i):
            types.append(gguf.TokenType.UNKNOWN)
        elif sp.is_control(i):
            types.append(gguf.TokenType.CONTROL)
        elif sp.is_byte(i):
            types.append(gguf.TokenType.BYTE)
        else:
            types.append(gguf.TokenType.NORMAL)
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name("tiny-sp")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(sp.get_piece_size())])
    writer.add_token_scores([sp.get_score(i) for i in range(sp.get_piece_size())])
    writer.add_token_types(types)
    writer.add_bos_token_id(sp.bos_id())
    writer.add_eos_token_id(sp.eos_id())
    writer.add_unk_token_id(sp.unk_id())
    writer.add_chat_template("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_sentencepiece_vocabulary(sp_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_llama_gguf(sp_model, path)
    tok = load_tokenizer(path)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_model / "tokenizer.model"))
    assert tok.name == "tiny-sp" and tok.add_bos_token and tok.bos_token == "<s>"
    for text in [*SAMPLES, *TRAINING_TEXT[:5]]:
        assert tok.encode(text) == [sp.bos_id(), *sp.encode(text)], text
        assert tok.decode(tok.encode(text)) == sp.decode(sp.encode(text))


def test_unknown_inputs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="expected a .gguf file"):
        load_tokenizer(tmp_path / "missing.bin")
