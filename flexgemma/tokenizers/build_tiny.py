"""Builds the tokenizer of the tiny test models (flexgemma/tokenizers/tiny): a byte-level BPE of 512
tokens, the vocabulary of conf/model/tiny.yaml and tiny_moe.yaml, trained on corpus.txt (a passage of
a public-domain book) and arithmetic lines made here, with a Gemma-style chat template.

    python -m flexgemma.tokenizers.build_tiny      # rewrites the files in flexgemma/tokenizers/tiny

Byte-level: every text encodes (no unknown token). Ids 0, 1, 2 are <pad>, <eos>, <bos>, the tiny
configs' pad_token_id, eos_token_id and bos_token_id; a text prompt gets <bos> in front, as Gemma's does.
"""

from __future__ import annotations

from pathlib import Path

VOCAB_SIZE = 512
SPECIALS = ["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"]  # ids 0..4
DIR = Path(__file__).resolve().parent / "tiny"

# Gemma's turn format: a system message is folded into the first user turn; "assistant" is "model"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.system = message['content'] + '\n\n' %}"
    "{% else %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ ns.system }}{{ message['content'] | trim }}<end_of_turn>\n"
    "{% set ns.system = '' %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def arithmetic_lines() -> list[str]:
    """Small sums and products as questions and answers (digits, operators and the words around them)."""
    out = []
    for a in range(13):
        for b in range(13):
            out.append(f"Solve {a}+{b}. {a} + {b} = {a + b}.")
            out.append(f"What is {a} * {b}? The answer is {a * b}.")
    return out


def training_lines() -> list[str]:
    text = (DIR / "corpus.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()] + arithmetic_lines()


def build(out_dir: Path = DIR):
    """Trains the tokenizer and saves it (tokenizer.json, tokenizer_config.json, ...) into out_dir."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_lines(), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A $B",
                                                       special_tokens=[("<bos>", SPECIALS.index("<bos>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   additional_special_tokens=SPECIALS[3:], padding_side="left",
                                   chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(str(out_dir))
    return fast


if __name__ == "__main__":
    built = build()
    print(f"{len(built)} tokens -> {DIR}")
