"""A word-level stand-in tokenizer for GRPO on an engine without one (model.tokenizer=null, or
Engine.from_model without a tokenizer; the tiny models ship a real one, flexgemma/tokenizers/tiny):
token i is the word `t<i>`, except the specials 0 <pad>, 1 <eos>, 2 <bos> that every Gemma-4
vocabulary has. TRL decodes completions to text and tokenises prompts for its own generator; this
makes both exact (decode then encode gives the same ids)."""

from __future__ import annotations

SPECIALS = {0: "<pad>", 1: "<eos>", 2: "<bos>"}


def word(i: int) -> str:
    return SPECIALS.get(i, f"t{i}")


def tiny_tokenizer(vocab_size: int):
    """A transformers PreTrainedTokenizerFast over `vocab_size` word tokens (no BOS added)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word(i): i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   padding_side="left")


def ids_to_text(ids: list[int]) -> str:
    return " ".join(word(i) for i in ids)
