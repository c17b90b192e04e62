//! The simulation's safety checks: one leader per (shard, term), one global log per shard
//! that every member's applied sequence is a prefix of, proposals acknowledged only at the
//! position they were given, snapshots that match the log.

use latchkey::cluster::member::{Committed, EntryKind, Proposed};
use std::collections::BTreeMap;

/// The state machine of one shard on one member: what it applied, as an index and a hash
/// of every (index, term, data) applied in order.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Machine {
    pub applied: u64,
    pub hash: u64,
}

impl Machine {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = self.applied.to_le_bytes().to_vec();
        out.extend_from_slice(&self.hash.to_le_bytes());
        out
    }

    pub fn decode(data: &[u8]) -> Option<Machine> {
        let applied = u64::from_le_bytes(data.get(0..8)?.try_into().ok()?);
        let hash = u64::from_le_bytes(data.get(8..16)?.try_into().ok()?);
        (data.len() == 16).then_some(Machine { applied, hash })
    }
}

fn mix(hash: u64, index: u64, term: u64, data: &[u8]) -> u64 {
    let mut h = hash ^ 0xcbf2_9ce4_8422_2325;
    for byte in index
        .to_le_bytes()
        .iter()
        .chain(term.to_le_bytes().iter())
        .chain(data.iter())
    {
        h ^= u64::from(*byte);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A committed entry of the global log.
struct Slot {
    term: u64,
    data: Vec<u8>,
    hash: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fate {
    Pending,
    Acked,
    Lost,
}

struct Proposal {
    shard: u32,
    at: Proposed,
    fate: Fate,
}

/// Everything checked across members, and the violations found.
#[derive(Default)]
pub struct Checker {
    leaders: BTreeMap<(u32, u64), u64>,
    logs: BTreeMap<u32, BTreeMap<u64, Slot>>,
    proposals: BTreeMap<u64, Proposal>,
    by_position: BTreeMap<(u32, u64), Vec<u64>>,
    applied_at: BTreeMap<u64, (u32, u64)>,
    /// Proposal id → time acknowledged.
    pub acked_at: BTreeMap<u64, u64>,
    /// Proposal id → time proposed.
    pub proposed_at: BTreeMap<u64, u64>,
    pub violations: Vec<String>,
    pub acked: u64,
    pub lost: u64,
}

impl Checker {
    fn violation(&mut self, now: u64, what: String) {
        if self.violations.len() < 20 {
            self.violations.push(format!("at {now} ms: {what}"));
        }
    }

    /// Member `id` claims to lead `shard` in `term`.
    pub fn leader(&mut self, now: u64, shard: u32, term: u64, id: u64) {
        let known = *self.leaders.entry((shard, term)).or_insert(id);
        if known != id {
            self.violation(
                now,
                format!("shard {shard} term {term}: leaders {known} and {id}"),
            );
        }
    }

    pub fn proposed(&mut self, id: u64, shard: u32, at: Proposed) {
        let fate = Fate::Pending;
        self.proposals.insert(id, Proposal { shard, at, fate });
        self.by_position
            .entry((shard, at.index))
            .or_default()
            .push(id);
    }

    pub fn note_proposed_at(&mut self, id: u64, now: u64) {
        self.proposed_at.insert(id, now);
    }

    /// Member `node` applies `entry` to `machine`.
    pub fn apply(&mut self, now: u64, node: u64, machine: &mut Machine, entry: &Committed) {
        let shard = entry.shard;
        if entry.index != machine.applied + 1 {
            let what = format!(
                "member {node} shard {shard}: applies {} after {}",
                entry.index, machine.applied
            );
            self.violation(now, what);
        }
        let data: &[u8] = if entry.kind == EntryKind::Command {
            &entry.data
        } else {
            &[]
        };
        let hash = mix(machine.hash, entry.index, entry.term, data);
        *machine = Machine {
            applied: entry.index,
            hash,
        };
        let log = self.logs.entry(shard).or_default();
        match log.get(&entry.index) {
            Some(slot) if slot.term != entry.term || slot.data != data || slot.hash != hash => {
                let what = format!(
                    "member {node} shard {shard} index {}: term {} differs from the log's {} \
                     (or its data or history)",
                    entry.index, entry.term, slot.term
                );
                self.violation(now, what);
            }
            Some(_) => {}
            None => {
                let slot = Slot {
                    term: entry.term,
                    data: data.to_vec(),
                    hash,
                };
                log.insert(entry.index, slot);
                self.first_commit(now, entry);
            }
        }
    }

    /// The first time an entry is seen committed: settle the proposals for its position.
    fn first_commit(&mut self, now: u64, entry: &Committed) {
        let shard = entry.shard;
        let id = (entry.kind == EntryKind::Command && entry.data.len() >= 8)
            .then(|| u64::from_le_bytes(entry.data[..8].try_into().unwrap_or_default()));
        if let Some(id) = id {
            if let Some(previous) = self.applied_at.insert(id, (shard, entry.index)) {
                let what = format!(
                    "proposal {id} committed at {previous:?} and {}",
                    entry.index
                );
                self.violation(now, what);
            }
            match self.proposals.get(&id) {
                Some(p)
                    if p.shard != shard || p.at.index != entry.index || p.at.term != entry.term =>
                {
                    let what = format!(
                        "proposal {id} given {:?} committed at {}",
                        p.at, entry.index
                    );
                    self.violation(now, what);
                }
                Some(_) => {}
                None => self.violation(now, format!("unknown proposal {id} committed")),
            }
        }
        let waiting = self
            .by_position
            .remove(&(shard, entry.index))
            .unwrap_or_default();
        for waiting_id in waiting {
            let Some(proposal) = self.proposals.get_mut(&waiting_id) else {
                continue;
            };
            if proposal.at.term == entry.term && id == Some(waiting_id) {
                proposal.fate = Fate::Acked;
                self.acked += 1;
                self.acked_at.insert(waiting_id, now);
            } else if proposal.at.term == entry.term {
                let what = format!("proposal {waiting_id} acknowledged with another entry's data");
                self.violation(now, what);
            } else {
                proposal.fate = Fate::Lost;
                self.lost += 1;
            }
        }
    }

    /// Member `node` replaces `machine` with snapshot `data` at `index`.
    pub fn restore(
        &mut self,
        now: u64,
        node: u64,
        machine: &mut Machine,
        shard: u32,
        index: u64,
        data: &[u8],
    ) {
        let Some(restored) = Machine::decode(data) else {
            return self.violation(now, format!("member {node} shard {shard}: bad snapshot"));
        };
        let matches = self
            .logs
            .get(&shard)
            .and_then(|log| log.get(&index))
            .is_some_and(|slot| slot.hash == restored.hash);
        if restored.applied != index || !matches {
            let what = format!("member {node} shard {shard}: snapshot at {index} not the log's");
            self.violation(now, what);
        }
        *machine = restored;
    }

    /// The length of `shard`'s global log.
    pub fn log_len(&self, shard: u32) -> u64 {
        self.logs
            .get(&shard)
            .and_then(|log| log.keys().last().copied())
            .unwrap_or(0)
    }
}
