//! Unit tests of [`Member`] over [`MemWriter`]s, with messages passed directly and the
//! writers' completions coming after the messages of the iteration that handed the batch over.

use super::*;
use crate::cluster::mem_durable::MemDurable;
use crate::cluster::mem_writer::MemWriter;
use raft::eraftpb::{ConfState, Entry};
use raft::StateRole;

const VOTERS: [u64; 3] = [1, 2, 3];

fn member(id: u64) -> Member<MemWriter> {
    let writer = MemWriter::new(MemDurable::new());
    Member::new(id, &VOTERS, &[0, 1], writer, Vec::new(), 7).expect("member")
}

/// Three members; messages are delivered at once, writers complete after each exchange.
struct Trio {
    members: Vec<Member<MemWriter>>,
    committed: Vec<Vec<Committed>>,
    restores: Vec<Vec<Restore>>,
    reads: Vec<ReadReady>,
    /// The bytes of entries (data and context) of every append delivered, in order.
    append_bytes: Vec<usize>,
}

impl Trio {
    fn new() -> Trio {
        Trio {
            members: VOTERS.iter().map(|id| member(*id)).collect(),
            committed: vec![Vec::new(); 3],
            restores: vec![Vec::new(); 3],
            reads: Vec::new(),
            append_bytes: Vec::new(),
        }
    }

    /// Drains every member, delivers the messages, then lets every writer complete, until
    /// quiet (bounded).
    fn pump(&mut self) {
        self.pump_cut(None);
    }

    /// [`Self::pump`], with every message to or from member `cut` (a position) lost.
    fn pump_cut(&mut self, cut: Option<usize>) {
        for _ in 0..100 {
            let mut mail = Vec::new();
            for (at, member) in self.members.iter_mut().enumerate() {
                let drain = member.drain().expect("drain");
                mail.extend(drain.messages);
                self.restores[at].extend(drain.restores);
                self.committed[at].extend(drain.committed);
                self.reads.extend(drain.reads);
            }
            let queued = self.members.iter().any(|m| m.writer().queued() > 0);
            if mail.is_empty() && !queued {
                return;
            }
            for Envelope { shard, message } in mail {
                let (from, to) = ((message.from - 1) as usize, (message.to - 1) as usize);
                if cut == Some(from) || cut == Some(to) {
                    continue;
                }
                if message.get_msg_type() == MessageType::MsgAppend {
                    let bytes = drain::entry_bytes(message.get_entries());
                    self.append_bytes.push(bytes);
                }
                let _ = self.members[to].step(shard, message);
            }
            for member in &mut self.members {
                member.writer_mut().complete();
            }
        }
        panic!("the trio never went quiet");
    }

    /// Ticks until shard 0 has a leader; returns its position.
    fn elect(&mut self) -> usize {
        for _ in 0..100 {
            for member in &mut self.members {
                member.tick();
            }
            self.pump();
            let leader = self
                .members
                .iter()
                .position(|m| m.leader(0) == Some(m.id()));
            if let Some(at) = leader {
                return at;
            }
        }
        panic!("no leader after 100 ticks");
    }
}

#[test]
fn new_refuses_a_non_voter_and_duplicate_shards() {
    let writer = || MemWriter::new(MemDurable::new());
    assert!(Member::new(4, &VOTERS, &[0], writer(), Vec::new(), 1).is_err());
    assert!(Member::new(1, &VOTERS, &[0, 0], writer(), Vec::new(), 1).is_err());
}

#[test]
fn step_refuses_strangers_unknown_shards_and_local_or_foreign_messages() {
    let mut one = member(1);
    let mut message = Message {
        from: 2,
        to: 1,
        term: 1,
        ..Default::default()
    };
    message.set_msg_type(MessageType::MsgHeartbeat);
    assert!(matches!(
        one.step(9, message.clone()),
        Err(StepError::UnknownShard(9))
    ));
    let mut stranger = message.clone();
    stranger.from = 4;
    assert!(matches!(
        one.step(0, stranger),
        Err(StepError::Stranger { .. })
    ));
    let mut local = message.clone();
    local.set_msg_type(MessageType::MsgHup);
    assert!(matches!(one.step(0, local), Err(StepError::Invalid(_))));
    let mut snapshot = message.clone();
    snapshot.set_msg_type(MessageType::MsgSnapshot);
    let metadata = snapshot.mut_snapshot().mut_metadata();
    metadata.index = 5;
    metadata.term = 1;
    metadata.set_conf_state(ConfState::from((vec![1, 2], vec![])));
    assert!(matches!(one.step(0, snapshot), Err(StepError::Invalid(_))));
    let mut beyond = message;
    beyond.commit = 50;
    assert!(matches!(one.step(0, beyond), Err(StepError::Invalid(_))));
    one.check_invariants();
}

#[test]
fn an_append_whose_entries_skip_or_repeat_an_index_is_refused_not_a_panic() {
    let mut one = member(1);
    let append = |index: u64, indices: &[u64]| {
        let mut message = Message {
            from: 2,
            to: 1,
            term: 1,
            index,
            ..Default::default()
        };
        message.set_msg_type(MessageType::MsgAppend);
        for &at in indices {
            let entry = raft::eraftpb::Entry {
                index: at,
                term: 1,
                ..Default::default()
            };
            message.mut_entries().push(entry);
        }
        message
    };
    // raft-rs would slice the entries at `conflict - (index + 1)`: out of range for a gap.
    for (index, indices) in [(0, vec![5]), (0, vec![1, 3]), (2, vec![3, 3]), (4, vec![2])] {
        let refused = one.step(0, append(index, &indices));
        assert!(
            matches!(refused, Err(StepError::Invalid(_))),
            "{indices:?}: {refused:?}"
        );
    }
    let huge = append(u64::MAX - 1, &[u64::MAX]);
    assert!(matches!(one.step(0, huge), Err(StepError::Invalid(_))));
    // Entries that follow their index are taken.
    one.step(0, append(0, &[1, 2]))
        .expect("a well-formed append");
    one.check_invariants();
}

#[test]
fn a_proposal_commits_everywhere_at_the_index_and_term_given() {
    let mut trio = Trio::new();
    let leader = trio.elect();
    let follower = (leader + 1) % 3;
    let refused = trio.members[follower].propose(0, b"no".to_vec());
    assert_eq!(
        refused,
        Err(NotLeader {
            hint: Some(leader as u64 + 1)
        })
    );
    let at = trio.members[leader]
        .propose(0, b"hello".to_vec())
        .expect("propose");
    assert_eq!(at.term, trio.members[leader].term(0));
    trio.pump();
    assert_eq!(
        trio.members[leader].applied(0),
        at.index,
        "the leader applies"
    );
    // Followers learn the commit from the leader's next heartbeat (no append only to say so).
    assert!(trio.members[follower].applied(0) < at.index);
    for _ in 0..crate::cluster::member::HEARTBEAT_TICKS {
        trio.members[leader].tick();
    }
    trio.pump();
    for (position, committed) in trio.committed.iter().enumerate() {
        let found = committed
            .iter()
            .find(|c| c.shard == 0 && c.index == at.index);
        let entry = found.unwrap_or_else(|| panic!("member {position} lacks {at:?}"));
        assert_eq!((entry.term, entry.kind), (at.term, EntryKind::Command));
        assert_eq!(entry.data, &b"hello"[..]);
        let indexes: Vec<u64> = committed
            .iter()
            .filter(|c| c.shard == 0)
            .map(|c| c.index)
            .collect();
        assert_eq!(
            indexes,
            (1..=at.index).collect::<Vec<_>>(),
            "in order, once each"
        );
        assert_eq!(trio.members[position].applied(0), at.index);
    }
    assert_eq!(trio.members[leader].role(0), Some(StateRole::Leader));
}

/// An append of `count` entries of `each` bytes, after index 10 of term 2.
fn append_of(count: u64, each: usize) -> Message {
    let mut message = Message::default();
    message.set_msg_type(MessageType::MsgAppend);
    (message.to, message.from, message.term) = (2, 1, 3);
    (message.index, message.log_term, message.commit) = (10, 2, 9);
    let entries: Vec<Entry> = (11..11 + count)
        .map(|index| {
            let mut entry = Entry::default();
            (entry.index, entry.term) = (index, if index < 15 { 2 } else { 3 });
            entry.data = vec![index as u8; each].into();
            entry
        })
        .collect();
    message.set_entries(entries.into());
    message
}

fn split(message: Message) -> Vec<Message> {
    let mut out = Vec::new();
    drain::split_append(message, &mut |part| out.push(part));
    out
}

#[test]
fn an_append_over_the_message_size_is_cut_into_appends_that_follow_each_other() {
    let limit = MESSAGE_BYTES_MAX as usize;
    // Small enough: as it is.
    let small = append_of(3, 1000);
    assert_eq!(split(small.clone()), vec![small]);
    // 12 entries of 300 KiB: three per part (a fourth would pass 1 MiB).
    let whole = append_of(12, 300 << 10);
    let parts = split(whole.clone());
    assert_eq!(parts.len(), 4);
    let (mut index, mut log_term) = (whole.index, whole.log_term);
    let mut entries = Vec::new();
    for part in &parts {
        assert_eq!(
            (part.index, part.log_term),
            (index, log_term),
            "follows the last part"
        );
        assert_eq!(
            (
                part.to,
                part.from,
                part.term,
                part.commit,
                part.get_msg_type()
            ),
            (2, 1, 3, 9, MessageType::MsgAppend)
        );
        let bytes = drain::entry_bytes(part.get_entries());
        assert!(
            !part.get_entries().is_empty() && bytes <= limit,
            "{bytes} bytes"
        );
        let last = part.get_entries().last().expect("entries");
        (index, log_term) = (last.index, last.term);
        entries.extend_from_slice(part.get_entries());
    }
    assert_eq!(entries, whole.get_entries(), "every entry once, in order");
    // One entry larger than the limit goes alone; so does anything not an append.
    let parts = split(append_of(3, limit));
    assert_eq!(
        parts
            .iter()
            .map(|p| p.get_entries().len())
            .collect::<Vec<_>>(),
        [1, 1, 1]
    );
    let mut heartbeat = append_of(0, 0);
    heartbeat.set_msg_type(MessageType::MsgHeartbeat);
    assert_eq!(split(heartbeat.clone()), vec![heartbeat]);
}

/// With `batch_append`, raft-rs catches a follower up with one append holding everything up to
/// its in-flight window; the drain cuts it back to the message size.
#[test]
fn a_follower_catching_up_gets_appends_no_larger_than_the_message_size() {
    let mut trio = Trio::new();
    let leader = trio.elect();
    let behind = (leader + 1) % 3;
    let mut last = 0;
    for n in 0..12u8 {
        let at = trio.members[leader]
            .propose(0, vec![n; 400 << 10])
            .expect("propose");
        last = at.index;
        trio.pump_cut(Some(behind));
    }
    assert!(trio.members[behind].applied(0) < last);
    trio.append_bytes.clear();
    for _ in 0..20 {
        for member in &mut trio.members {
            member.tick();
        }
        trio.pump();
    }
    let committed: Vec<u64> = trio.committed[behind].iter().map(|c| c.index).collect();
    assert!(committed.contains(&last), "caught up: {committed:?}");
    let largest = trio.append_bytes.iter().max().copied().unwrap_or(0);
    assert!(
        largest <= MESSAGE_BYTES_MAX as usize,
        "an append of {largest} bytes of entries"
    );
    assert!(
        largest >= 2 * (400 << 10),
        "appends carried several entries: {largest}"
    );
}

#[test]
fn read_index_comes_back_with_the_commit_index() {
    let mut trio = Trio::new();
    let leader = trio.elect();
    let at = trio.members[leader]
        .propose(0, b"x".to_vec())
        .expect("propose");
    trio.pump();
    trio.members[leader]
        .read_index(0, b"r1".to_vec())
        .expect("read");
    trio.pump();
    let read = trio
        .reads
        .iter()
        .find(|r| r.context == b"r1")
        .expect("a read result");
    assert_eq!((read.shard, read.index), (0, at.index));
}

#[test]
fn a_compacted_member_restarts_from_its_snapshot() {
    let mut trio = Trio::new();
    let leader = trio.elect();
    for n in 0..5u8 {
        trio.members[leader]
            .propose(0, vec![n + 1])
            .expect("propose");
    }
    trio.pump();
    let applied = trio.members[leader].applied(0);
    let too_far = trio.members[leader].compact(0, applied + 1, b"state".to_vec());
    assert!(matches!(too_far, Err(CompactError::OutOfRange { .. })));
    trio.members[leader]
        .compact(0, applied, b"state".to_vec())
        .expect("compact");
    // The snapshot goes to the writer with the next drain's batch. Alone it is only written
    // (the entries it covers are durable already): a crash may lose it.
    trio.pump();
    let snapshot_of = |image: &MemDurable| {
        let recovered = image.recovered();
        let snapshot = recovered[0].1.snapshot.as_ref();
        snapshot.map(|snapshot| snapshot.get_data().to_vec())
    };
    assert_eq!(snapshot_of(&trio.members[leader].writer().crashed()), None);
    // The next batch that must be synced makes it durable.
    trio.members[leader].propose(0, vec![9]).expect("propose");
    trio.pump();
    let old = trio.members.remove(leader);
    let durable = old.into_writer().crashed();
    assert_eq!(snapshot_of(&durable), Some(b"state".to_vec()));
    let recovered = durable.recovered();
    let id = leader as u64 + 1;
    let writer = MemWriter::new(durable);
    let mut again = Member::new(id, &VOTERS, &[0, 1], writer, recovered, 7).expect("restart");
    let first = again.drain().expect("drain");
    let restore = Restore {
        shard: 0,
        data: b"state".to_vec().into(),
        index: applied,
    };
    assert_eq!(first.restores, vec![restore]);
    // Entry `applied + 1` is in the log, but its commit was only written (raft may lose a
    // commit index): a leader tells it again.
    assert!(first.committed.iter().all(|c| c.shard != 0));
    assert_eq!(again.applied(0), applied);
}

#[test]
fn balance_hands_shards_away_from_a_member_leading_all() {
    let mut trio = Trio::new();
    let leader = trio.elect();
    // Make the same member lead shard 1 too.
    for _ in 0..100 {
        if trio.members[leader].leader(1) == Some(leader as u64 + 1) {
            break;
        }
        let current = trio
            .members
            .iter()
            .position(|m| m.leader(1) == Some(m.id()));
        if let Some(at) = current {
            let _ = trio.members[at].transfer_leader(1, leader as u64 + 1);
        }
        for member in &mut trio.members {
            member.tick();
        }
        trio.pump();
    }
    assert_eq!(trio.members[leader].leader(1), Some(leader as u64 + 1));
    for _ in 0..BALANCE_INTERVAL_TICKS {
        for member in &mut trio.members {
            member.tick();
        }
        trio.pump();
    }
    let moves = trio.members[leader].balance(&VOTERS);
    assert_eq!(moves.len(), 1, "two shards over three members: one moves");
    assert!(
        trio.members[leader].balance(&VOTERS).is_empty(),
        "rate-limited"
    );
}

/// The message types `drain` hands out from `member`.
fn drained_kinds(member: &mut Member<MemWriter>, mail: &mut Vec<Envelope>) -> Vec<MessageType> {
    let drain = member.drain().expect("drain");
    let kinds = drain
        .messages
        .iter()
        .map(|e| e.message.get_msg_type())
        .collect();
    mail.extend(drain.messages);
    kinds
}

/// Steps every message of `mail` addressed to `to` (shard 0 only) into it; leaves the rest.
fn deliver(trio: &mut Trio, mail: &mut Vec<Envelope>, to: usize) {
    for Envelope { shard, message } in std::mem::take(mail) {
        if message.to != to as u64 + 1 {
            mail.push(Envelope { shard, message });
        } else if shard == 0 {
            let _ = trio.members[to].step(shard, message);
        }
    }
}

#[test]
fn no_vote_or_append_response_leaves_before_its_write_is_synced() {
    let mut trio = Trio::new();
    let mut mail = Vec::new();
    // Member 1 campaigns: pre-votes depend on nothing written; its vote for itself must be
    // durable before it asks for votes.
    let mut asked = false;
    for _ in 0..(2 * group::ELECTION_TICKS) {
        trio.members[0].tick();
        let kinds = drained_kinds(&mut trio.members[0], &mut mail);
        assert!(!kinds.contains(&MessageType::MsgRequestVote));
        if kinds.contains(&MessageType::MsgRequestPreVote) {
            asked = true;
            break;
        }
    }
    assert!(asked, "member 1 campaigns within two election timeouts");
    let mut responses = Vec::new();
    deliver(&mut trio, &mut mail, 1);
    drained_kinds(&mut trio.members[1], &mut responses);
    deliver(&mut trio, &mut responses, 0);
    let kinds = drained_kinds(&mut trio.members[0], &mut mail);
    assert!(
        trio.members[0].writer().queued() > 0,
        "term and vote handed to the writer"
    );
    assert!(!kinds.contains(&MessageType::MsgRequestVote), "{kinds:?}");
    assert!(trio.members[0].writer_mut().complete());
    let kinds = drained_kinds(&mut trio.members[0], &mut mail);
    assert!(kinds.contains(&MessageType::MsgRequestVote), "{kinds:?}");
    // Member 2 votes: its answer waits for its own term and vote to be durable.
    deliver(&mut trio, &mut mail, 1);
    let kinds = drained_kinds(&mut trio.members[1], &mut responses);
    assert!(
        !kinds.contains(&MessageType::MsgRequestVoteResponse),
        "{kinds:?}"
    );
    assert_eq!(drained_kinds(&mut trio.members[1], &mut responses), vec![]);
    assert!(trio.members[1].writer_mut().complete());
    let kinds = drained_kinds(&mut trio.members[1], &mut responses);
    assert_eq!(kinds, vec![MessageType::MsgRequestVoteResponse]);
    // Member 1 leads: its appends leave before its own write is synced.
    deliver(&mut trio, &mut responses, 0);
    let kinds = drained_kinds(&mut trio.members[0], &mut mail);
    assert_eq!(trio.members[0].leader(0), Some(1));
    assert!(kinds.contains(&MessageType::MsgAppend), "{kinds:?}");
    assert!(
        trio.members[0].writer().queued() > 0,
        "the leader's entry not yet synced"
    );
    // The followers' append responses wait for their writes.
    for follower in [1, 2] {
        deliver(&mut trio, &mut mail, follower);
        let kinds = drained_kinds(&mut trio.members[follower], &mut responses);
        assert!(
            !kinds.contains(&MessageType::MsgAppendResponse),
            "{kinds:?}"
        );
        assert!(trio.members[follower].writer_mut().complete());
        let kinds = drained_kinds(&mut trio.members[follower], &mut responses);
        assert!(kinds.contains(&MessageType::MsgAppendResponse), "{kinds:?}");
    }
    // Their responses make a majority, but the leader applies nothing before its own write is
    // synced.
    deliver(&mut trio, &mut responses, 0);
    let drain = trio.members[0].drain().expect("drain");
    assert!(
        drain.committed.iter().all(|c| c.shard != 0),
        "{:?}",
        drain.committed
    );
    assert_eq!(
        trio.members[0].commit(0),
        1,
        "committed by members 2's and 3's logs"
    );
    assert!(trio.members[0].writer_mut().complete());
    let drain = trio.members[0].drain().expect("drain");
    let applied: Vec<u64> = drain
        .committed
        .iter()
        .filter(|c| c.shard == 0)
        .map(|c| c.index)
        .collect();
    assert_eq!(applied, vec![1]);
}
