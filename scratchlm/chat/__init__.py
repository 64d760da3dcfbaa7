"""Chat: the template that turns a conversation into token ids (`template`), conversations read and
checked from JSONL and made into fine-tuning batches (`conversations`), the built-in conversation set that
needs no download (`tasks`), and supervised fine-tuning of a base run (`sft`)."""
