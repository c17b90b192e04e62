//! Which of a client's addresses it may send lock requests to, from their cards (`card.rs`):
//! a client given several addresses takes only members of one cluster, so that no list that
//! mixes clusters, or a cluster and a standalone server, can make two holders of one key.
//!
//! The rules, for a client given more than one address (one address is never asked):
//! * The first member card any address answers fixes the cluster; an address is accepted once
//!   it answers a card of that cluster (two addresses of one member are fine).
//! * An address that answers another cluster's card, a standalone server's card, or no card at
//!   all (not latchkey, or a build before cards) is refused for the client's life, with a
//!   message naming it and what it is.
//! * A standalone server is accepted only when every listed address answered that same server
//!   (one server reached by several addresses, e.g. a name with an IPv4 and an IPv6 address):
//!   until then it is not used.
//! * An address a member named in a redirect (`M`) is accepted at once when the cluster's card
//!   lists it, else asked like a listed one.
//! * An address that could not be asked is asked again when a call next needs it.
//!
//! Sans-IO: [`Check`] takes answers and says verdicts; `members.rs` asks (one thread per ask).
//! Invariant: every accepted address answered the fixed owner's card, or that card lists it.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use super::card::{Card, FetchError, Owner};

/// What a client may do with an address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Its card is being asked for.
    Asking,
    /// Not known yet (never asked, or the last ask failed): asked when a call needs it; this
    /// says why it is not usable yet.
    Unknown(Arc<str>),
    /// A standalone server that waits for the other addresses to answer as the same server
    /// (asking it again would not help); this says so.
    Waiting(Arc<str>),
    /// A member of the client's cluster (or its one standalone server): usable.
    Accepted,
    /// Never used: why.
    Refused(Arc<str>),
}

/// The addresses' verdicts, and the owner they must share.
pub(crate) struct Check {
    configured: Vec<SocketAddr>,
    /// The owner the accepted addresses answered, the card that fixed it and who answered it.
    fixed: Option<(Owner, Card, SocketAddr)>,
    verdicts: HashMap<SocketAddr, Verdict>,
    /// Whom each address that answered a card said it speaks for.
    owners: HashMap<SocketAddr, Owner>,
}

impl Check {
    /// A check of `configured` (distinct; more than one), none of them asked yet.
    pub(crate) fn new(configured: &[SocketAddr]) -> Check {
        Check {
            configured: configured.to_vec(),
            fixed: None,
            verdicts: HashMap::new(),
            owners: HashMap::new(),
        }
    }

    /// The verdict on `addr`: a learned address its cluster's card lists is accepted.
    pub(crate) fn verdict(&mut self, addr: SocketAddr) -> Verdict {
        if let Some(verdict) = self.verdicts.get(&addr) {
            return verdict.clone();
        }
        let listed = matches!(&self.fixed, Some((_, card, _)) if card.lists(addr));
        if listed && !self.configured.contains(&addr) {
            self.verdicts.insert(addr, Verdict::Accepted);
            return Verdict::Accepted;
        }
        Verdict::Unknown(Arc::from("not asked yet"))
    }

    /// `addr` is being asked.
    pub(crate) fn asking(&mut self, addr: SocketAddr) {
        self.verdicts.insert(addr, Verdict::Asking);
    }

    /// Whether every configured address has a verdict other than [`Verdict::Asking`].
    pub(crate) fn settled(&self) -> bool {
        !self
            .verdicts
            .values()
            .any(|verdict| *verdict == Verdict::Asking)
    }

    /// The refused addresses and why, configured first, each once.
    pub(crate) fn refused(&self) -> Vec<(SocketAddr, Arc<str>)> {
        let mut refused: Vec<(SocketAddr, Arc<str>)> = self
            .verdicts
            .iter()
            .filter_map(|(&addr, verdict)| match verdict {
                Verdict::Refused(why) => Some((addr, Arc::clone(why))),
                _ => None,
            })
            .collect();
        let rank = |addr: &SocketAddr| self.configured.iter().position(|a| a == addr);
        refused.sort_by_key(|(addr, _)| (rank(addr).unwrap_or(usize::MAX), *addr));
        refused
    }

    /// What the ask of `addr` found; returns the new verdict.
    pub(crate) fn answered(
        &mut self,
        addr: SocketAddr,
        answer: Result<Card, FetchError>,
    ) -> Verdict {
        let verdict = match answer {
            Err(FetchError::Unreachable(cause)) => Verdict::Unknown(Arc::from(cause)),
            Err(error @ FetchError::NotACard(_)) => self.refuse(addr, error.to_string()),
            Ok(card) => self.card(addr, card),
        };
        self.verdicts.insert(addr, verdict.clone());
        self.check_invariants();
        verdict
    }

    fn card(&mut self, addr: SocketAddr, card: Card) -> Verdict {
        let owner = card.owner();
        let learned = !self.configured.contains(&addr);
        if learned && matches!(owner, Owner::Standalone(_)) {
            return self.refuse(addr, format!("it is {owner}, named in a redirect"));
        }
        self.owners.insert(addr, owner);
        match &self.fixed {
            Some((fixed, _, _)) if *fixed == owner => return Verdict::Accepted,
            Some((fixed, _, by)) => {
                let by = *by;
                return self.refuse(addr, format!("it is {owner}, not {fixed} like {by}"));
            }
            None => {}
        }
        if let Owner::Standalone(_) = owner {
            let other = self.owners.iter().find(|(_, &o)| o != owner);
            if let Some((&other, _)) = other {
                let why = format!("it is {owner}, and {other} is another standalone server");
                return self.refuse(addr, why);
            }
            if self.owners.len() < self.configured.len() {
                let why = "a standalone server: used only once every listed address answered \
                           as that same server";
                return Verdict::Waiting(Arc::from(why));
            }
            for &other in &self.configured {
                self.verdicts.insert(other, Verdict::Accepted);
            }
            self.fixed = Some((owner, card, addr));
            return Verdict::Accepted;
        }
        // The first member card fixes the cluster; standalone servers seen so far are refused.
        self.fixed = Some((owner, card, addr));
        let standalone: Vec<(SocketAddr, Owner)> = (self.owners.iter())
            .filter(|(_, &other)| other != owner)
            .map(|(&addr, &other)| (addr, other))
            .collect();
        for (other, other_owner) in standalone {
            let why = format!("it is {other_owner}, not {owner} like {addr}");
            let refused = self.refuse(other, why);
            self.verdicts.insert(other, refused);
        }
        Verdict::Accepted
    }

    fn refuse(&self, addr: SocketAddr, why: String) -> Verdict {
        log::error!(
            "{addr} is not used: {why}; a client given several addresses takes only the \
             members of one cluster (docs/cluster.md, \"Clients\")"
        );
        Verdict::Refused(Arc::from(why))
    }

    fn check_invariants(&self) {
        if !cfg!(debug_assertions) {
            return;
        }
        for (addr, verdict) in &self.verdicts {
            if *verdict != Verdict::Accepted {
                continue;
            }
            let (owner, card, _) = self
                .fixed
                .as_ref()
                .expect("an accepted address has an owner");
            assert!(
                self.owners.get(addr) == Some(owner) || card.lists(*addr),
                "{addr} accepted without its owner's card"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr(port: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], port))
    }

    fn member(cluster: u64, id: u64, ports: &[u16]) -> Result<Card, FetchError> {
        let clients = ports.iter().enumerate();
        Ok(Card::Member {
            cluster,
            member: id,
            shards: 8,
            clients: clients.map(|(i, &p)| (i as u64 + 1, addr(p))).collect(),
        })
    }

    fn standalone(instance: u64) -> Result<Card, FetchError> {
        Ok(Card::Standalone { instance })
    }

    fn refused(verdict: Verdict) -> String {
        match verdict {
            Verdict::Refused(why) => why.to_string(),
            other => panic!("not refused: {other:?}"),
        }
    }

    #[test]
    fn members_of_one_cluster_are_accepted_and_another_clusters_refused() {
        let mut check = Check::new(&[addr(1), addr(2), addr(3)]);
        assert_eq!(
            check.answered(addr(2), member(7, 2, &[1, 2])),
            Verdict::Accepted
        );
        assert_eq!(
            check.answered(addr(1), member(7, 1, &[1, 2])),
            Verdict::Accepted
        );
        let why = refused(check.answered(addr(3), member(8, 1, &[3])));
        assert!(
            why.contains("cluster 0000000000000008, not cluster 0000000000000007"),
            "{why}"
        );
        assert!(why.contains("127.0.0.1:2"), "{why}");
        assert_eq!(check.refused().len(), 1);
        assert_eq!(check.refused()[0].0, addr(3));
    }

    #[test]
    fn a_standalone_server_in_a_list_with_members_is_refused_whoever_answers_first() {
        let mut check = Check::new(&[addr(1), addr(2)]);
        let first = check.answered(addr(1), standalone(5));
        assert!(
            matches!(first, Verdict::Waiting(_)),
            "waits for the others: {first:?}"
        );
        assert_eq!(
            check.answered(addr(2), member(7, 1, &[2])),
            Verdict::Accepted
        );
        assert!(refused(check.verdict(addr(1))).contains("standalone"));

        let mut check = Check::new(&[addr(1), addr(2)]);
        assert_eq!(
            check.answered(addr(2), member(7, 1, &[2])),
            Verdict::Accepted
        );
        assert!(refused(check.answered(addr(1), standalone(5))).contains("standalone"));
    }

    #[test]
    fn one_standalone_server_at_every_address_is_accepted_two_are_refused() {
        let mut check = Check::new(&[addr(1), addr(2)]);
        assert!(matches!(
            check.answered(addr(1), standalone(5)),
            Verdict::Waiting(_)
        ));
        assert_eq!(check.answered(addr(2), standalone(5)), Verdict::Accepted);
        assert_eq!(check.verdict(addr(1)), Verdict::Accepted);

        let mut check = Check::new(&[addr(1), addr(2)]);
        assert!(matches!(
            check.answered(addr(1), standalone(5)),
            Verdict::Waiting(_)
        ));
        assert!(refused(check.answered(addr(2), standalone(6))).contains("another standalone"));
    }

    #[test]
    fn no_card_is_refused_and_an_unreachable_address_asked_again() {
        let mut check = Check::new(&[addr(1), addr(2)]);
        let old = Err(FetchError::NotACard("HTTP 404".to_string()));
        assert!(refused(check.answered(addr(1), old)).contains("HTTP 404"));
        let down = Err(FetchError::Unreachable("refused".to_string()));
        assert!(matches!(check.answered(addr(2), down), Verdict::Unknown(_)));
        check.asking(addr(2));
        assert!(!check.settled());
        assert_eq!(
            check.answered(addr(2), member(7, 1, &[2])),
            Verdict::Accepted
        );
        assert!(check.settled());
    }

    #[test]
    fn a_redirect_to_a_listed_member_is_accepted_at_once_and_others_are_asked() {
        let mut check = Check::new(&[addr(1), addr(2)]);
        assert!(matches!(check.verdict(addr(3)), Verdict::Unknown(_)));
        assert_eq!(
            check.answered(addr(1), member(7, 1, &[1, 3])),
            Verdict::Accepted
        );
        assert_eq!(check.verdict(addr(3)), Verdict::Accepted);
        assert!(matches!(check.verdict(addr(4)), Verdict::Unknown(_)));
        assert!(
            matches!(check.verdict(addr(2)), Verdict::Unknown(_)),
            "listed: asked"
        );
        assert!(refused(check.answered(addr(4), standalone(1))).contains("redirect"));
    }
}
