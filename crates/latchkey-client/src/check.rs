//! Whether a client's list of addresses names the members of one cluster, from their cards
//! (`card.rs`), and which addresses a call may send to: no list that mixes clusters, or a
//! cluster and a standalone server, can make two holders of one key.
//!
//! The rules, for a client given more than one address (one address is never asked):
//! * The list is *accepted* once some address answered a card and every listed address is
//!   vouched for: it answered a card of that same owner (cluster, or standalone server run), or
//!   a card of that cluster lists it as a member's client address (a member that is down or
//!   paused, or of a build before cards, which answers `GET /cluster` 404: a rolling upgrade),
//!   or nothing listens there (the connection was refused: a member down, or a name's other
//!   address, e.g. `::1` of `localhost` where the server listens on `127.0.0.1` only).
//! * The list is *refused* for the client's life as soon as two listed addresses answer cards
//!   of different owners (two clusters, a cluster and a standalone server, two standalone
//!   servers), or one answers without a card where the cluster's cards do not list it (not
//!   latchkey, or an older standalone server): nothing is sent to any of them, whatever
//!   answered first. Each refusal is logged as an error naming every address and what it is.
//! * When every listed server answered without a card (or nothing listens there), they are all
//!   of builds before cards: the list is used as given, unchecked (logged once as a warning),
//!   as a client before cards did; a card answered later decides as above.
//! * Until then the list is *pending*: a call waits for the asks in flight (within its own
//!   deadline) and sends nothing. An address that could not be asked (no answer in time) is
//!   asked again when a call needs it.
//! * Once accepted, a call sends to an address that answered the list's card or that a card of
//!   the cluster lists (a leader named in an `M` among them); any other address (one where
//!   nothing listened, or a leader named in an `M` that no card lists) is asked first. A listed
//!   address that then answers another owner's card refuses the whole list; an `M`-named one,
//!   only itself.
//!
//! A window is left, and documented: an address where nothing listened when the list was
//! accepted may later start a server of another owner; the client finds it out when a call
//! next needs that address (and refuses the list from then on), not before.
//!
//! Sans-IO: [`Check`] takes answers and says verdicts; `members.rs` asks (one thread per ask).
//! Invariants: an accepted address answered the list's owner or a card of it lists it; a
//! refused list stays refused.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use super::card::{Card, FetchError, Owner};

/// What may be done with an address now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Send to it.
    Accepted,
    /// Never send to it: why.
    Refused(Arc<str>),
    /// Not yet: ask the addresses in `ask` (none is being asked), and wait while `waiting`
    /// (asks are in flight); otherwise the call goes elsewhere, because of `why`. `refused`:
    /// nothing listens at this address (a refused connection, for a call that fails at once
    /// when every listed member refuses).
    Unsettled {
        ask: Vec<SocketAddr>,
        waiting: bool,
        why: Arc<str>,
        refused: bool,
    },
}

/// What one address answered.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Answer {
    /// Its card is being asked for.
    Asking,
    /// A card of this owner.
    Card(Owner),
    /// Nothing listens there (the connection was refused): the cause.
    Absent(Arc<str>),
    /// It could not be asked (timeout, reset, TLS): the cause.
    Failed(Arc<str>),
    /// It answered without a card: the cause.
    NoCard(Arc<str>),
}

/// The list's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum List {
    Pending,
    Accepted(Owner),
    /// Every listed server is of a build before cards: used as given, unchecked.
    Unchecked,
    Refused,
}

/// What a refused list's addresses are told, after what each is.
const NOT_ONE_CLUSTER: &str = "the listed servers are not the members of one cluster";

/// The answers of a client's addresses, and what they make of its list.
pub(crate) struct Check {
    configured: Vec<SocketAddr>,
    answers: HashMap<SocketAddr, Answer>,
    /// Every client address the cards of each cluster listed (at most 64 per card).
    listed: HashMap<Owner, Vec<SocketAddr>>,
    list: List,
    /// Addresses named in an `M` that answered another owner, or no card: why.
    strangers: HashMap<SocketAddr, Arc<str>>,
}

impl Check {
    /// A check of `configured` (distinct; more than one), none of them asked yet.
    pub(crate) fn new(configured: &[SocketAddr]) -> Check {
        Check {
            configured: configured.to_vec(),
            answers: HashMap::new(),
            listed: HashMap::new(),
            list: List::Pending,
            strangers: HashMap::new(),
        }
    }

    /// `addr` is being asked.
    pub(crate) fn asking(&mut self, addr: SocketAddr) {
        self.answers.insert(addr, Answer::Asking);
    }

    /// What the ask of `addr` found.
    pub(crate) fn answered(&mut self, addr: SocketAddr, answer: Result<Card, FetchError>) {
        let answer = match answer {
            Ok(card) => {
                let owner = card.owner();
                if let Card::Member { clients, .. } = card {
                    let listed = self.listed.entry(owner).or_default();
                    for (_, client) in clients {
                        if !listed.contains(&client) {
                            listed.push(client);
                        }
                    }
                }
                Answer::Card(owner)
            }
            Err(FetchError::Refused(cause)) => Answer::Absent(Arc::from(cause)),
            Err(FetchError::Unreachable(cause)) => Answer::Failed(Arc::from(cause)),
            Err(error @ FetchError::NotACard(_)) => Answer::NoCard(Arc::from(error.to_string())),
        };
        self.answers.insert(addr, answer);
        if self.configured.contains(&addr) {
            self.decide();
        } else {
            self.stranger(addr);
        }
        self.check_invariants();
    }

    /// The verdict on `addr`.
    pub(crate) fn verdict(&self, addr: SocketAddr) -> Verdict {
        let owner = match self.list {
            List::Refused => {
                let why = format!("{} ({NOT_ONE_CLUSTER})", self.what_it_is(addr));
                return Verdict::Refused(Arc::from(why));
            }
            List::Pending => return self.pending(addr),
            List::Unchecked => return self.unchecked(addr),
            List::Accepted(owner) => owner,
        };
        if let Some(why) = self.strangers.get(&addr) {
            return Verdict::Refused(Arc::clone(why));
        }
        let answer = self.answers.get(&addr);
        if answer == Some(&Answer::Card(owner)) || self.lists(owner, addr) {
            return Verdict::Accepted;
        }
        let (why, refused) = match answer {
            Some(Answer::Asking) => {
                let why = Arc::from("its card (GET /cluster) was not answered in time");
                return Verdict::Unsettled {
                    ask: Vec::new(),
                    waiting: true,
                    why,
                    refused: false,
                };
            }
            Some(Answer::Absent(why)) => (Arc::clone(why), true),
            Some(Answer::Failed(why)) => (Arc::clone(why), false),
            _ => (
                Arc::from("its card (GET /cluster) was not asked for yet"),
                false,
            ),
        };
        Verdict::Unsettled {
            ask: vec![addr],
            waiting: false,
            why,
            refused,
        }
    }

    /// The verdict on `addr` in a list of older builds: what answered is used, as before cards;
    /// an address where nothing listened is asked first (a server of this build there, with
    /// its card, then refuses the list: it cannot be known to be the others' cluster).
    fn unchecked(&self, addr: SocketAddr) -> Verdict {
        match self.answers.get(&addr) {
            Some(Answer::Absent(why)) if self.configured.contains(&addr) => Verdict::Unsettled {
                ask: vec![addr],
                waiting: false,
                why: Arc::clone(why),
                refused: true,
            },
            Some(Answer::Asking) => Verdict::Unsettled {
                ask: Vec::new(),
                waiting: true,
                why: Arc::from("its card (GET /cluster) was not answered in time"),
                refused: false,
            },
            _ => Verdict::Accepted,
        }
    }

    /// The verdict on `addr` while the list is pending: ask every listed address that has
    /// not answered a card yet, wait while asks are in flight.
    fn pending(&self, addr: SocketAddr) -> Verdict {
        let waiting =
            (self.configured.iter()).any(|a| self.answers.get(a) == Some(&Answer::Asking));
        let ask: Vec<SocketAddr> = (self.configured.iter())
            .filter(|a| !matches!(self.answers.get(a), Some(Answer::Asking | Answer::Card(_))))
            .copied()
            .collect();
        let (why, refused) = match self.answers.get(&addr) {
            Some(Answer::Absent(why)) => (Arc::clone(why), true),
            _ => (Arc::from(self.pending_why()), false),
        };
        Verdict::Unsettled {
            ask,
            waiting,
            why,
            refused,
        }
    }

    /// Why a pending list is not accepted yet, in words.
    fn pending_why(&self) -> String {
        let unknown: Vec<String> = (self.configured.iter())
            .filter_map(|addr| match self.answers.get(addr) {
                Some(Answer::Card(_)) => None,
                Some(Answer::Failed(why) | Answer::Absent(why)) => Some(format!("{addr}: {why}")),
                Some(Answer::Asking) => Some(format!("{addr}: its card is being asked for")),
                _ => Some(format!("{addr}: not asked yet")),
            })
            .collect();
        format!(
            "the listed servers are not confirmed members of one cluster yet ({})",
            unknown.join("; ")
        )
    }

    /// Bit `i` set for each configured address (at most 32) accepted now.
    pub(crate) fn accepted_mask(&self) -> u32 {
        let accepted = |addr: &SocketAddr| self.verdict(*addr) == Verdict::Accepted;
        let bits = self.configured.iter().take(32).enumerate();
        bits.filter(|(_, addr)| accepted(addr))
            .fold(0, |mask, (i, _)| mask | 1 << i)
    }

    /// Whether every configured address has an answer other than [`Answer::Asking`].
    pub(crate) fn settled(&self) -> bool {
        let asking = |addr: &SocketAddr| self.answers.get(addr) == Some(&Answer::Asking);
        !self.configured.iter().any(asking)
    }

    /// The addresses never sent to, and why: with the list refused, every listed one (what it
    /// answered); and every `M`-named address that answered another owner or no card.
    pub(crate) fn refused(&self) -> Vec<(SocketAddr, Arc<str>)> {
        let mut refused = Vec::new();
        if self.list == List::Refused {
            for &addr in &self.configured {
                refused.push((addr, Arc::from(self.what_it_is(addr))));
            }
        }
        let mut strangers: Vec<_> = self
            .strangers
            .iter()
            .map(|(&a, w)| (a, Arc::clone(w)))
            .collect();
        strangers.sort();
        refused.extend(strangers);
        refused
    }

    /// What `addr` answered, in words.
    fn what_it_is(&self, addr: SocketAddr) -> String {
        match self.answers.get(&addr) {
            Some(Answer::Card(owner)) => format!("it is {owner}"),
            Some(Answer::NoCard(why)) => format!("it {why}"),
            Some(Answer::Absent(why) | Answer::Failed(why)) => format!("not known ({why})"),
            Some(Answer::Asking) | None => "not known (not answered yet)".to_string(),
        }
    }

    fn lists(&self, owner: Owner, addr: SocketAddr) -> bool {
        self.listed
            .get(&owner)
            .is_some_and(|listed| listed.contains(&addr))
    }

    /// The list's state from the configured addresses' answers (a refused list stays so).
    fn decide(&mut self) {
        if self.list == List::Refused {
            return;
        }
        let mut owners: Vec<Owner> = Vec::new();
        for addr in &self.configured {
            match self.answers.get(addr) {
                Some(Answer::Card(owner)) if !owners.contains(owner) => owners.push(*owner),
                _ => {}
            }
        }
        let no_card =
            |addr: &&SocketAddr| matches!(self.answers.get(addr), Some(Answer::NoCard(_)));
        // A server without a card is an older build: it may be in the list only where the
        // cluster's cards list it (a member not upgraded yet).
        let foreign = match owners[..] {
            [owner] => (self.configured.iter().filter(no_card)).any(|a| !self.lists(owner, *a)),
            _ => false,
        };
        if foreign || owners.len() > 1 {
            let what: Vec<String> = (self.configured.iter())
                .filter(|addr| {
                    matches!(
                        self.answers.get(addr),
                        Some(Answer::Card(_) | Answer::NoCard(_))
                    )
                })
                .map(|addr| format!("{addr}: {}", self.what_it_is(*addr)))
                .collect();
            log::error!(
                "{NOT_ONE_CLUSTER} ({}): none of them is used; a client given several \
                 addresses takes only the members of one cluster (docs/cluster.md, \"What \
                 clients see\")",
                what.join("; ")
            );
            self.list = List::Refused;
            return;
        }
        let Some(&owner) = owners.first() else {
            // No card anywhere: when every listed server answered without one (or nothing
            // listens there), they are all of builds before cards, and cannot be checked.
            let old = |addr: &SocketAddr| {
                matches!(
                    self.answers.get(addr),
                    Some(Answer::NoCard(_) | Answer::Absent(_))
                )
            };
            let unchecked = self.configured.iter().all(old);
            if unchecked && self.configured.iter().any(|a| no_card(&a)) {
                if self.list == List::Unchecked {
                    return;
                }
                log::warn!(
                    "no listed server gives a card (GET /cluster): they are older builds, and \
                     the list cannot be checked to name one cluster; it is used as given"
                );
                self.list = List::Unchecked;
            }
            return;
        };
        let vouched = |addr: &SocketAddr| match self.answers.get(addr) {
            Some(Answer::Card(answered)) => *answered == owner,
            Some(Answer::Absent(_)) => true,
            _ => self.lists(owner, *addr),
        };
        if self.configured.iter().all(vouched) {
            self.list = List::Accepted(owner);
        }
    }

    /// An `M`-named address answered: refused alone if not the accepted list's owner's.
    fn stranger(&mut self, addr: SocketAddr) {
        let List::Accepted(owner) = self.list else {
            return;
        };
        let foreign = match self.answers.get(&addr) {
            Some(Answer::Card(answered)) => *answered != owner,
            Some(Answer::NoCard(_)) => !self.lists(owner, addr),
            _ => false,
        };
        if foreign {
            let why = format!(
                "{}, not {owner}: named in a redirect",
                self.what_it_is(addr)
            );
            log::error!("{addr} is not used: {why}");
            self.strangers.insert(addr, Arc::from(why));
        }
    }

    fn check_invariants(&self) {
        if !cfg!(debug_assertions) {
            return;
        }
        if let List::Accepted(owner) = self.list {
            for addr in &self.configured {
                let answer = self.answers.get(addr);
                let vouched = answer == Some(&Answer::Card(owner))
                    || matches!(
                        answer,
                        Some(Answer::Absent(_) | Answer::Asking | Answer::Failed(_))
                    )
                    || self.lists(owner, *addr);
                assert!(vouched, "{addr} in an accepted list answered {answer:?}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn member(cluster: u64, ports: &[u16]) -> Result<Card, FetchError> {
        Ok(Card::Member {
            cluster,
            member: 1,
            shards: 8,
            clients: ports.iter().map(|&p| (u64::from(p), addr(p))).collect(),
        })
    }

    fn standalone(instance: u64) -> Result<Card, FetchError> {
        Ok(Card::Standalone { instance })
    }

    fn refused_connect() -> Result<Card, FetchError> {
        Err(FetchError::Refused(
            "cannot connect: connection refused".into(),
        ))
    }

    fn timed_out() -> Result<Card, FetchError> {
        Err(FetchError::Unreachable(
            "no answer to GET /cluster in time".into(),
        ))
    }

    fn refused(verdict: Verdict) -> String {
        match verdict {
            Verdict::Refused(why) => why.to_string(),
            other => panic!("not refused: {other:?}"),
        }
    }

    fn unsettled(verdict: &Verdict) -> bool {
        matches!(verdict, Verdict::Unsettled { .. })
    }

    #[test]
    fn the_members_of_one_cluster_are_accepted_once_every_listed_address_is_vouched_for() {
        let mut check = Check::new(&[addr(1), addr(2), addr(3)]);
        check.asking(addr(1));
        check.asking(addr(2));
        check.asking(addr(3));
        check.answered(addr(1), member(7, &[1, 2]));
        assert!(unsettled(&check.verdict(addr(1))), "3 not vouched for yet");
        check.answered(addr(2), member(7, &[1, 2]));
        assert!(unsettled(&check.verdict(addr(1))));
        check.answered(addr(3), member(7, &[3]));
        for port in [1, 2, 3] {
            assert_eq!(check.verdict(addr(port)), Verdict::Accepted);
        }
        assert_eq!(check.accepted_mask(), 0b111);
        assert!(check.refused().is_empty());
        check.answered(addr(2), standalone(9));
        assert_eq!(
            check.accepted_mask(),
            0,
            "a refused list has nothing accepted"
        );
    }

    #[test]
    fn a_member_the_cards_list_or_where_nothing_listens_does_not_hold_the_list_back() {
        // 2 is paused (its ask times out) but a card lists it; 3 is down, listed by none.
        let mut check = Check::new(&[addr(1), addr(2), addr(3)]);
        check.answered(addr(2), timed_out());
        check.answered(addr(3), refused_connect());
        assert!(unsettled(&check.verdict(addr(1))));
        check.answered(addr(1), member(7, &[1, 2]));
        assert_eq!(check.verdict(addr(1)), Verdict::Accepted);
        assert_eq!(
            check.verdict(addr(2)),
            Verdict::Accepted,
            "the card lists it"
        );
        let Verdict::Unsettled { ask, refused, .. } = check.verdict(addr(3)) else {
            panic!("3 is asked again before use");
        };
        assert_eq!((ask, refused), (vec![addr(3)], true));
        check.answered(addr(3), member(7, &[3]));
        assert_eq!(check.verdict(addr(3)), Verdict::Accepted);
    }

    #[test]
    fn two_clusters_in_a_list_refuse_it_whichever_answers_first() {
        for first in [1, 2] {
            let second = 3 - first;
            let mut check = Check::new(&[addr(1), addr(2)]);
            check.answered(addr(first), member(u64::from(first), &[first]));
            check.answered(addr(second), member(u64::from(second), &[second]));
            let why = refused(check.verdict(addr(1)));
            assert!(
                why.starts_with("it is cluster 0000000000000001 (the listed"),
                "{why}"
            );
            let all = check.refused();
            assert_eq!(all.len(), 2);
            assert!(
                all[1].1.starts_with("it is cluster 0000000000000002"),
                "{all:?}"
            );
        }
    }

    #[test]
    fn a_standalone_server_beside_members_refuses_the_list_even_after_it_was_accepted() {
        let mut check = Check::new(&[addr(1), addr(2)]);
        check.answered(addr(1), standalone(5));
        check.answered(addr(2), member(7, &[2]));
        assert!(refused(check.verdict(addr(1))).contains("a standalone server"));
        assert!(refused(check.verdict(addr(2))).contains("not the members of one cluster"));

        // Accepted while nothing listened at 1; a standalone server there later refuses it.
        let mut check = Check::new(&[addr(1), addr(2)]);
        check.answered(addr(1), refused_connect());
        check.answered(addr(2), member(7, &[2]));
        assert_eq!(check.verdict(addr(2)), Verdict::Accepted);
        check.answered(addr(1), standalone(5));
        assert!(refused(check.verdict(addr(1))).contains("a standalone server"));
        assert!(refused(check.verdict(addr(2))).contains("not the members of one cluster"));
    }

    #[test]
    fn one_standalone_server_at_every_address_is_accepted_two_are_refused() {
        let mut check = Check::new(&[addr(1), addr(2), addr(3)]);
        check.answered(addr(1), standalone(5));
        check.answered(addr(3), refused_connect());
        assert!(unsettled(&check.verdict(addr(1))));
        check.answered(addr(2), standalone(5));
        assert_eq!(check.verdict(addr(1)), Verdict::Accepted);

        let mut check = Check::new(&[addr(1), addr(2)]);
        check.answered(addr(1), standalone(5));
        check.answered(addr(2), standalone(6));
        assert!(
            refused(check.verdict(addr(2))).contains("a standalone server (run 0000000000000006)")
        );
    }

    #[test]
    fn an_older_member_without_a_card_is_vouched_for_by_the_clusters_cards() {
        // A rolling upgrade: 1 and 3 are of builds before cards; 2's card lists them all.
        let mut check = Check::new(&[addr(1), addr(2), addr(3)]);
        let old = || Err(FetchError::NotACard("HTTP 404".to_string()));
        check.answered(addr(1), old());
        assert!(
            unsettled(&check.verdict(addr(1))),
            "pending: 2 and 3 not answered"
        );
        check.answered(addr(2), member(7, &[1, 2, 3]));
        check.answered(addr(3), old());
        for port in [1, 2, 3] {
            assert_eq!(check.verdict(addr(port)), Verdict::Accepted);
        }
        // Every listed server without a card: older builds, used as given.
        let mut check = Check::new(&[addr(1), addr(2), addr(3)]);
        check.answered(addr(1), old());
        check.answered(addr(2), refused_connect());
        assert!(unsettled(&check.verdict(addr(1))));
        check.answered(addr(3), old());
        assert_eq!(check.verdict(addr(1)), Verdict::Accepted);
        let Verdict::Unsettled {
            ask, refused: none, ..
        } = check.verdict(addr(2))
        else {
            panic!("where nothing listened is asked first");
        };
        assert_eq!((ask, none), (vec![addr(2)], true));
        // A server of this build there, whose cards do not list the older ones: refused.
        check.answered(addr(2), member(7, &[2]));
        assert!(refused(check.verdict(addr(1))).contains("HTTP 404"));
    }

    #[test]
    fn a_server_without_a_card_refuses_the_list() {
        let mut check = Check::new(&[addr(1), addr(2)]);
        check.answered(addr(2), member(7, &[2]));
        check.answered(addr(1), Err(FetchError::NotACard("HTTP 404".to_string())));
        assert!(refused(check.verdict(addr(1))).contains("HTTP 404"));
        assert!(refused(check.verdict(addr(2))).starts_with("it is cluster"));
    }

    #[test]
    fn a_pending_list_asks_what_it_lacks_and_says_nothing_listens_anywhere() {
        let mut check = Check::new(&[addr(1), addr(2)]);
        let Verdict::Unsettled { ask, waiting, .. } = check.verdict(addr(1)) else {
            panic!("pending");
        };
        assert_eq!((ask, waiting), (vec![addr(1), addr(2)], false));
        check.asking(addr(1));
        check.asking(addr(2));
        assert!(!check.settled());
        assert!(matches!(
            check.verdict(addr(1)),
            Verdict::Unsettled { waiting: true, .. }
        ));
        check.answered(addr(1), refused_connect());
        check.answered(addr(2), refused_connect());
        assert!(check.settled());
        let Verdict::Unsettled {
            waiting,
            refused,
            why,
            ..
        } = check.verdict(addr(2))
        else {
            panic!("pending");
        };
        assert!(!waiting && refused, "nothing listens: {why}");
    }

    #[test]
    fn a_redirect_to_a_listed_member_is_accepted_at_once_and_a_foreign_one_refused_alone() {
        let mut check = Check::new(&[addr(1), addr(2)]);
        check.answered(addr(1), member(7, &[1, 2, 3]));
        check.answered(addr(2), member(7, &[1, 2, 3]));
        assert_eq!(check.verdict(addr(3)), Verdict::Accepted);
        assert!(
            matches!(check.verdict(addr(4)), Verdict::Unsettled { .. }),
            "asked first"
        );
        check.answered(addr(4), standalone(1));
        assert!(refused(check.verdict(addr(4))).contains("redirect"));
        assert_eq!(check.verdict(addr(1)), Verdict::Accepted, "the list stands");
        assert_eq!(check.refused().len(), 1);
    }
}
