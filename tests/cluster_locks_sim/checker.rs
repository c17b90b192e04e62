//! The model of what clients may believe, and the checks against it.
//!
//! A *belief* is a client's view of a hold: from the `A` it got for an acquire sent at `t`
//! with lease `L`, it holds until `t + L` (an `E` for an extend sent at `t'` with lease `L'`
//! moves that to `t' + L'`). A belief ends when its release is answered `R` or `N`, or when a
//! release was in flight on a session that died (indeterminate: the client stops using it).
//! A release in flight may take effect before its `R` reaches the client (the leader that
//! proposed it lost its quorum, a new one committed it): a client that sent a release no
//! longer counts on the hold, so such a belief does not block other grants until it is
//! answered `M` (no effect).
//!
//! Checks (each failure is one line in `violations`):
//! * one holder per key: a grant answered while another belief on the key is live;
//! * tokens unique in the cluster and strictly increasing per key, in answer order;
//! * at most one terminal answer per acquire per session, and at most one `A` per owner id;
//! * `N` for a token whose belief is live (and whose release is not in flight);
//! * a member's machine frees a token whose belief is live (lease ended early);
//! * `Q` says "free" for a key whose belief was live from before the query was sent until
//!   after it was answered;
//! * an acquire executed twice: one owner's hold under two tokens, on any members (each
//!   member's machines are sampled after each of its iterations: a grant holds its key for at
//!   least an iteration on the member that applies it first, as its end — a release, the
//!   leader's expiry or its release of an undelivered grant — is proposed only after);
//! * an acquire executed after a Resolve answered "never seen" for it (docs/protocol.md §5),
//!   or after it was answered `T` or `B` (or a Resolve said *timed out* or *busy*);
//! * a Resolve answered "timed out" or "busy" for an acquire answered `A` (a fate a leader
//!   answered, or one a new leader read from the replicated record of a withdrawn waiter).
//!
//! Bounds: one entry per grant and per acquire of a run (a run is a few seconds).

use std::collections::{BTreeMap, HashMap, HashSet};

/// Violations kept at most (the first ones matter).
const VIOLATIONS_MAX: usize = 20;

/// A client's view of one grant.
#[derive(Clone, Debug)]
pub struct Belief {
    /// The key.
    pub key: Vec<u8>,
    /// The client holding it.
    pub client: usize,
    /// When the `A` arrived (global µs).
    pub granted_us: u64,
    /// Until when the client believes it holds (global µs).
    pub deadline_us: u64,
    /// Released (answered), or its release became indeterminate.
    pub ended: bool,
    /// A release of it is in flight.
    pub releasing: bool,
    /// An extend of it is in flight: its send time plus its lease. It may apply before its
    /// answer comes (or never comes): until then the client counts on the earlier deadline.
    pub extending: Option<u64>,
}

impl Belief {
    /// Until when the client may act on it: the earlier of its deadline and that of an
    /// extend in flight (a shorter lease shortens it).
    pub fn until_us(&self) -> u64 {
        self.extending
            .map_or(self.deadline_us, |at| at.min(self.deadline_us))
    }

    /// Whether the client may still act on it at `now_us`.
    pub fn live(&self, now_us: u64) -> bool {
        !self.ended && self.until_us() > now_us
    }
}

/// The model and the checks.
#[derive(Default)]
pub struct Checker {
    /// Every grant answered, by token.
    pub beliefs: BTreeMap<u64, Belief>,
    last_token: HashMap<Vec<u8>, u64>,
    terminal: HashSet<(u64, u64, u32)>,
    granted_owners: HashSet<u64>,
    /// Every grant executed (seen on any member's machine): owner → token.
    executed: HashMap<u64, u64>,
    /// Owners a Resolve answered "never seen", and when.
    never_seen: HashMap<u64, u64>,
    /// Owners whose acquire was answered `T` or `B` (or a Resolve said so), and when.
    ended: HashMap<u64, (u64, char)>,
    /// What went wrong.
    pub violations: Vec<String>,
    /// Violations beyond [`VIOLATIONS_MAX`].
    pub violations_dropped: usize,
    /// Grants answered.
    pub grants: u64,
}

impl Checker {
    /// Records a violation.
    pub fn fail(&mut self, now_us: u64, what: String) {
        if self.violations.len() < VIOLATIONS_MAX {
            self.violations.push(format!("at {} µs: {what}", now_us));
        } else {
            self.violations_dropped += 1;
        }
    }

    /// A terminal answer (A, T, B or M) to attempt `attempt` of the acquire `owner` on
    /// `session` (a resend after `M` is a new attempt, maybe on the same session).
    pub fn terminal(&mut self, now_us: u64, sent: (u64, u64, u32), what: char) {
        let (session, owner, _) = sent;
        if !self.terminal.insert(sent) {
            self.fail(
                now_us,
                format!("acquire {owner:#x}: second terminal answer {what} on session {session}"),
            );
        }
    }

    /// `A(token)` answered at `now_us` for the acquire `owner` of `client` sent at `sent_us`.
    pub fn granted(&mut self, now_us: u64, grant: Grant, key: &[u8]) {
        self.grants += 1;
        let Grant {
            client,
            owner,
            token,
            sent_us,
            lease_us,
        } = grant;
        if !self.granted_owners.insert(owner) {
            self.fail(now_us, format!("acquire {owner:#x} granted twice"));
        }
        if self.beliefs.contains_key(&token) {
            self.fail(now_us, format!("token {token} granted twice"));
        }
        let last = self.last_token.insert(key.to_vec(), token).unwrap_or(0);
        if token <= last {
            self.fail(now_us, format!("key {key:?}: token {token} after {last}"));
        }
        let live: Vec<(u64, Belief)> = self
            .beliefs
            .iter()
            .filter(|(_, b)| b.key == key && !b.releasing && b.live(now_us))
            .map(|(t, b)| (*t, b.clone()))
            .collect();
        for (other, belief) in live {
            self.fail(
                now_us,
                format!(
                    "key {key:?}: token {token} granted to client {client} while client {} \
                     believes it holds token {other} until {} µs",
                    belief.client,
                    belief.until_us()
                ),
            );
        }
        let belief = Belief {
            key: key.to_vec(),
            client,
            granted_us: now_us,
            deadline_us: sent_us + lease_us,
            ended: false,
            releasing: false,
            extending: None,
        };
        self.beliefs.insert(token, belief);
    }

    /// A member's machine no longer holds `token` (freed by release or expiry).
    pub fn freed(&mut self, now_us: u64, member: u64, token: u64) {
        let Some(belief) = self.beliefs.get(&token) else {
            return; // never answered: nobody believes in it
        };
        if belief.live(now_us) && !belief.releasing {
            let deadline = belief.until_us();
            self.fail(
                now_us,
                format!(
                    "member {member} freed token {token} of client {} early: the client \
                     holds it until {deadline} µs",
                    belief.client
                ),
            );
        }
    }

    /// Member `member`'s machine holds `token` for `owner`, not held there before.
    pub fn executed(&mut self, now_us: u64, member: u64, token: u64, owner: u64) {
        match self.executed.get(&owner) {
            Some(&first) if first != token => self.fail(
                now_us,
                format!("acquire {owner:#x} executed twice: tokens {first} and {token}"),
            ),
            Some(_) => {}
            None => {
                self.executed.insert(owner, token);
                if let Some(&(at, what)) = self.ended.get(&owner) {
                    self.fail(
                        now_us,
                        format!(
                            "acquire {owner:#x} executed (token {token}, member {member}) after \
                             it was answered {what} at {at} µs"
                        ),
                    );
                }
                if let Some(&at) = self.never_seen.get(&owner) {
                    self.fail(
                        now_us,
                        format!(
                            "acquire {owner:#x} executed (token {token}, member {member}) after \
                             a Resolve answered never seen at {at} µs"
                        ),
                    );
                }
            }
        }
    }

    /// The acquire of `owner` was answered `what` (`T` or `B`, or a Resolve's *timed out* or
    /// *busy*) at `now_us`: it must never execute after (if it executed before, its grant was
    /// released unanswered).
    pub fn answered_ended(&mut self, now_us: u64, owner: u64, what: char) {
        self.ended.entry(owner).or_insert((now_us, what));
    }

    /// A Resolve from member `member` answered "timed out" or "busy" for `owner` at `now_us`.
    pub fn resolved_ended(&mut self, now_us: u64, member: u64, owner: u64) {
        self.answered_ended(now_us, owner, 'R');
        if self.granted_owners.contains(&owner) {
            let what =
                format!("member {member} answered timed out or busy for {owner:#x}, answered A");
            self.fail(now_us, what);
        }
    }

    /// A Resolve from member `member` answered "never seen" for `owner` at `now_us`.
    pub fn never_seen(&mut self, now_us: u64, member: u64, owner: u64) {
        if self.granted_owners.contains(&owner) {
            let what = format!("member {member} answered never seen for {owner:#x}, answered A");
            self.fail(now_us, what);
        }
        self.never_seen.entry(owner).or_insert(now_us);
    }

    /// `N` for `token` answered at `now_us`.
    pub fn not_held(&mut self, now_us: u64, token: u64, what: &str) {
        if let Some(belief) = self.beliefs.get(&token) {
            if belief.live(now_us) && !belief.releasing {
                let deadline = belief.until_us();
                self.fail(
                    now_us,
                    format!("{what} of token {token} answered N; client holds it until {deadline}"),
                );
            }
        }
        if let Some(belief) = self.beliefs.get_mut(&token) {
            belief.ended = true;
        }
    }

    /// `Q` answered `held = false` for `key`, for a query sent at `sent_us`.
    pub fn queried_free(&mut self, now_us: u64, sent_us: u64, key: &[u8]) {
        let held: Vec<u64> = self
            .beliefs
            .iter()
            .filter(|(_, b)| b.key == key && !b.releasing && b.live(now_us))
            .filter(|(_, b)| b.granted_us < sent_us)
            .map(|(t, _)| *t)
            .collect();
        for token in held {
            self.fail(
                now_us,
                format!("query of {key:?} sent at {sent_us} says free; token {token} is held"),
            );
        }
    }

    /// The belief in `token`, to change it (extend, release).
    pub fn belief_mut(&mut self, token: u64) -> Option<&mut Belief> {
        self.beliefs.get_mut(&token)
    }
}

/// An answered grant, for [`Checker::granted`].
#[derive(Clone, Copy, Debug)]
pub struct Grant {
    /// The client.
    pub client: usize,
    /// The acquire's owner id.
    pub owner: u64,
    /// The token.
    pub token: u64,
    /// When the (last) acquire was sent.
    pub sent_us: u64,
    /// The lease asked for.
    pub lease_us: u64,
}
