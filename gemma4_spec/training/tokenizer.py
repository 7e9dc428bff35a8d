"""A small byte-level BPE tokenizer trained on GSM8k, with Gemma-style chat turns.

Saved as a ``PreTrainedTokenizerFast`` (``tokenizer.json`` + ``tokenizer_config.json``) that
carries its chat template, so ``AutoTokenizer.from_pretrained`` and vLLM (chat completions too)
load it like a real Gemma tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, EOS, BOS, UNK = "<pad>", "<eos>", "<bos>", "<unk>"
START_OF_TURN, END_OF_TURN = "<start_of_turn>", "<end_of_turn>"
# Fixed ids 0..5, in this order (Gemma's own: pad 0, eos 1, bos 2, unk 3).
SPECIAL_TOKENS = (PAD, EOS, BOS, UNK, START_OF_TURN, END_OF_TURN)

# Gemma's turn format: "<bos><start_of_turn>user\n{q}<end_of_turn>\n<start_of_turn>model\n".
# The assistant role is called "model", as in Gemma's own template.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE of exactly ``vocab_size`` tokens (special tokens included)."""
    bpe = Tokenizer(models.BPE(unk_token=UNK))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    if bpe.get_vocab_size() != vocab_size:
        # BPE stops early when the text has no more pairs to merge; the model needs the exact size.
        raise ValueError(
            f"the tokenizer learnt {bpe.get_vocab_size()} tokens, not {vocab_size}: "
            "too little training text for this vocabulary size"
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[START_OF_TURN, END_OF_TURN],
        chat_template=CHAT_TEMPLATE,
        add_bos_token=False,
        clean_up_tokenization_spaces=False,
    )


def chat_prompt(tokenizer: PreTrainedTokenizerFast, question: str) -> str:
    """The prompt text of one user turn, ending where the model's answer starts."""
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    assert isinstance(rendered, str)
    return rendered
