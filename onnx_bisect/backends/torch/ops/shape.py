"""(filled in by the family's author)"""

from __future__ import annotations

__all__: list[str] = []
