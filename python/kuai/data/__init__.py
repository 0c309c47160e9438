"""kuai.data: tokenizers, token files, batch sources and the prefetching DataLoader (kuai::data).

Tokenizer reads a Hugging Face tokenizer.json (Tokenizer.from_file), with the `tokenizers`
library's method names; get_tokenizer also gives kuai's byte and GPT-2 tokenizers."""

from kuai._kuai.data import (  # noqa: F401
    BatchSource,
    DataLoader,
    RandomWindows,
    SequentialWindows,
    SyntheticTokens,
    TokenFile,
    Tokenizer,
    get_tokenizer,
    write_token_file,
)
