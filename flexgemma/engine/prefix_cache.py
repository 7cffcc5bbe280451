"""Automatic prefix caching: full prompt pages whose KV is already computed are reused.

A full page of a prompt is named by a hash chain: sha256(weight version, previous page's hash,
the page's tokens). Equal names mean equal tokens at equal positions after an equal prefix,
computed with the same weights, so equal KV. The cache maps a name to the page holding that KV
in each page group (the full-attention group's page, and the sliding group's page while it is
kept; KV-shared layers read their source layer's pages, so they follow).

Pages are reference-counted by their group's allocator (kv_cache.PageAllocator): a sequence that
starts from cached pages takes a reference on each, and releases it when it finishes, is
preempted, or (sliding group) when the page leaves its window. A cached page nobody references
is idle: the allocator hands it out again (least recently released first) only when no free page
is left, before the scheduler preempts anyone. A sequence never writes a page it did not
allocate itself (a hit stops short of the page holding the prompt's last token), so no write
ever lands in a page another sequence reads.

A prompt's last, partial page is copied on write: a request that computed its whole prompt
registers that page under a tail name (the previous full page's hash and the page's tokens but
the last); while it runs and holds the page, a request whose prompt has the same name gets a page
of its own with a copy of it, and computes only its last token (whose logits it samples from).

    lookup(hashes) -> entries       the longest usable cached prefix (its pages, per group)
    insert(hash, pages)             register a freshly computed full page
    tail_key / add_tail / tail      name, register, find a computed last partial page (its request)
    release / evict                 through the allocator: refcount down; evict drops an idle page
    clear() / bump_version()        forget everything (weights changed, pool freed)
"""

from __future__ import annotations

import hashlib
from typing import Optional

import numpy as np

from flexgemma.engine.kv_cache import PageGroup

Entry = dict  # page group name -> page id (None: the sliding group's page was given back)


class PrefixCache:
    def __init__(self, groups: list[PageGroup], page_size: int):
        self.groups, self.page_size = groups, page_size
        self.version = 0  # the weights' version: part of every hash
        self._entries: dict[bytes, Entry] = {}
        self._key_of: dict[tuple[str, int], bytes] = {}  # (group, page) -> the hash it is cached under
        self._tails: dict[bytes, object] = {}  # tail name -> the Sequence that computed that last page
        for g in groups:
            g.allocator.on_evict = lambda page, name=g.name: self._evicted(name, page)

    def __len__(self) -> int:
        return len(self._entries)

    # -- names ------------------------------------------------------------------------------------
    def hashes(self, tokens: list[int]) -> list[bytes]:
        """The hash of each full page of `tokens`, in order (a chain: each includes the previous)."""
        out, prev, p = [], self.version.to_bytes(8, "little", signed=False), self.page_size
        for i in range(len(tokens) // p):
            prev = hashlib.sha256(prev + np.asarray(tokens[i * p:(i + 1) * p], dtype=np.int64).tobytes()).digest()
            out.append(prev)
        return out

    def tail_key(self, tokens: list[int], full_hashes: list[bytes]) -> Optional[bytes]:
        """The name of a prompt's last page up to, not including, its last token (None when that
        is no token: the last token opens its page). full_hashes: the prompt's full-page hashes."""
        p, k = self.page_size, (len(tokens) - 1) // self.page_size
        if len(tokens) - 1 == k * p:
            return None
        prev = full_hashes[k - 1] if k else self.version.to_bytes(8, "little", signed=False)
        return hashlib.sha256(b"tail" + prev + np.asarray(tokens[k * p: len(tokens) - 1], dtype=np.int64).tobytes()).digest()

    # -- the API ----------------------------------------------------------------------------------
    def add_tail(self, key: bytes, seq) -> None:
        """seq computed its whole prompt, whose last page is named `key` (the first to register wins)."""
        self._tails.setdefault(key, seq)

    def tail(self, key: bytes):
        """The sequence registered under tail name `key`, or None."""
        return self._tails.get(key)

    def drop_tail(self, key: Optional[bytes], seq) -> None:
        """Forgets `seq` as the source of last page `key` (when it is that source)."""
        if self._tails.get(key) is seq:
            del self._tails[key]

    def lookup(self, hashes: list[bytes]) -> list[Entry]:
        """The entries of the longest cached prefix of `hashes` that a sequence can start from: every
        full-attention page present, and each sliding group's pages inside the window of the first
        position after the prefix."""
        entries = []
        for h in hashes:
            e = self._entries.get(h)
            if e is None:
                break
            entries.append(e)
        k = len(entries)
        while k and not self._window_kept(entries, k):
            k -= 1
        return entries[:k]

    def window_start(self, group: PageGroup, k: int) -> int:
        """First logical page a query at position k * page_size can see in `group`."""
        if group.window is None:
            return 0
        return max(0, k * self.page_size - group.window + 1) // self.page_size

    def _window_kept(self, entries: list[Entry], k: int) -> bool:
        return all(entries[j][g.name] is not None
                   for g in self.groups if g.window is not None for j in range(self.window_start(g, k), k))

    def insert(self, key: bytes, pages: dict[str, Optional[int]]) -> bool:
        """Registers the pages (group name -> page) of one freshly computed full page under `key`.
        False (nothing cached) when `key` is cached already: the caller keeps its own pages."""
        if key in self._entries:
            return False
        entry = {}
        for g in self.groups:
            page = pages.get(g.name)
            if page is not None:
                g.allocator.mark_cached(page)
                self._key_of[(g.name, page)] = key
            entry[g.name] = page
        self._entries[key] = entry
        return True

    def _evicted(self, group: str, page: int) -> None:
        """The allocator reuses an idle cached page: forget it (and, for a full-attention page, the
        whole entry: without it the prefix cannot be used)."""
        key = self._key_of.pop((group, page), None)
        if key is None:
            return
        entry = self._entries[key]
        entry[group] = None
        if any(g.name == group and g.window is None for g in self.groups):
            del self._entries[key]
            for g in self.groups:
                other = entry.get(g.name)
                if other is not None:
                    self._key_of.pop((g.name, other), None)
                    g.allocator.unmark_cached(other)

    def clear(self) -> None:
        """Forgets every entry; idle cached pages go back to the free lists."""
        for g in self.groups:
            for (name, page) in [k for k in self._key_of if k[0] == g.name]:
                g.allocator.unmark_cached(page)
        self._entries.clear()
        self._key_of.clear()
        self._tails.clear()

    def bump_version(self) -> None:
        """The weights changed: no page computed before may ever be a hit."""
        self.clear()
        self.version += 1
