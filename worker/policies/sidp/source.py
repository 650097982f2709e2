"""A weight source that hides the FFN tensors of layers this replica does not own (SiDP §4.1):
a non-owner never reads, let alone holds, a remote layer's FFN."""

from __future__ import annotations

import re

from gearshift.worker.model.weights import LazyWeight, WeightSource

_FFN = re.compile(r"^model\.layers\.(\d+)\.mlp\.")


class HideRemoteFfn(WeightSource):
    """``inner`` without ``model.layers.<ℓ>.mlp.*`` for ℓ in ``remote``."""

    def __init__(self, inner: WeightSource, remote: set[int]) -> None:
        self.inner = inner
        self.remote = remote

    def _hidden(self, name: str) -> bool:
        m = _FFN.match(name)
        return m is not None and int(m.group(1)) in self.remote

    def names(self) -> list[str]:
        return [n for n in self.inner.names() if not self._hidden(n)]

    def get(self, name: str) -> LazyWeight:
        if self._hidden(name):
            raise KeyError(name)
        return self.inner.get(name)

    def close(self) -> None:
        self.inner.close()
