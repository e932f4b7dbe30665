"""Host-side coordination of a save between ranks, over the c10d store, with timeouts.

Used from the background thread, so it never issues a collective (XLA or gloo) and never touches
the training process group: every rank publishes a small JSON report under a key, rank 0 waits for
all of them, commits, and publishes the outcome that every rank waits for.
"""
from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

from .errors import RankFailureError

_POLL_S = 0.05


def peer_grace(timeout_s: float) -> float:
    """How much longer than ``timeout_s`` a rank waits for a peer whose own work is bounded by ``timeout_s``
    (its storage deadline): long enough to receive the peer's real failure instead of racing it with a bare
    "hung or dead"."""
    return min(timeout_s, 60.0)


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
        """Wait for ``name`` to be published; raise RankFailureError naming ``owner`` on timeout.

        The owner's own work is bounded by ``timeout_s`` (its storage deadline), after which it publishes
        its failure; waiting a grace beyond that lets this rank raise the owner's real cause rather than
        racing it with a bare "hung or dead"."""
        key = self._key(name)
        waited = self.timeout_s + peer_grace(self.timeout_s)
        if not self._wait_keys([key], waited):
            raise RankFailureError(
                f"rank {self.rank} waited {waited:.0f}s for {what} from rank {owner}, which is hung or "
                f"dead; the checkpoint is not marked complete and earlier ones are intact. Check rank {owner}'s log; "
                "on restart load_checkpoint(tag=None) resumes from the newest complete checkpoint",
                {owner: f"no {what} within {waited:.0f}s (hung or dead)"},
            )
        return json.loads(self.store.get(key))

    def gather(self, name: str, known: Optional[Dict[int, dict]] = None) -> Dict[int, Optional[dict]]:
        """Rank 0: every rank's report under ``name``; ranks missing after the timeout map to None. ``known``:
        reports this rank already holds (its own), used as they are instead of read back and parsed."""
        known = known or {}
        keys = {r: self._key(f"{name}/{r}") for r in range(self.world_size) if r not in known}
        self._wait_keys(list(keys.values()), self.timeout_s)
        out: Dict[int, Optional[dict]] = {}
        for r in range(self.world_size):
            k = keys.get(r)
            if k is None:
                out[r] = known[r]
            elif self.store.check([k]):
                out[r] = json.loads(self.store.get(k))
            else:
                out[r] = None
        return out

    def report(self, name: str, value) -> None:
        self.publish(f"{name}/{self.rank}", value)

    def wait_outcome(self, name: str, reports: str) -> Tuple[Optional[dict], List[int], bool]:
        """A non-root rank: wait for rank 0's verdict ``name`` on the reports ``reports/<rank>``.

        Returns (verdict or None, ranks that never reported, whether every rank reported). The wait
        follows what the reports show, so a rank is never blamed for another's failure and never
        gives up before rank 0 can have decided: while ranks are missing, rank 0 waits ``timeout_s``
        for them from its own report on, so the verdict is due then (plus a grace for rank 0 to act);
        once everyone has reported, rank 0 has ``timeout_s`` to commit; if rank 0 itself never
        reports, it is the one that failed."""
        key = self._key(name)
        report_keys = {r: self._key(f"{reports}/{r}") for r in range(self.world_size)}
        grace = peer_grace(self.timeout_s)
        start = time.monotonic()
        seen: Dict[int, float] = {}
        while True:
            if self.store.check([key]):
                return json.loads(self.store.get(key)), [], True
            now = time.monotonic()
            for r, k in report_keys.items():
                if r not in seen and self.store.check([k]):
                    seen[r] = now
            missing = [r for r in range(self.world_size) if r not in seen]
            if not missing:
                deadline = max(seen.values()) + self.timeout_s
            elif 0 in seen:
                deadline = max(seen[0], start) + self.timeout_s + grace
            else:
                deadline = start + self.timeout_s
            if now >= deadline:
                if self.store.check([key]):
                    return json.loads(self.store.get(key)), [], True
                return None, missing, not missing
            time.sleep(_POLL_S)

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
