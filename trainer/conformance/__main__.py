"""``python -m trainer.conformance``: the ms-swift conformance check (``trainer.conformance.run``)."""

from trainer.conformance.run import main

raise SystemExit(main())
