"""kuai.data: token files, batch sources and the prefetching DataLoader (kuai::data)."""

from kuai._kuai.data import (  # noqa: F401
    BatchSource,
    DataLoader,
    RandomWindows,
    SequentialWindows,
    SyntheticTokens,
    TokenFile,
    write_token_file,
)
