"""changebus.client: see docs/ for what this slice provides."""

__all__: list[str] = []
