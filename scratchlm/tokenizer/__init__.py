"""Byte-level BPE: training (`train`), encoding and decoding (`tokenizer`), files on disk (`serialization`,
`encode_file`)."""

#: The special token that separates documents, in the datasets the specification trains on and in every corpus
#: scratchlm builds; generation stops at it.
END_OF_TEXT = "<|endoftext|>"
