"""The embedded GGUF's load as transformers does it (`base`), with gguf's reader alone memoised (`reader`), or within
`sources.gguf_memoised` (`memoised`: the reader and the tensor-name map), with the SHA-256 of the loaded weights. One
side a process, alternated: `for m in base reader memoised base reader memoised; do .venv/bin/python
bench/results/zen3_2026-12-03/gguf_load.py $m; done`. A second argument names another GGUF file (Gemma 3 270M:
`gemma3_270m.md` says how to assemble it)."""

import rlhf_pipeline.offline  # noqa: F401, I001  (first: offline before the Hugging Face libraries load)

import hashlib
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import gguf

from rlhf_pipeline.sources import embedded_gguf_path, gguf_memoised, load_gguf

if sys.argv[1] == "reader":
    reader_class, readers = gguf.GGUFReader, {}

    def parsed(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader = parsed
started = time.perf_counter()
with gguf_memoised() if sys.argv[1] == "memoised" else nullcontext():
    model, tokenizer = load_gguf(Path(sys.argv[2]) if len(sys.argv) > 2 else embedded_gguf_path())
seconds = time.perf_counter() - started
digest = hashlib.sha256()
for name, tensor in model.state_dict().items():
    digest.update(name.encode())
    digest.update(tensor.detach().numpy().tobytes())
print(f"{sys.argv[1]}: {seconds:.1f} s, weights sha256 {digest.hexdigest()[:16]}, vocabulary {len(tokenizer)}")
