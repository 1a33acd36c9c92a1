"""Other detection formats ↔ our JSONL records (``trainer.data.records``).

``common``: the imported record, the import report and the geometry rules (clamp, drop, round) every importer
applies; ``coco``: COCO and LVIS instance JSON in, COCO ground truth and detection results out; ``odvg``: the
ODVG grounding JSONL of GroundingDINO / mm-grounding-dino in. The command line is ``trainer.data.convert``.
"""
