"""Tenant isolation, as a property: random tenants, users, sessions and operations.

A hypothesis state machine drives one sidecar store (through the client and the in-process
transport: the same encoders and dispatcher as over shm) and a plain reference model side by
side. Whatever the history of adds, upserts, removes, appends, state writes and forgets:

* a search with ``Scope(tenant=T)`` (and any user/session narrowing) returns exactly the
  live items of that scope, never another tenant's (k is larger than the whole store, so
  the result set is fully determined);
* listing sessions, reading a session's context and reading state under a scope see that
  scope's data only;
* a recall for a session sees the session's tenant's memories only (with or without a scope
  of its own), and its token ids are exactly those memories' and that session's;
* ``forget(scope)`` removes every memory, session, state value and event log of the scope,
  and nothing else.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kalos
from conftest import TIMEOUT, make_inproc_client
from kalos import Scope

DIM = 4
K = 64  # more than MAX_ID items can ever be stored: search returns every match
MAX_ID = 24
TENANTS = ("t0", "t1", "t2")
USERS = ("u0", "u1")
SESSIONS = ("s0", "s1", "s2")

tenants = st.sampled_from(TENANTS)
users = st.one_of(st.none(), st.sampled_from(USERS))
sessions = st.one_of(st.none(), st.sampled_from(SESSIONS))


def matches(item: Scope, want: Scope) -> bool:
    return all(w is None or w == have for w, have in zip(want, item, strict=True))


def vector(item: int, version: int) -> np.ndarray:
    return np.random.default_rng(item * 1000 + version).standard_normal(DIM).astype(np.float32)


@st.composite
def filters(draw: st.DrawFn) -> Scope:
    """A search or forget scope: always a tenant, sometimes narrowed further."""
    return Scope(draw(tenants), draw(users), draw(sessions))


class Isolation(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.client: kalos.Client = make_inproc_client(DIM, "ip", timeout=TIMEOUT)
        self.items: dict[int, Scope] = {}  # memory id → its scope
        self.owners: dict[str, Scope] = {}  # session id → (tenant, user)
        self.turns: dict[str, list[int]] = {}  # session id → its token ids
        self.values: dict[tuple[Scope, str], bytes] = {}
        self.logs: dict[str, Scope] = {}  # session id → the log's owner
        self.version = 0

    @initialize()
    def start(self) -> None:
        self.version = 0

    def teardown(self) -> None:
        self.client.close()

    # -- memories ------------------------------------------------------------------------

    @rule(ids=st.lists(st.integers(0, MAX_ID - 1), min_size=1, max_size=6),
          tenant=tenants, user=users, session=sessions)  # fmt: skip
    def add(self, ids: list[int], tenant: str, user: str | None, session: str | None) -> None:
        scope = Scope(tenant, user, session)
        self.version += 1
        vectors = np.stack([vector(i, self.version) for i in ids])
        self.client.add(vectors, ids, [f"{tenant}:{i}" for i in ids], scope=scope,
                        tokens=[[i] for i in ids])  # fmt: skip
        for i in ids:
            self.items[i] = scope

    @rule(ids=st.lists(st.integers(0, MAX_ID - 1), max_size=4))
    def remove(self, ids: list[int]) -> None:
        assert self.client.remove(ids) == len(set(ids) & set(self.items))
        for i in ids:
            self.items.pop(i, None)

    @rule(want=filters(), seed=st.integers(0, 2**16))
    def search_sees_its_scope_only(self, want: Scope, seed: int) -> None:
        q = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
        hits = self.client.search(q, K, scope=want)
        got = {int(i) for i in hits.ids if i != -1}
        assert got == {i for i, s in self.items.items() if matches(s, want)}
        for i, payload in zip(hits.ids.tolist(), hits.payloads or [], strict=False):
            if i != -1:
                assert payload == f"{want.tenant}:{i}"  # the payload is the tenant's too

    # -- sessions ----------------------------------------------------------------------------

    @rule(session=st.sampled_from(SESSIONS), tenant=tenants, user=st.sampled_from(USERS),
          n=st.integers(0, 5))  # fmt: skip
    def append_turn(self, session: str, tenant: str, user: str, n: int) -> None:
        owner = Scope(tenant, user)
        tokens = [hash((tenant, user, session, k)) % 1000 for k in range(n)]
        if session in self.owners and self.owners[session] != owner:
            with pytest.raises(kalos.Conflict):
                self.client.append_turn(session, "user", "x", tokens, scope=owner)
            return
        self.client.append_turn(session, "user", "x", tokens, scope=owner)
        self.owners[session] = owner
        self.turns.setdefault(session, []).extend(tokens)

    @rule(session=st.sampled_from(SESSIONS), want=filters())
    def context_sees_its_scope_only(self, session: str, want: Scope) -> None:
        narrowed = Scope(want.tenant, want.user)
        owner = self.owners.get(session)
        if owner is None or not matches(Scope(*owner[:2], session), narrowed):
            with pytest.raises(kalos.NotFound):
                self.client.context(session, 10_000, scope=narrowed)
        else:
            assert (
                self.client.context(session, 10_000, scope=narrowed).tokens.tolist()
                == (self.turns[session])
            )

    @rule(session=st.sampled_from(SESSIONS), want=st.one_of(st.none(), filters()),
          seed=st.integers(0, 2**16))  # fmt: skip
    def recall_sees_its_scope_only(self, session: str, want: Scope | None, seed: int) -> None:
        q = np.random.default_rng(seed).standard_normal(DIM).astype(np.float32)
        owner = self.owners.get(session)
        narrowed = Scope() if want is None else Scope(want.tenant, want.user)
        if owner is None or not matches(Scope(*owner[:2], session), narrowed):
            with pytest.raises(kalos.NotFound):
                self.client.recall(session, q, k=K, max_tokens=10_000, scope=want)
            return
        r = self.client.recall(session, q, k=K, max_tokens=10_000, scope=want)
        memory_filter = Scope(owner.tenant) if want is None else want
        hits = [int(i) for i in r.ids if i != -1]
        assert set(hits) == {i for i, s in self.items.items() if matches(s, memory_filter)}
        assert all(self.items[i].tenant == owner.tenant for i in hits)
        assert r.texts == [f"{owner.tenant}:{i}" for i in hits]
        assert r.token_ids.tolist() == hits + self.turns[session]

    @rule(want=filters())
    def sessions_list_their_scope_only(self, want: Scope) -> None:
        got = [s.session for s in self.client.sessions(want)]
        expected = sorted(
            name for name, o in self.owners.items() if matches(Scope(o.tenant, o.user, name), want)
        )
        assert got == expected

    # -- state and logs ----------------------------------------------------------------------

    @rule(tenant=tenants, user=users, session=sessions, key=st.sampled_from(("a", "b")),
          value=st.binary(max_size=8))  # fmt: skip
    def put(
        self, tenant: str, user: str | None, session: str | None, key: str, value: bytes
    ) -> None:
        scope = Scope(tenant, user, session)
        self.client.put(key, value, scope=scope)
        self.values[(scope, key)] = value

    @rule(tenant=tenants, user=users, session=sessions, key=st.sampled_from(("a", "b")))
    def get_sees_its_namespace_only(
        self, tenant: str, user: str | None, session: str | None, key: str
    ) -> None:
        scope = Scope(tenant, user, session)
        if (scope, key) in self.values:
            assert self.client.get(key, scope=scope).value == self.values[(scope, key)]
        else:
            with pytest.raises(kalos.NotFound):
                self.client.get(key, scope=scope)

    @precondition(lambda self: bool(self.owners))
    @rule(data=st.data())
    def log(self, data: st.DataObject) -> None:
        session = data.draw(st.sampled_from(sorted(self.owners)))
        self.client.log(session, "step", "x")  # the log takes its session's owner
        self.logs.setdefault(session, self.owners[session])

    # -- forget ------------------------------------------------------------------------------

    @rule(want=filters())
    def forget(self, want: Scope) -> None:
        got = self.client.forget(want)
        gone_items = [i for i, s in self.items.items() if matches(s, want)]
        gone_sessions = [
            n for n, o in self.owners.items() if matches(Scope(o.tenant, o.user, n), want)
        ]
        gone_values = [k for k in self.values if matches(k[0], want)]
        gone_logs = [n for n, o in self.logs.items() if matches(Scope(o.tenant, o.user, n), want)]
        assert got == (len(gone_items), len(gone_sessions), len(gone_values), len(gone_logs))
        for i in gone_items:
            del self.items[i]
        for n in gone_sessions:
            del self.owners[n]
            del self.turns[n]
        for k in gone_values:
            del self.values[k]
        for n in gone_logs:
            del self.logs[n]

    @invariant()
    def no_tenant_sees_another(self) -> None:
        q = np.ones(DIM, np.float32)
        for tenant in TENANTS:
            ids = self.client.search(q, K, scope=Scope(tenant), payloads=False).ids
            assert all(self.items[int(i)].tenant == tenant for i in ids if i != -1)
            for info in self.client.sessions(Scope(tenant)):
                assert info.tenant == tenant


TestIsolation = Isolation.TestCase
TestIsolation.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
