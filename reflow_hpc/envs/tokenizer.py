"""The tokenizers of the tiny CPU policy, built in code (no download): one token per character, or per byte.

``model.tiny_tokenizer`` chooses. The **character** tokenizer (``char``, the arithmetic tasks') is
described below; the **byte-level** one (``byte``, the coding tasks') has the same special tokens and
tool markers followed by the 256 byte symbols of GPT-2's byte-level alphabet, so any UTF-8 text
encodes (a HumanEval docstring, an APPS statement) and decodes back exactly, one token per byte.

Vocabulary, in id order:

- special tokens ``<pad>`` (0), ``<bos>`` (1), ``<eos>`` (2), ``<unk>`` (3);
- the tool markers of ``calculator_tool`` (``<tool_call>``, ``</tool_call>``, ``<tool_response>``,
  ``</tool_response>``) as single ordinary tokens, so ``skip_special_tokens`` keeps them and an
  engine can stop on ``</tool_call>`` by id;
- every printable ASCII character (space to ``~``) and newline.

It is a ``tokenizers`` BPE model without merges (so every character is its own token) wrapped in
``transformers.PreTrainedTokenizerFast``; ``save_pretrained(dir)`` writes ``tokenizer.json`` and a
plain ``AutoTokenizer.from_pretrained(dir)`` loads it offline. ``encode`` prepends ``<bos>``;
``decode(ids, skip_special_tokens=True)`` returns the text exactly (characters outside the
vocabulary become ``<unk>``, which no built-in task produces).

``tokenizers`` and ``transformers`` are imported when the tokenizer is built, not when this module
is imported.
"""

from __future__ import annotations

from typing import Any

from .calculator_tool import MARKERS

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL = (PAD, BOS, EOS, UNK)
CHARACTERS = tuple(chr(c) for c in range(0x20, 0x7F)) + ("\n",)


def vocabulary() -> dict[str, int]:
    return {tok: i for i, tok in enumerate(SPECIAL + MARKERS + CHARACTERS)}


def build_tokenizer(kind: str, max_length: int = 256) -> Any:
    """The tiny policy's tokenizer of ``kind`` (``model.tiny_tokenizer``: char or byte)."""
    if kind == "byte":
        return build_byte_tokenizer(max_length)
    if kind == "char":
        return build_char_tokenizer(max_length)
    raise ValueError(f"model.tiny_tokenizer must be char or byte, not {kind!r}")


def build_byte_tokenizer(max_length: int = 2048) -> Any:
    """A ``PreTrainedTokenizerFast`` over the special tokens, the tool markers and the 256 byte symbols."""
    from tokenizers import decoders, pre_tokenizers

    # No regex split and no prefix space: the bytes of the text, in order, and nothing else.
    return _build(SPECIAL + MARKERS + byte_symbols(), max_length, decoders.ByteLevel(),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))


def byte_symbols() -> tuple[str, ...]:
    """The symbol of each byte 0–255, in byte order: GPT-2's byte-level map (printable bytes stand for
    themselves, the others for code points from 256 up), the one ``tokenizers``' ByteLevel uses."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in keep:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return tuple(symbols[b] for b in range(256))


def build_char_tokenizer(max_length: int = 256) -> Any:
    """A fresh ``PreTrainedTokenizerFast`` over :func:`vocabulary` (``max_length`` = model context)."""
    from tokenizers import decoders

    return _build(tuple(vocabulary()), max_length, decoders.Fuse())   # Fuse: no spaces between characters


def _build(tokens: tuple[str, ...], max_length: int, decoder: Any, pre_tokenizer: Any = None) -> Any:
    """A BPE model without merges over ``tokens`` (ids in order): the special tokens special, the tool
    markers ordinary single tokens, ``<bos>`` prepended by ``encode``."""
    from tokenizers import AddedToken, Tokenizer, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(tokens)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    if pre_tokenizer is not None:
        core.pre_tokenizer = pre_tokenizer
    core.decoder = decoder
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKERS])
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   unk_token=UNK, clean_up_tokenization_spaces=False,
                                   model_max_length=max_length)
