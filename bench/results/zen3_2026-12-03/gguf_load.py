"""The embedded GGUF's load, parsed as transformers parses it (`base`) or once (`once`: gguf.GGUFReader memoised, as
`sources.gguf_parsed_once` does), with the SHA-256 of the loaded weights. One side a process, alternated:
`for m in base once base once; do .venv/bin/python bench/results/zen3_2026-12-03/gguf_load.py $m; done`."""

import rlhf_pipeline.offline  # noqa: F401, I001  (first: offline before the Hugging Face libraries load)

import hashlib
import os
import sys
import time

import gguf

from rlhf_pipeline.sources import embedded_gguf_path, load_gguf

if sys.argv[1] == "once":
    reader_class, readers = gguf.GGUFReader, {}

    def parsed(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = reader_class(path, mode)
        return readers[key]

    gguf.GGUFReader = parsed
started = time.perf_counter()
model, tokenizer = load_gguf(embedded_gguf_path())
seconds = time.perf_counter() - started
digest = hashlib.sha256()
for tensor in model.state_dict().values():
    digest.update(tensor.detach().numpy().tobytes())
print(f"{sys.argv[1]}: {seconds:.1f} s, weights sha256 {digest.hexdigest()[:16]}, vocabulary {len(tokenizer)}")
