//! What each member did for a call that ended unavailable: the detail behind
//! [`AcquireError::Unavailable`](super::AcquireError::Unavailable) and
//! [`RequestError::Unavailable`](super::RequestError::Unavailable), so that a message can say
//! what is true ("no leader for this key: 1 of 3 members reachable, no quorum") instead of
//! guessing from the last failed session.
//!
//! The exchange (`exchange.rs`) records one [`MemberState`] per member address it tried, the
//! latest one winning; [`Client::last_unavailable`](super::Client::last_unavailable) returns
//! the report of the latest call that ended unavailable. Bounds: one entry per member address,
//! at most [`MEMBERS_MAX`](super::MEMBERS_MAX).
//!
//! Deliberately not here: deciding the result of a call (the exchange), or anything a caller
//! could act on automatically: every state here means that nothing was executed.

use std::fmt;
use std::net::SocketAddr;

use super::exchange::REDIRECTS_MAX;

/// What one member did with a request that it never executed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum MemberState {
    /// It answered `M` naming no leader (or itself): it knows no leader for the key, e.g.
    /// during an election, or without a quorum.
    NoLeader,
    /// It answered `M` naming `leader`.
    Redirected {
        /// The member it named as the key's leader.
        leader: SocketAddr,
    },
    /// No session to it could carry the request: the cause in words (cannot connect, no
    /// answer to the handshake ping, a TLS refusal, not a latchkey server...).
    Unreachable {
        /// Why, as the session said it.
        cause: String,
    },
    /// A session to it was up, but its answers were overdue: it took no new call (a paused
    /// or overloaded server).
    Silent,
    /// Its session was still connecting when the call's deadline passed.
    Connecting,
}

impl MemberState {
    /// Whether the member answered (an `M`): it is up and talks to clients.
    pub fn answered(&self) -> bool {
        matches!(self, MemberState::NoLeader | MemberState::Redirected { .. })
    }
}

impl fmt::Display for MemberState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemberState::NoLeader => f.write_str("knows no leader"),
            MemberState::Redirected { leader } => write!(f, "named {leader} as the leader"),
            MemberState::Unreachable { cause } => f.write_str(cause),
            MemberState::Silent => f.write_str("connected, but its answers are overdue"),
            MemberState::Connecting => f.write_str("still connecting at the deadline"),
        }
    }
}

/// Why a call ended unavailable: what each member it tried did. Nothing was executed.
///
/// Its `Display` is one line for a person, e.g. `no leader for this key: 1 of 3 members
/// reachable, no quorum (127.0.0.1:7421: cannot connect: connection refused; ...)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnavailableReport {
    keyed: bool,
    listed: usize,
    members: Vec<(SocketAddr, MemberState)>,
    redirects_exhausted: bool,
    all_refused: bool,
}

impl UnavailableReport {
    /// An empty report for a call on a key (`keyed`) to a client of `listed` addresses.
    pub(crate) fn new(keyed: bool, listed: usize) -> UnavailableReport {
        UnavailableReport {
            keyed,
            listed,
            members: Vec::new(),
            redirects_exhausted: false,
            all_refused: false,
        }
    }

    /// `addr` did `state`: replaces what it did before.
    pub(crate) fn record(&mut self, addr: SocketAddr, state: MemberState) {
        match self.members.iter_mut().find(|(a, _)| *a == addr) {
            Some((_, old)) => *old = state,
            None => self.members.push((addr, state)),
        }
    }

    /// The call followed [`REDIRECTS_MAX`] `M`s without reaching a leader.
    pub(crate) fn redirects_exhausted(&mut self) {
        self.redirects_exhausted = true;
    }

    /// The call ended at once because every listed member refused the connection.
    pub(crate) fn refused_everywhere(&mut self) {
        self.all_refused = true;
    }

    /// Whether the call ended at once, before its deadline, because every listed member
    /// refused the connection: nothing listens at any of them (see
    /// [`ClientConfig::retry_refused`](super::ClientConfig::retry_refused)).
    pub fn all_refused(&self) -> bool {
        self.all_refused
    }

    /// Every member tried, with what it did last, in the order first tried.
    pub fn members(&self) -> &[(SocketAddr, MemberState)] {
        &self.members
    }

    /// The number of addresses the client was given.
    pub fn listed(&self) -> usize {
        self.listed
    }

    /// The members that answered (an `M`).
    pub fn reachable(&self) -> usize {
        self.members.iter().filter(|(_, s)| s.answered()).count()
    }

    /// Whether no majority of the listed members can be up: at most half of them are left
    /// once those that could not be reached are taken away. `false` with one address, which
    /// tells nothing about a cluster's size.
    pub fn no_quorum(&self) -> bool {
        let failed = self.members.iter().filter(|(_, s)| !s.answered()).count();
        self.listed >= 2 && 2 * self.listed.saturating_sub(failed) <= self.listed
    }

    /// A leader some member named that did not answer itself: (named by, leader).
    fn unreached_leader(&self) -> Option<(SocketAddr, SocketAddr)> {
        self.members.iter().find_map(|(from, state)| match state {
            MemberState::Redirected { leader } => {
                let answered = self
                    .members
                    .iter()
                    .any(|(addr, state)| addr == leader && state.answered());
                (!answered).then_some((*from, *leader))
            }
            _ => None,
        })
    }

    /// "a: cause; b: cause" for the members that did not answer.
    fn silent_members(&self) -> String {
        let mut text = String::new();
        for (addr, state) in self.members.iter().filter(|(_, s)| !s.answered()) {
            if !text.is_empty() {
                text.push_str("; ");
            }
            text.push_str(&format!("{addr}: {state}"));
        }
        text
    }

    /// "1 of 3 members reachable, no quorum".
    fn reach_text(&self) -> String {
        let (reachable, listed) = (self.reachable(), self.listed);
        let noun = if listed == 1 { "member" } else { "members" };
        let mut text = format!("{reachable} of {listed} {noun} reachable");
        if self.no_quorum() {
            text.push_str(", no quorum");
        } else if self.members.len() < listed {
            text.push_str(&format!(", {} not tried", listed - self.members.len()));
        }
        text
    }
}

impl fmt::Display for UnavailableReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let answered = self.reachable() > 0;
        if self.redirects_exhausted {
            write!(
                f,
                "{REDIRECTS_MAX} redirects followed without reaching the key's leader: "
            )?;
        } else if let (true, Some((from, leader))) = (answered, self.unreached_leader()) {
            let how = self
                .members
                .iter()
                .find(|(addr, _)| *addr == leader)
                .map_or("not tried".to_string(), |(_, state)| state.to_string());
            return write!(
                f,
                "the key's leader {leader} (named by {from}) cannot be reached: {how}; {}",
                self.reach_text()
            );
        } else if answered && self.keyed {
            f.write_str("no leader for this key: ")?;
        } else if !answered {
            return match self.members.as_slice() {
                [] => f.write_str("no member answered before the deadline"),
                [(addr, state)] if self.listed == 1 => write!(f, "{addr}: {state}"),
                _ => {
                    write!(f, "no member reachable: {}", self.silent_members())?;
                    match self.listed.saturating_sub(self.members.len()) {
                        0 => Ok(()),
                        untried => write!(f, "; {untried} not tried"),
                    }
                }
            };
        }
        f.write_str(&self.reach_text())?;
        let silent = self.silent_members();
        if !silent.is_empty() {
            write!(f, " ({silent})")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn refused() -> MemberState {
        MemberState::Unreachable {
            cause: "cannot connect: connection refused".into(),
        }
    }

    #[test]
    fn one_member_without_a_leader_of_three_says_no_quorum() {
        let mut report = UnavailableReport::new(true, 3);
        report.record(addr(1), MemberState::NoLeader);
        report.record(addr(2), refused());
        report.record(addr(3), refused());
        assert_eq!((report.reachable(), report.no_quorum()), (1, true));
        assert_eq!(
            report.to_string(),
            "no leader for this key: 1 of 3 members reachable, no quorum \
             (127.0.0.1:2: cannot connect: connection refused; \
             127.0.0.1:3: cannot connect: connection refused)"
        );
    }

    #[test]
    fn a_majority_without_a_leader_is_not_said_to_lack_a_quorum() {
        let mut report = UnavailableReport::new(true, 3);
        report.record(addr(1), MemberState::NoLeader);
        report.record(addr(2), MemberState::NoLeader);
        assert!(!report.no_quorum());
        assert_eq!(
            report.to_string(),
            "no leader for this key: 2 of 3 members reachable, 1 not tried"
        );
        // The latest state of a member wins.
        report.record(addr(2), MemberState::Silent);
        assert_eq!(report.reachable(), 1);
        assert!(!report.no_quorum(), "one of three failed: two may be up");
    }

    #[test]
    fn a_named_leader_that_cannot_be_reached_is_named() {
        let mut report = UnavailableReport::new(true, 3);
        report.record(addr(1), MemberState::Redirected { leader: addr(9) });
        report.record(addr(9), refused());
        assert_eq!(
            report.to_string(),
            "the key's leader 127.0.0.1:9 (named by 127.0.0.1:1) cannot be reached: cannot \
             connect: connection refused; 1 of 3 members reachable, 1 not tried"
        );
    }

    #[test]
    fn unreachable_members_are_listed_and_a_single_one_is_said_plainly() {
        let mut single = UnavailableReport::new(true, 1);
        single.record(addr(1), refused());
        assert_eq!(
            single.to_string(),
            "127.0.0.1:1: cannot connect: connection refused"
        );
        assert!(!single.no_quorum(), "one address tells nothing of a quorum");
        let mut all = UnavailableReport::new(false, 2);
        all.record(addr(1), refused());
        all.record(addr(2), MemberState::Silent);
        assert!(all.no_quorum());
        assert_eq!(
            all.to_string(),
            "no member reachable: 127.0.0.1:1: cannot connect: connection refused; \
             127.0.0.1:2: connected, but its answers are overdue"
        );
        let mut partly = UnavailableReport::new(false, 3);
        partly.record(addr(1), MemberState::Connecting);
        assert_eq!(
            partly.to_string(),
            "no member reachable: 127.0.0.1:1: still connecting at the deadline; 2 not tried"
        );
        let nothing = UnavailableReport::new(true, 3);
        assert_eq!(
            nothing.to_string(),
            "no member answered before the deadline"
        );
    }

    #[test]
    fn a_redirect_loop_says_so() {
        let mut report = UnavailableReport::new(true, 2);
        report.record(addr(1), MemberState::Redirected { leader: addr(2) });
        report.record(addr(2), MemberState::Redirected { leader: addr(1) });
        report.redirects_exhausted();
        assert_eq!(
            report.to_string(),
            format!(
                "{REDIRECTS_MAX} redirects followed without reaching the key's leader: 2 of 2 \
                 members reachable"
            )
        );
    }
}
