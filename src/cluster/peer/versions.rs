//! Each peer's last known wire version, and the *cluster version*: the lowest wire version any
//! member speaks, which says what a leader may propose (a shard command that changes the log is
//! proposed only once every member can apply it). No I/O.
//!
//! A peer's last known version is [`frame::VERSION_MIN`] until this member hears from it; then
//! the version of the last hello of it that this member accepted (inbound), or of the last
//! reply of it that accepted this member's hello (outbound), whichever came last. It is kept
//! when the peer's connections close: a member that is down keeps its last known version (it
//! comes back as the build it was, or says otherwise in its next hello or reply). The cluster
//! version is the lowest of this member's [`frame::VERSION`] and every peer's last known one
//! ([`cluster_version`]): the oldest until every member was heard from in a newer one.
//!
//! The peer thread, which checks every hello and reads every reply, notes the versions; any
//! thread reads them without a lock (one relaxed load per peer), so a core may ask on every
//! loop iteration ([`super::PeerHandle::cluster_version`]).
//!
//! # Invariants
//!
//! Every version kept is one this build [`frame::speaks`] (only a hello or reply that decoded
//! is noted), so the cluster version is one too.
//!
//! Deliberately not here: the negotiation (`frame.rs`, `link.rs`), and what a version allows
//! (the shard commands' home decides, asking the cluster version).

use super::frame;
use std::sync::atomic::{AtomicU8, Ordering};

/// The cluster version of a member that speaks up to [`frame::VERSION`] and whose peers were
/// last known to speak `peers`: the lowest of them all. The one home of that rule.
pub(crate) fn cluster_version(peers: impl IntoIterator<Item = u8>) -> u8 {
    peers.into_iter().fold(frame::VERSION, u8::min)
}

/// Each peer's last known wire version, in the links' order (see the module docs).
#[derive(Debug)]
pub(crate) struct Versions {
    known: Box<[AtomicU8]>,
}

impl Versions {
    /// `peers` peers, none heard from: each at [`frame::VERSION_MIN`].
    pub(crate) fn new(peers: usize) -> Versions {
        let known = (0..peers)
            .map(|_| AtomicU8::new(frame::VERSION_MIN))
            .collect();
        Versions { known }
    }

    /// Peer `index` was heard from in `version` (a hello accepted, or a reply that accepted).
    pub(crate) fn note(&self, index: usize, version: u8) {
        debug_assert!(frame::speaks(version), "version {version} noted");
        if let Some(known) = self.known.get(index) {
            known.store(version, Ordering::Relaxed);
        }
    }

    /// Peer `index`'s last known version.
    pub(crate) fn of(&self, index: usize) -> u8 {
        (self.known.get(index)).map_or(frame::VERSION_MIN, |known| known.load(Ordering::Relaxed))
    }

    /// The cluster version now ([`cluster_version`] of every peer's last known version).
    pub(crate) fn cluster_version(&self) -> u8 {
        cluster_version(self.known.iter().map(|known| known.load(Ordering::Relaxed)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::peer::frame::{VERSION, VERSION_MIN};

    #[test]
    fn the_cluster_version_is_the_oldest_until_every_peer_was_heard_in_a_newer_one() {
        assert_eq!(
            cluster_version([]),
            VERSION,
            "a member alone speaks its newest"
        );
        let versions = Versions::new(2);
        assert_eq!(
            versions.cluster_version(),
            VERSION_MIN,
            "nobody heard from yet"
        );
        versions.note(0, VERSION);
        assert_eq!((versions.of(0), versions.of(1)), (VERSION, VERSION_MIN));
        assert_eq!(
            versions.cluster_version(),
            VERSION_MIN,
            "peer 1 not heard from"
        );
        versions.note(1, VERSION);
        assert_eq!(versions.cluster_version(), VERSION);
        // A peer heard from later in an older version (rolled back) lowers it again.
        versions.note(0, VERSION_MIN);
        assert_eq!(versions.cluster_version(), VERSION_MIN);
        assert_eq!(versions.of(9), VERSION_MIN, "no such peer: the oldest");
    }
}
