"""sha256 of a file, read in blocks: checkpoints, pinned sdists and fetched models are all
verified by it."""
import hashlib
from pathlib import Path


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()
