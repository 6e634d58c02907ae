"""The ids the core hands out and takes, in one place.

``ReqId`` names a request (the engine's sequence id, or a trace's request id); ``PageId``
is a page's index in its group's view of the arena (``byte_offset // page_bytes``).
"""

from __future__ import annotations

from typing import NewType

ReqId = NewType("ReqId", str)
PageId = NewType("PageId", int)
NULL_PAGE = PageId(-1)  # "no data here": skipped sliding-window blocks; never read
