//! Resumable calls in one partition (docs/protocol.md §5): a closed session's waiters and
//! grants kept for its client, Resolve's answers, attaching, "never seen" and its refusal, and
//! the end of a client's grace.

use super::*;
use crate::partition::{ClientRef, Fate};

const CLIENT: ClientRef = ClientRef(5);
const OTHER: ClientRef = ClientRef(6);

impl Fixture {
    fn acquire_as(
        &mut self,
        session: SessionId,
        client: ClientRef,
        (wait_s, lease_s, owner): (u8, u8, u64),
        key: &[u8],
    ) -> Vec<Seen> {
        let op = Op::Acquire {
            wait_s,
            lease_s,
            owner,
        };
        self.table.handle_as(self.now_us, session, client, op, key);
        drain(&mut self.table)
    }

    fn resolve(
        &mut self,
        session: SessionId,
        client: ClientRef,
        owner: u64,
        key: &[u8],
    ) -> Response {
        let op = Op::Resolve { owner };
        self.table.handle_as(self.now_us, session, client, op, key);
        let answers = drain(&mut self.table);
        assert_eq!(answers.len(), 1, "one answer to a Resolve: {answers:?}");
        assert_eq!(answers[0].session, session);
        answers[0].response
    }

    fn close_as(&mut self, session: SessionId, client: ClientRef) -> Vec<Seen> {
        self.table.handle_session_closed_as(session, client);
        drain(&mut self.table)
    }
}

fn resolved(owner: u64, fate: Fate, token: u64, lease_ms: u32) -> Response {
    Response::Resolved {
        owner,
        fate,
        token,
        lease_ms,
    }
}

#[test]
fn a_closed_sessions_waiter_stays_queued_and_is_granted_on_the_session_that_resolves_it() {
    let mut fixture = Fixture::new(8, 8);
    let holder = fixture.grant(1, 30, 1, KEY);
    assert!(fixture.acquire_as(2, CLIENT, (10, 30, 2), KEY).is_empty());
    // Session 2 dies: its waiter stays, in place, for its client.
    assert!(fixture.close_as(2, CLIENT).is_empty());
    assert_eq!(fixture.query(KEY), (true, 30_000, 1));
    // Another client's Resolve of the same owner finds nothing of its own.
    assert_eq!(
        fixture.resolve(4, OTHER, 2, KEY),
        resolved(2, Fate::NeverSeen, 0, 0)
    );
    assert_eq!(
        fixture.resolve(3, CLIENT, 2, KEY),
        resolved(2, Fate::Queued, 0, 0)
    );
    // The holder leaves: the grant goes to the session that resolved it.
    let answers = fixture.release(1, holder, KEY);
    assert_eq!(answers[1], granted(3, 2, holder + 1, true, KEY));
    // A Cancel from the new session withdraws an attached waiter too.
    assert!(fixture.acquire_as(3, CLIENT, (10, 30, 3), KEY).is_empty());
    assert!(fixture.close_as(3, CLIENT).is_empty());
    assert_eq!(
        fixture.resolve(5, CLIENT, 3, KEY),
        resolved(3, Fate::Queued, 0, 0)
    );
    assert_eq!(fixture.cancel(5, 3, KEY), vec![timeout(5, 3, true)]);
}

#[test]
fn a_grant_made_while_its_client_is_away_waits_for_its_resolve() {
    let mut fixture = Fixture::new(8, 8);
    let holder = fixture.grant(1, 30, 1, KEY);
    assert!(fixture.acquire_as(2, CLIENT, (10, 5, 2), KEY).is_empty());
    fixture.close_as(2, CLIENT);
    // Granted while detached: no answer goes anywhere; the key is held.
    let answers = fixture.release(1, holder, KEY);
    assert_eq!(
        answers,
        vec![said(1, Response::Released { token: holder }, false)]
    );
    assert_eq!(fixture.query(KEY), (true, 5_000, 0));
    fixture.advance(SECOND_US);
    let token = holder + 1;
    assert_eq!(
        fixture.resolve(3, CLIENT, 2, KEY),
        resolved(2, Fate::Granted, token, 4_000)
    );
    // Resolved, it is the client's like any grant: released by its token.
    assert_eq!(fixture.release(3, token, KEY).len(), 1);
    assert_eq!(fixture.query(KEY), (false, 0, 0));
}

#[test]
fn an_undelivered_grant_of_an_identified_client_is_kept_for_it() {
    let mut fixture = Fixture::new(8, 8);
    let answers = fixture.acquire_as(2, CLIENT, (0, 30, 7), KEY);
    let Response::Acquired { token, .. } = answers[0].response else {
        panic!("granted: {answers:?}");
    };
    // The `A` never reached session 2 (it died with it unsent): kept, not released.
    assert!(fixture.table.release_granted_as(
        START_US,
        answers[0].key_entry(&fixture),
        token,
        CLIENT
    ));
    fixture.close_as(2, CLIENT);
    assert_eq!(fixture.query(KEY), (true, 30_000, 0));
    assert_eq!(
        fixture.resolve(3, CLIENT, 7, KEY),
        resolved(7, Fate::Granted, token, 30_000)
    );
    // Delivered now: the end of the client's grace leaves it alone.
    fixture.table.handle_client_gone(fixture.now_us, CLIENT);
    assert_eq!(fixture.query(KEY), (true, 30_000, 0));
}

#[test]
fn timeouts_and_refusals_are_remembered_and_anything_else_is_never_seen() {
    let mut fixture = Fixture::new(8, 1);
    fixture.grant(1, 30, 1, KEY);
    let answers = fixture.acquire_as(2, CLIENT, (0, 30, 2), KEY);
    assert_eq!(answers, vec![timeout(2, 2, false)]);
    assert!(fixture.acquire_as(2, CLIENT, (5, 30, 3), KEY).is_empty());
    assert_eq!(
        fixture.acquire_as(2, CLIENT, (5, 30, 4), KEY),
        vec![busy(2, 4, true)]
    );
    fixture.close_as(2, CLIENT);
    // Its wait runs out while it is away: remembered, and answered to nobody.
    assert!(fixture.advance(5 * SECOND_US).is_empty());
    assert_eq!(
        fixture.resolve(3, CLIENT, 2, KEY),
        resolved(2, Fate::TimedOut, 0, 0)
    );
    assert_eq!(
        fixture.resolve(3, CLIENT, 3, KEY),
        resolved(3, Fate::TimedOut, 0, 0)
    );
    assert_eq!(
        fixture.resolve(3, CLIENT, 4, KEY),
        resolved(4, Fate::Busy, 0, 0)
    );
    // Never seen is final: the acquire, should it come now, is refused and not executed.
    assert_eq!(
        fixture.resolve(3, CLIENT, 9, b"free"),
        resolved(9, Fate::NeverSeen, 0, 0)
    );
    assert_eq!(
        fixture.acquire_as(2, CLIENT, (0, 30, 9), b"free"),
        vec![busy(2, 9, false)]
    );
    assert_eq!(fixture.query(b"free"), (false, 0, 0));
    assert_eq!(fixture.table.stats().busy.get(BusyReason::Resolved), 1);
    // Another client's owner 9 is its own.
    assert_eq!(fixture.acquire_as(4, OTHER, (0, 30, 9), b"free").len(), 1);
    assert_eq!(fixture.table.stats().resolves, [1, 0, 0, 2, 1]);
}

#[test]
fn the_end_of_a_grace_withdraws_the_clients_waiters_and_releases_what_it_never_got() {
    let mut fixture = Fixture::new(8, 8);
    let holder = fixture.grant(1, 30, 1, KEY);
    let other = fixture.grant(1, 30, 9, b"other");
    assert!(fixture.acquire_as(2, CLIENT, (30, 30, 2), KEY).is_empty());
    assert!(fixture
        .acquire_as(2, CLIENT, (30, 30, 3), b"other")
        .is_empty());
    fixture.enqueue(4, 30, 30, 4, KEY);
    fixture.close_as(2, CLIENT);
    // The grant of 2 goes to its detached client: nobody is answered but the releaser.
    let released = fixture.release(1, holder, KEY);
    assert_eq!(
        released,
        vec![said(1, Response::Released { token: holder }, false)]
    );
    fixture.table.handle_client_gone(fixture.now_us, CLIENT);
    // Its grant never reached it: released, and handed to the next waiter in the same step;
    // its waiter on `other` left silently.
    assert_eq!(
        drain(&mut fixture.table),
        vec![granted(4, 4, other + 2, true, KEY)]
    );
    assert_eq!(fixture.query(b"other"), (true, 30_000, 0));
    assert_eq!(fixture.table.stats().grace_releases, 1);
    assert_eq!(fixture.table.client_records(), 0);
    assert_eq!(
        fixture.resolve(5, CLIENT, 2, KEY),
        resolved(2, Fate::NeverSeen, 0, 0)
    );
}

impl Seen {
    /// The entry this grant names (its key's entry in the fixture's table).
    fn key_entry(&self, fixture: &Fixture) -> u32 {
        let key = self.key.as_deref().expect("a grant");
        let hash = fixture.table.hasher.hash_one(key);
        fixture.table.find(hash, key).expect("held")
    }
}
