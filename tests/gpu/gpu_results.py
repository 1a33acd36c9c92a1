"""What a GPU test measured: one ``RESULT name {json}`` line on stdout, and a JSON line in ``$RM_GPU_RESULTS``."""

from __future__ import annotations

import json
import os


def record(name: str, **values) -> None:
    print(f"RESULT {name} {json.dumps(values)}")
    path = os.environ.get("RM_GPU_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": name, **values}) + "\n")
