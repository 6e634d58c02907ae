"""``python -m hybridkv`` is the same as the ``hybridkv`` command."""

from hybridkv.cli import main

raise SystemExit(main())
