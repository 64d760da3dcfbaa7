"""Byte-level BPE: training (`train`, its merge loop in `merges`), encoding and decoding (`tokenizer`), files on
disk (`serialization`, `encode_file`)."""

#: The special token that separates documents, in the datasets of the CS336 assignment-1 handout and in every corpus
#: scratchlm builds; generation stops at it.
END_OF_TEXT = "<|endoftext|>"

#: The special tokens that delimit the turns of a conversation (`scratchlm.chat`). Every tokenizer scratchlm
#: trains reserves them, so that a model pretrained on it can be fine-tuned to chat without growing its vocabulary.
SYSTEM, USER, ASSISTANT, END_OF_TURN = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
CHAT_TOKENS = (SYSTEM, USER, ASSISTANT, END_OF_TURN)

#: The special tokens of a tokenizer trained by `train-tokenizer`, `prepare` or the quickstart.
DEFAULT_SPECIAL_TOKENS = (END_OF_TEXT, *CHAT_TOKENS)
