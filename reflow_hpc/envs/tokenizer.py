"""The character tokenizer of the tiny CPU policy: no download, one token per character.

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


def build_char_tokenizer(max_length: int = 256) -> Any:
    """A fresh ``PreTrainedTokenizerFast`` over :func:`vocabulary` (``max_length`` = model context)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    from transformers import PreTrainedTokenizerFast

    vocab = vocabulary()
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    core.decoder = decoders.Fuse()   # concatenate: no spaces between characters
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKERS])
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])])
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   unk_token=UNK, clean_up_tokenization_spaces=False,
                                   model_max_length=max_length)
