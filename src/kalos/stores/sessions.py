"""Sessions: conversation turns kept as context buffers, ready to hand to a model.

A session is an ordered list of turns (role, text, token ids) with an optional pinned system
prompt, owned by a tenant and a user. Its session id is a string, unique within the sidecar.

Each session keeps its turns in four growing buffers, so that a context read does no Python
work per turn:

* ``tokens``: int32 [capacity], every turn's token ids back to back: a region of the token
  heap (kalos.stores.token_heap: shared memory shm clients read CONTEXT ids from, never
  rewritten in place) when the store has one with room, else private memory;
* ``text``: uint8 [capacity], every turn's UTF-8 role then text, back to back;
* ``meta``: uint32 [capacity, 4], per turn (role bytes, text bytes, tokens, 0);
* ``tok_cum`` / ``txt_cum``: Python lists of where each turn starts in ``tokens`` / ``text``,
  plus the end (so ``len == turns + 1``).

:meth:`SessionStore.context` is one bisect on ``tok_cum`` from the end (the newest turns that
fit the budget, a contiguous suffix) and three slices: the encoder copies each into the
response arena in one piece. Dropping old turns (trim, rolling sessions) only moves
``first``; the buffers are compacted once the dead head outgrows the live part.

Every mutating method takes ``now`` (seconds since the epoch, the request's time) instead of
reading a clock, so that replaying the same requests with the same times rebuilds the same
state. Expired sessions vanish from every read at once and are reclaimed by :meth:`reap`, which
writes run at most once per ``REAP_INTERVAL_S``.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import os
import sqlite3
from bisect import bisect_left
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from kalos.errors import ConfigError, Conflict, InvalidRequest, NotFound
from kalos.protocol.messages import Scope, SessionInfo
from kalos.stores.limits import Limits, check_name, check_size
from kalos.stores.session_index import SessionIndex
from kalos.stores.token_heap import Hold, Reader, TokenHeap

Tokenizer = Callable[[str], np.ndarray]
"""text → token ids, int32 [n]."""

REAP_INTERVAL_S = 1.0
"""Expired sessions are reclaimed at most this often (they are invisible at once)."""

_INITIAL_TOKENS = 256
_INITIAL_TEXT = 1024
_INITIAL_TURNS = 8
_COMPACT_AFTER = 32  # dropped head turns before a compaction is considered


def load_tokenizer(path: str) -> Tokenizer:
    """A Hugging Face ``tokenizers`` tokenizer file (tokenizer.json) as a :data:`Tokenizer`.

    Special tokens are not added, and the file's padding and truncation settings are
    switched off (an embedding model's tokenizer.json often pads every text to 128 ids):
    a turn's ids are the ids of its text alone, all of them. Raises ConfigError when the
    package (``pip install 'kalos[text]'``) or the file is missing.
    """
    try:
        import tokenizers
    except ImportError as exc:
        raise ConfigError(
            "--tokenizer needs the tokenizers package: pip install 'kalos[text]'"
        ) from exc
    try:
        tok = tokenizers.Tokenizer.from_file(path)
    except Exception as exc:  # tokenizers raises its own Exception subclass
        raise ConfigError(f"cannot load the tokenizer {path!r}: {exc}") from exc
    tok.no_padding()
    tok.no_truncation()

    def tokenize(text: str) -> np.ndarray:
        return np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    return tokenize


def tokenizer_fingerprint(path: str | None) -> str | None:
    """``sha256:<hex>`` of a tokenizer file's bytes (None: no tokenizer): a data directory
    records it, since replaying its log tokenizes again (kalos.server.durability)."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return "sha256:" + hashlib.sha256(f.read()).hexdigest()
    except OSError as exc:
        raise ConfigError(f"cannot read the tokenizer {path!r}: {exc}") from exc


class SystemPrompt(NamedTuple):
    """A session's pinned system prompt, laid out like one turn of the buffers (as bytes)."""

    n_tokens: int
    tokens: bytes  # int32 [n_tokens], little-endian
    meta: bytes  # uint32 [1, 4]: role bytes, text bytes, tokens, 0
    text: bytes  # role bytes then text bytes


TurnWindow = tuple[memoryview, memoryview, memoryview, "SystemPrompt | None"]
"""What :meth:`SessionStore.context` selected, as byte views into the session's buffers:
(tokens: int32 [n_tokens], the turns' ids oldest first; meta: uint32 [n_turns, 4]; text: the
turns' role and text bytes; the pinned system prompt when it is included, else None).

Valid until the session's next change; the encoder copies each into the response in one piece.
A plain tuple of memoryviews: on this path a NamedTuple (~0.25 µs) or numpy views cost more.
"""


class Session:
    """One session's buffers (see the module docstring)."""

    __slots__ = (
        "expires_at",
        "first",
        "heap",
        "heap_at",
        "meta",
        "meta_mv",
        "name",
        "rolling",
        "system",
        "tenant",
        "text",
        "text_mv",
        "tok_at",
        "tok_cum",
        "tokens",
        "tokens_mv",
        "ttl_s",
        "txt_cum",
        "user",
    )

    def __init__(
        self,
        name: str,
        tenant: str | None,
        user: str | None,
        heap: TokenHeap | None = None,
        capacity: int = _INITIAL_TOKENS,
    ) -> None:
        self.name = name
        self.tenant = tenant
        self.user = user
        self.heap = heap
        self.tok_at = -1  # token offset of the heap region holding ``tokens``; -1: private
        self.tokens = self._token_buffer(capacity)
        self.text = np.empty(_INITIAL_TEXT, np.uint8)
        self.meta = np.zeros((_INITIAL_TURNS, 4), np.uint32)
        self.remap()
        self.tok_cum = [0]
        self.txt_cum = [0]
        self.first = 0
        self.system: SystemPrompt | None = None
        self.ttl_s: float | None = None
        self.expires_at = math.inf
        self.heap_at = math.inf  # expiry of this session's entry in the reap heap
        self.rolling = False

    def remap(self) -> None:
        """Refreshes the byte views of the buffers (after any of them was replaced)."""
        self.tokens_mv = memoryview(self.tokens).cast("B")
        self.text_mv = memoryview(self.text)
        self.meta_mv = memoryview(self.meta).cast("B")

    @property
    def turns(self) -> int:
        return len(self.tok_cum) - 1 - self.first

    @property
    def n_tokens(self) -> int:
        return self.tok_cum[-1] - self.tok_cum[self.first]

    @property
    def n_text(self) -> int:
        return self.txt_cum[-1] - self.txt_cum[self.first]

    @property
    def nbytes(self) -> int:
        return int(self.tokens.nbytes + self.text.nbytes + self.meta.nbytes)

    def matches(self, scope: Scope | None) -> bool:
        """Whether every field given in ``scope`` equals this session's."""
        if scope is None:
            return True
        return (
            (scope.tenant is None or scope.tenant == self.tenant)
            and (scope.user is None or scope.user == self.user)
            and (scope.session is None or scope.session == self.name)
        )

    def append(self, role_len: int, text_len: int, tokens: np.ndarray, raw: bytes) -> None:
        """Appends one turn: ``raw`` is its role bytes then text bytes."""
        n = len(self.tok_cum) - 1
        k, m = len(tokens), len(raw)
        t, x = self.tok_cum[n], self.txt_cum[n]
        if t + k > len(self.tokens) or x + m > len(self.text) or n + 1 > len(self.meta):
            self._repack(k, m, 1, grow=True)
            n = len(self.tok_cum) - 1
            t, x = self.tok_cum[n], self.txt_cum[n]
        self.tokens[t : t + k] = tokens
        if m:
            self.text[x : x + m] = np.frombuffer(raw, np.uint8)
        self.meta[n] = (role_len, text_len, k, 0)
        self.tok_cum.append(t + k)
        self.txt_cum.append(x + m)

    def drop_oldest(self, count: int) -> None:
        """Forgets the ``count`` oldest turns (count <= turns)."""
        self.first += count
        if self.first >= _COMPACT_AFTER and 2 * self.first >= len(self.tok_cum) - 1:
            self._repack(0, 0, 0)

    def _token_buffer(self, n_tokens: int) -> np.ndarray:
        """A new buffer for at least ``n_tokens`` ids: a region of the token heap when it has
        room (``tok_at`` set to it), else private memory (``tok_at`` -1). The caller copies
        the live ids and frees any old region."""
        heap = self.heap
        if heap is not None:
            got = heap.alloc(n_tokens)
            if got is not None:
                self.tok_at = got[0]
                return got[1]
        self.tok_at = -1
        return np.empty(n_tokens, np.int32)

    def release(self) -> None:
        """Gives the session's heap region back: the session is gone (deleted, expired,
        forgotten, replaced)."""
        if self.tok_at >= 0 and self.heap is not None:
            self.heap.free(self.tok_at)
            self.tok_at = -1

    def _repack(
        self, more_tokens: int, more_text: int, more_turns: int, grow: bool = False
    ) -> None:
        """Moves the live turns to the front, growing any buffer that lacks room (with
        ``grow``: any buffer that would be over half full, so that appends that fill the
        buffers again repack after as many more tokens as are live: amortised O(1)).

        Token ids in the heap are never moved in place (a client may hold a view of them):
        they stay where they are while the new end fits their region and the dead head is
        smaller than the live part, and move to a new region otherwise."""
        f, n = self.first, len(self.tok_cum) - 1
        t0, t1 = self.tok_cum[f], self.tok_cum[n]
        x0, x1 = self.txt_cum[f], self.txt_cum[n]
        live_t, live_x, live_n = t1 - t0, x1 - x0, n - f
        need = live_t + more_tokens
        buf = self.tokens
        cap = len(buf)
        shift = t0  # how far the live ids move towards the buffer's start
        if self.tok_at >= 0:
            if t1 + more_tokens > cap or (grow and 2 * need > cap) or (t0 and t0 >= need):
                old = self.tok_at
                self.tokens = self._token_buffer(max(2 * need, _INITIAL_TOKENS))
                self.tokens[:live_t] = buf[t0:t1]
                assert self.heap is not None
                self.heap.free(old)
            else:
                shift = 0
        elif need > cap or (grow and 2 * need > cap):
            self.tokens = self._token_buffer(max(2 * need, cap))
            self.tokens[:live_t] = buf[t0:t1]
        elif t0:
            buf[:live_t] = buf[t0:t1]  # private ids are never lent: move them in place
        self.text = _moved(self.text, x0, x1, live_x + more_text, grow)
        self.meta = _moved(self.meta, f, n, live_n + more_turns, grow)
        self.remap()
        if shift:
            self.tok_cum = [c - shift for c in self.tok_cum[f:]]
        elif f:
            self.tok_cum = self.tok_cum[f:]
        if f or x0:
            self.txt_cum = [c - x0 for c in self.txt_cum[f:]]
        self.first = 0

    def newest(self, budget: int, max_turns: int | None) -> int:
        """The first of the newest turns whose token ids fit ``budget`` (at most
        ``max_turns`` turns): a contiguous suffix, as :meth:`SessionStore.context` takes."""
        cum = self.tok_cum
        n = len(cum) - 1
        first = bisect_left(cum, cum[n] - budget, self.first, n)
        if max_turns is not None and n - first > max_turns:
            first = n - max_turns
        return first

    def turn_window(self, first: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Views of turns ``first..end``: (tokens, meta, text)."""
        n = len(self.tok_cum) - 1
        return (
            self.tokens[self.tok_cum[first] : self.tok_cum[n]],
            self.meta[first:n],
            self.text[self.txt_cum[first] : self.txt_cum[n]],
        )


def _moved(buf: np.ndarray, lo: int, hi: int, need: int, grow: bool) -> np.ndarray:
    """``buf[lo:hi]`` moved to the front of ``buf``, or of a larger buffer when ``need`` >
    len (with ``grow``: when ``need`` > len / 2)."""
    if need > len(buf) or (grow and 2 * need > len(buf)):
        out = np.empty((max(2 * need, len(buf)), *buf.shape[1:]), buf.dtype)
        out[: hi - lo] = buf[lo:hi]
        return out
    if lo:
        buf[: hi - lo] = buf[lo:hi]  # numpy copies overlapping ranges correctly
    return buf


class SessionStore:
    """Every session of one sidecar. Used by one thread at a time (dispatch is serial)."""

    def __init__(
        self,
        limits: Limits | None = None,
        tokenizer: Tokenizer | None = None,
        heap: TokenHeap | None = None,
        index: SessionIndex | None = None,
    ) -> None:
        self.limits = limits or Limits()
        self.tokenizer = tokenizer
        self.heap = heap  # where sessions' token ids live when it has room (None: private)
        # what clients read to compute windows themselves (kalos.stores.session_index):
        # published after every change of a session, removed before its region is freed
        self.index = index
        self._sessions: dict[str, Session] = {}
        self._expiry: list[tuple[float, str]] = []  # heap of (expires_at, session)
        self._next_reap = -math.inf

    def __len__(self) -> int:
        return len(self._sessions)

    # -- reads -----------------------------------------------------------------------------

    def _live(self, session: str, now: float, scope: Scope | None) -> Session:
        s = self._sessions.get(session)
        if s is None or s.expires_at <= now or not s.matches(scope):
            raise NotFound(f"session {session!r} does not exist")
        return s

    def context(
        self,
        session: str,
        max_tokens: int,
        max_turns: int | None = None,
        *,
        now: float,
        scope: Scope | None = None,
    ) -> TurnWindow:
        """The newest turns that fit ``max_tokens`` token ids (and ``max_turns`` turns).

        The pinned system prompt comes first when it fits, and its tokens count against the
        budget; ``max_turns`` counts conversation turns only. The turns are a contiguous
        suffix of the session, oldest first: a turn that does not fit ends the window even if
        an older, shorter one would. NotFound for an unknown or expired session, or one
        outside ``scope``.
        """
        s, first, n, system = self._window(session, max_tokens, max_turns, now, scope)
        cum = s.tok_cum
        txt = s.txt_cum
        return (
            s.tokens_mv[4 * cum[first] : 4 * cum[n]],
            s.meta_mv[16 * first : 16 * n],
            s.text_mv[txt[first] : txt[n]],
            system,
        )

    def context_tokens(
        self,
        session: str,
        max_tokens: int,
        max_turns: int | None = None,
        *,
        now: float,
        scope: Scope | None = None,
    ) -> tuple[memoryview, int, SystemPrompt | None]:
        """The window of :meth:`context` without its turns' meta and text: (its token ids
        as a byte view, how many conversation turns it holds, the system prompt when
        included). The CONTEXT path for ``turns=False``: it touches only the token ids and
        their offsets, fewer cold cache lines per request than the whole window."""
        s, first, n, system = self._window(session, max_tokens, max_turns, now, scope)
        cum = s.tok_cum
        return s.tokens_mv[4 * cum[first] : 4 * cum[n]], n - first, system

    def context_lent(
        self,
        session: str,
        max_tokens: int,
        max_turns: int | None,
        reader: Reader,
        *,
        turns: bool,
        now: float,
        scope: Scope | None = None,
    ) -> tuple[memoryview, int, memoryview | None, memoryview | None, SystemPrompt | None, int]:
        """The window of :meth:`context` for a channel that maps the token heap: (token ids,
        how many conversation turns, meta and text (None unless ``turns``), the system
        prompt when included, the byte offset of the ids in the heap or -1).

        When the ids lie in the heap in one piece (the session's ids are there and the
        window has no system prompt, whose ids live apart) the offset is theirs and the
        region is lent to ``reader`` (:meth:`TokenHeap.lend`): the response may carry the
        offset instead of the ids. Otherwise -1: the ids travel as a copy."""
        s, first, n, system = self._window(session, max_tokens, max_turns, now, scope)
        cum = s.tok_cum
        t0 = cum[first]
        at = s.tok_at
        if at >= 0 and system is None:
            reader.lent_region = at  # TokenHeap.lend, inline: this is the CONTEXT hot path
            reader.lent_request = reader.requests + 1
            at = 4 * (at + t0)
        else:
            at = -1
        if not turns:
            return s.tokens_mv[4 * t0 : 4 * cum[n]], n - first, None, None, system, at
        txt = s.txt_cum
        return (
            s.tokens_mv[4 * t0 : 4 * cum[n]],
            n - first,
            s.meta_mv[16 * first : 16 * n],
            s.text_mv[txt[first] : txt[n]],
            system,
            at,
        )

    def _window(
        self,
        session: str,
        max_tokens: int,
        max_turns: int | None,
        now: float,
        scope: Scope | None,
    ) -> tuple[Session, int, int, SystemPrompt | None]:
        """The window of :meth:`context` as (the session, its first and end turn, the system
        prompt when it fits): reads only the token offsets."""
        s = self._sessions.get(session)
        if s is None or s.expires_at <= now or (scope is not None and not s.matches(scope)):
            raise NotFound(f"session {session!r} does not exist")
        budget = max_tokens
        system = s.system
        if system is not None:
            if system.n_tokens <= budget:
                budget -= system.n_tokens
            else:
                system = None
        cum = s.tok_cum
        n = len(cum) - 1
        first = bisect_left(cum, cum[n] - budget, s.first, n)
        if max_turns is not None and n - first > max_turns:
            first = n - max_turns
        return s, first, n, system

    def live(self, session: str, *, now: float, scope: Scope | None = None) -> Session:
        """The live session ``session`` (its buffers: valid until its next change). NotFound
        for an unknown or expired session, or one outside ``scope``."""
        return self._live(session, now, scope)

    def turns(
        self, session: str, *, now: float, scope: Scope | None = None
    ) -> list[tuple[str, str, np.ndarray]]:
        """Every turn of a session as (role, text, token ids copy), oldest first."""
        s = self._live(session, now, scope)
        tokens, meta, text = s.turn_window(s.first)
        return _split_turns(tokens, meta, text)

    def system(
        self, session: str, *, now: float, scope: Scope | None = None
    ) -> tuple[str, str, np.ndarray] | None:
        """The pinned system prompt as (role, text, token ids copy), or None."""
        sp = self._live(session, now, scope).system
        if sp is None:
            return None
        return _split_turns(
            np.frombuffer(sp.tokens, np.int32),
            np.frombuffer(sp.meta, np.uint32).reshape(1, 4),
            np.frombuffer(sp.text, np.uint8),
        )[0]

    def owner(self, session: str, now: float) -> Scope | None:
        """(tenant, user, session) of a live session, or None."""
        s = self._sessions.get(session)
        if s is None or s.expires_at <= now:
            return None
        return Scope(s.tenant, s.user, s.name)

    def sessions(
        self,
        scope: Scope | None,
        *,
        now: float,
        after: str | None = None,
        limit: int | None = None,
    ) -> list[SessionInfo]:
        """Live sessions matching ``scope``, by session id, those after ``after`` only."""
        self.maybe_reap(now)
        names = sorted(
            name
            for name, s in self._sessions.items()
            if s.expires_at > now and s.matches(scope) and (after is None or name > after)
        )
        if limit is not None:
            names = names[:limit]
        return [self._info(self._sessions[name]) for name in names]

    @staticmethod
    def _info(s: Session) -> SessionInfo:
        return SessionInfo(
            s.name,
            s.tenant,
            s.user,
            s.turns,
            s.n_tokens,
            s.system is not None,
            s.ttl_s,
            None if math.isinf(s.expires_at) else s.expires_at,
        )

    def stats(self) -> dict[str, int]:
        return {
            "sessions": len(self._sessions),
            "session_turns": sum(s.turns for s in self._sessions.values()),
            "session_tokens": sum(s.n_tokens for s in self._sessions.values()),
            "session_bytes": sum(s.nbytes for s in self._sessions.values()),
            **(self.heap.stats() if self.heap is not None else {}),
            **(self.index.stats() if self.index is not None else {}),
        }

    def hold(self) -> Hold | None:
        """Keeps every token-heap region freed from now on until the hold is released: a
        forked snapshot writer reads the shared heap as it is (None: no heap)."""
        return self.heap.hold() if self.heap is not None else None

    # -- writes ----------------------------------------------------------------------------

    def append_turn(
        self,
        session: str,
        role: str,
        text: str,
        tokens: np.ndarray | None = None,
        *,
        now: float,
        owner: Scope | None = None,
        pin: bool = False,
        ttl_s: float | None = None,
        rolling: bool | None = None,
    ) -> tuple[int, int]:
        """Appends a turn (or, with ``pin``, sets the pinned system prompt), creating the
        session on its first append. Returns (turns in the session, token ids of this turn).

        ``tokens``: int32 ids; None: tokenize ``text`` with the configured tokenizer
        (InvalidRequest when there is none). ``owner``: the session's tenant and user, fixed
        when it is created; a later append that names another owner raises Conflict.
        ``ttl_s``: None keeps the session's TTL, 0 removes it, > 0 makes the session expire
        ``ttl_s`` seconds after its last append. ``rolling``: None keeps the setting (new
        sessions: False); a full rolling session drops its oldest turns, a full other one
        refuses the append (InvalidRequest). Everything is checked before anything changes.
        """
        lim = self.limits
        check_name("a session id", session, lim.max_key_bytes)
        if owner is not None and owner.session is not None and owner.session != session:
            raise InvalidRequest(
                f"the scope names session {owner.session!r} but the turn is for {session!r}"
            )
        if not isinstance(role, str) or not role:
            raise InvalidRequest("a turn needs a role, e.g. 'user' or 'assistant'")
        if not isinstance(text, str):
            raise InvalidRequest(f"a turn's text must be a str, not {type(text).__name__}")
        role_b, text_b = role.encode(), text.encode()
        check_size("the role", len(role_b), lim.max_role_bytes, "bytes")
        check_size("the turn", len(role_b) + len(text_b), lim.max_turn_bytes, "bytes",
                   "--max-turn-bytes")  # fmt: skip
        ids = self._token_ids(text, tokens)
        check_size("the turn", len(ids), lim.max_turn_tokens, "tokens", "--max-turn-tokens")
        if ttl_s is not None and not (math.isfinite(ttl_s) and ttl_s >= 0):
            raise InvalidRequest(f"ttl_s must be a finite number >= 0, got {ttl_s}")
        s = self._sessions.get(session)
        if s is not None and s.expires_at <= now:
            s = None  # expired: the id starts a new session (its region is freed below)
        tenant = owner.tenant if owner is not None else None
        user = owner.user if owner is not None else None
        if s is not None and (
            (tenant is not None and tenant != s.tenant) or (user is not None and user != s.user)
        ):
            raise Conflict(f"session {session!r} belongs to another tenant or user")
        is_rolling = rolling if rolling is not None else (s.rolling if s is not None else False)
        drop = 0
        if not pin and s is not None and s.turns >= lim.max_session_turns:
            if not is_rolling:
                raise InvalidRequest(
                    f"session {session!r} holds {s.turns} turns, the limit "
                    "(kalos serve --max-session-turns); trim it, or append with rolling=True "
                    "to drop the oldest turns"
                )
            drop = s.turns - lim.max_session_turns + 1
        # -- checked: from here on nothing fails --
        if self.index is not None:
            self.index.begin(session)  # before its region may move (see session_index)
        self.maybe_reap(now)
        if s is None:
            old = self._sessions.get(session)
            if old is not None:
                self._drop(old)
            s = Session(session, tenant, user, self.heap)
            self._sessions[session] = s
        s.rolling = is_rolling
        if ttl_s is not None:
            s.ttl_s = ttl_s or None
        s.expires_at = now + s.ttl_s if s.ttl_s else math.inf
        if s.expires_at < s.heap_at:
            heapq.heappush(self._expiry, (s.expires_at, session))
            s.heap_at = s.expires_at
        raw = role_b + text_b
        if pin:
            meta = np.array([[len(role_b), len(text_b), len(ids), 0]], np.uint32)
            s.system = SystemPrompt(
                len(ids), ids.astype("<i4").tobytes(), meta.astype("<u4").tobytes(), raw
            )
        else:
            if drop:
                s.drop_oldest(drop)
            s.append(len(role_b), len(text_b), ids, raw)
        if self.index is not None:
            self.index.put(s)
        return s.turns, len(ids)

    def _token_ids(self, text: str, tokens: np.ndarray | None) -> np.ndarray:
        if tokens is None:
            if self.tokenizer is None:
                raise InvalidRequest(
                    "this sidecar has no tokenizer (kalos serve --tokenizer PATH): "
                    "send the turn's token ids"
                )
            return self.tokenizer(text)
        ids = np.asarray(tokens)
        if ids.ndim != 1 or ids.dtype != np.int32:
            raise InvalidRequest(f"token ids must be int32 [n], got {ids.dtype} {ids.shape}")
        if len(ids) and int(ids.min()) < 0:
            raise InvalidRequest("token ids must be >= 0")
        return ids

    def trim(
        self, session: str, keep_turns: int, *, now: float, scope: Scope | None = None
    ) -> tuple[int, int]:
        """Keeps the newest ``keep_turns`` turns (and the system prompt); returns (turns
        dropped, turns left). NotFound for an unknown or expired session."""
        if keep_turns < 0:
            raise InvalidRequest(f"keep_turns must be >= 0, got {keep_turns}")
        s = self._live(session, now, scope)
        drop = max(s.turns - keep_turns, 0)
        if drop:
            if self.index is not None:
                self.index.begin(session)
            s.first += drop
            s._repack(0, 0, 0)
            if self.index is not None:
                self.index.put(s)
        return drop, s.turns

    def delete(self, session: str, *, now: float, scope: Scope | None = None) -> None:
        """Deletes a session: its turns and system prompt. NotFound when there is none."""
        self._live(session, now, scope)
        self._drop(self._sessions.pop(session))

    def forget(self, scope: Scope) -> int:
        """Deletes every session matching ``scope`` (expired ones too); returns how many."""
        names = [name for name, s in self._sessions.items() if s.matches(scope)]
        for name in names:
            self._drop(self._sessions.pop(name))
        return len(names)

    def maybe_reap(self, now: float) -> int:
        """Runs :meth:`reap` when the last one is REAP_INTERVAL_S old."""
        if now < self._next_reap:
            return 0
        self._next_reap = now + REAP_INTERVAL_S
        return self.reap(now)

    def reap(self, now: float) -> int:
        """Reclaims the memory of every session expired at ``now``; returns how many."""
        heap, sessions = self._expiry, self._sessions
        reaped = 0
        while heap and heap[0][0] <= now:
            at, name = heapq.heappop(heap)
            s = sessions.get(name)
            if s is None or s.heap_at != at:
                continue  # deleted, or re-made since this entry was pushed
            if s.expires_at <= now:
                self._drop(sessions.pop(name))
                reaped += 1
            else:  # refreshed by appends since: look again at its new expiry
                heapq.heappush(heap, (s.expires_at, name))
                s.heap_at = s.expires_at
        return reaped

    def _drop(self, s: Session) -> None:
        """Frees a session that is gone (deleted, expired, forgotten, replaced): its index
        slot first, so that no client copies from its region once that is reused."""
        if self.index is not None:
            self.index.remove(s.name)
        s.release()

    def clear(self) -> None:
        for s in self._sessions.values():
            self._drop(s)
        self._sessions.clear()
        self._expiry.clear()
        self._next_reap = -math.inf

    # -- snapshots ---------------------------------------------------------------------------

    def snapshot(self, db: sqlite3.Connection, directory: str) -> None:
        """Writes every session into ``db`` (table ``sessions``) and ``directory``.

        Big arrays go to flat files: ``sessions_tokens.npy`` (int32, every live turn's ids),
        ``sessions_meta.npy`` (uint32 [turns, 4]) and ``sessions_text.npy`` (uint8). The
        table holds each session's owner, settings, system prompt and where its turns start
        in those files. Replaces an earlier snapshot in the same places; does not commit.
        """
        db.execute("DROP TABLE IF EXISTS sessions")
        db.execute(
            "CREATE TABLE sessions (name TEXT PRIMARY KEY, tenant TEXT, user TEXT, "
            "ttl_s REAL, expires_at REAL, rolling INTEGER NOT NULL, turns INTEGER NOT NULL, "
            "turn_at INTEGER NOT NULL, token_at INTEGER NOT NULL, text_at INTEGER NOT NULL, "
            "sys_meta BLOB, sys_tokens BLOB, sys_text BLOB)"
        )
        order = sorted(self._sessions)
        n_turns = sum(self._sessions[name].turns for name in order)
        n_tokens = sum(self._sessions[name].n_tokens for name in order)
        n_text = sum(self._sessions[name].n_text for name in order)
        tokens = _open_npy(directory, "sessions_tokens.npy", np.int32, (n_tokens,))
        meta = _open_npy(directory, "sessions_meta.npy", np.uint32, (n_turns, 4))
        text = _open_npy(directory, "sessions_text.npy", np.uint8, (n_text,))
        rows = []
        at_turn = at_token = at_text = 0
        for name in order:
            s = self._sessions[name]
            t, m, x = s.turn_window(s.first)
            tokens[at_token : at_token + len(t)] = t
            meta[at_turn : at_turn + len(m)] = m
            text[at_text : at_text + len(x)] = x
            sp = s.system
            rows.append(
                (
                    name,
                    s.tenant,
                    s.user,
                    s.ttl_s,
                    None if math.isinf(s.expires_at) else s.expires_at,
                    int(s.rolling),
                    len(m),
                    at_turn,
                    at_token,
                    at_text,
                    None if sp is None else sp.meta,
                    None if sp is None else sp.tokens,
                    None if sp is None else sp.text,
                )
            )
            at_turn, at_token, at_text = at_turn + len(m), at_token + len(t), at_text + len(x)
        for arr in (tokens, meta, text):
            arr.flush()
        del tokens, meta, text
        db.executemany("INSERT INTO sessions VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)

    def restore(self, db: sqlite3.Connection, directory: str) -> None:
        """Replaces every session with those of a :meth:`snapshot` in ``db`` and ``directory``."""
        self.clear()
        tokens = np.load(os.path.join(directory, "sessions_tokens.npy"), mmap_mode="r")
        meta = np.load(os.path.join(directory, "sessions_meta.npy"), mmap_mode="r")
        text = np.load(os.path.join(directory, "sessions_text.npy"), mmap_mode="r")
        rows = db.execute(
            "SELECT name, tenant, user, ttl_s, expires_at, rolling, turns, turn_at, token_at, "
            "text_at, sys_meta, sys_tokens, sys_text FROM sessions ORDER BY name"
        )
        for row in rows:
            (name, tenant, user, ttl_s, expires_at, rolling, turns,
             turn_at, token_at, text_at, sys_meta, sys_tokens, sys_text) = row  # fmt: skip
            m = np.array(meta[turn_at : turn_at + turns])
            tok_lens = m[:, 2].astype(np.int64)
            txt_lens = m[:, 0].astype(np.int64) + m[:, 1]
            n_tok, n_txt = int(tok_lens.sum()), int(txt_lens.sum())
            s = Session(name, tenant, user, self.heap, max(n_tok, _INITIAL_TOKENS))
            s.tokens[:n_tok] = tokens[token_at : token_at + n_tok]
            s.text = np.array(text[text_at : text_at + n_txt])
            s.meta = m if turns else np.zeros((_INITIAL_TURNS, 4), np.uint32)
            if not len(s.text):
                s.text = np.empty(_INITIAL_TEXT, np.uint8)
            s.remap()
            s.tok_cum = [0, *np.cumsum(tok_lens).tolist()]
            s.txt_cum = [0, *np.cumsum(txt_lens).tolist()]
            s.ttl_s = ttl_s
            s.expires_at = math.inf if expires_at is None else expires_at
            s.rolling = bool(rolling)
            if sys_meta is not None:
                s.system = SystemPrompt(
                    len(sys_tokens) // 4, bytes(sys_tokens), bytes(sys_meta), bytes(sys_text)
                )
            if not math.isinf(s.expires_at):
                heapq.heappush(self._expiry, (s.expires_at, name))
                s.heap_at = s.expires_at
            self._sessions[name] = s
            if self.index is not None:
                self.index.put(s)


def _open_npy(directory: str, name: str, dtype: type, shape: tuple[int, ...]) -> np.memmap:
    return np.lib.format.open_memmap(
        os.path.join(directory, name), mode="w+", dtype=dtype, shape=shape
    )


def _split_turns(
    tokens: np.ndarray, meta: np.ndarray, text: np.ndarray
) -> list[tuple[str, str, np.ndarray]]:
    out = []
    raw = text.tobytes()
    t = x = 0
    for role_len, text_len, n_tok, _ in meta.tolist():
        role = raw[x : x + role_len].decode()
        body = raw[x + role_len : x + role_len + text_len].decode()
        out.append((role, body, tokens[t : t + n_tok].copy()))
        t += n_tok
        x += role_len + text_len
    return out
