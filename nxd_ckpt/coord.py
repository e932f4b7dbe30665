"""Host-side coordination of a save between ranks, over the c10d store, with timeouts.

Used from the background thread, so it never issues a collective (XLA or gloo) and never touches
the training process group: every rank publishes a small JSON report under a key, rank 0 waits for
all of them, commits, and publishes the outcome that every rank waits for.
"""
from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Dict, List, Optional

from .errors import RankFailureError

_POLL_S = 0.05


class Coordinator:
    """Store-backed exchange for one save (keys under a per-save prefix)."""

    def __init__(self, store, rank: int, world_size: int, prefix: str, timeout_s: float):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.prefix = prefix
        self.timeout_s = timeout_s

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def publish(self, name: str, value) -> None:
        self.store.set(self._key(name), json.dumps(value))

    def wait_for(self, name: str, what: str, owner: int) -> dict:
        """Wait for ``name`` to be published; raise RankFailureError naming ``owner`` on timeout."""
        key = self._key(name)
        if not self._wait_keys([key], self.timeout_s):
            raise RankFailureError(
                f"rank {self.rank} waited {self.timeout_s:.0f}s for {what} from rank {owner}, which is hung or "
                f"dead; the checkpoint is not marked complete",
                {owner: f"no {what} within {self.timeout_s:.0f}s (hung or dead)"},
            )
        return json.loads(self.store.get(key))

    def gather(self, name: str) -> Dict[int, Optional[dict]]:
        """Rank 0: every rank's report under ``name``; ranks missing after the timeout map to None."""
        keys = [self._key(f"{name}/{r}") for r in range(self.world_size)]
        self._wait_keys(keys, self.timeout_s)
        out: Dict[int, Optional[dict]] = {}
        for r, k in enumerate(keys):
            if self.store.check([k]):
                out[r] = json.loads(self.store.get(k))
            else:
                out[r] = None
        return out

    def report(self, name: str, value) -> None:
        self.publish(f"{name}/{self.rank}", value)

    def _wait_keys(self, keys: List[str], timeout_s: float) -> bool:
        # store.wait raises on timeout with backend-specific errors; poll check() instead so a timeout is
        # just False, and so a long wait never trips the store's own (shorter) client timeout.
        deadline = time.monotonic() + timeout_s
        pending = list(keys)
        while pending:
            pending = [k for k in pending if not self.store.check([k])]
            if not pending:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(_POLL_S)
        return True

    def cleanup(self, names: List[str]) -> None:
        for n in names:
            try:
                self.store.delete_key(self._key(n))
            except Exception:  # noqa: BLE001 - best effort; keys are tiny
                pass


class LocalStore:
    """An in-process stand-in for the c10d store when there is no process group (one rank)."""

    def __init__(self):
        self._data: Dict[str, bytes] = {}

    def set(self, key: str, value) -> None:
        self._data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self._data[key]

    def check(self, keys) -> bool:
        return all(k in self._data for k in keys)

    def delete_key(self, key: str) -> bool:
        return self._data.pop(key, None) is not None

    def wait(self, keys, timeout=timedelta(seconds=0)) -> None:
        if not self.check(keys):
            raise TimeoutError(keys)


def default_store():
    """The c10d store of the default process group, or a LocalStore without torch.distributed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        from torch.distributed import distributed_c10d

        return distributed_c10d._get_default_store()
    return LocalStore()
