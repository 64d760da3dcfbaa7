"""Byte-level BPE: training (`train`), encoding and decoding (`tokenizer`), files on disk (`serialization`,
`encode_file`)."""

#: The special token that separates documents, in the datasets of the CS336 assignment-1 handout and in every corpus
#: scratchlm builds; generation stops at it.
END_OF_TEXT = "<|endoftext|>"
