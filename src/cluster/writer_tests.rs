//! Unit tests of the writer: rounds (order, one sync, flush-only rounds), the thread (group
//! commit of the batches queued behind a slow sync, completions in order and only after the
//! sync returned, the messages that wait for a batch sent after its sync and before it is
//! reported, failures that stop it, a drop that writes what is queued).

use super::*;
use crate::cluster::mem_durable::{MemDurable, SyncMode};
use crossbeam_channel::{bounded, Receiver, Sender};
use raft::eraftpb::{Message, MessageType};
use std::time::Duration;

fn entry(index: u64) -> Entry {
    Entry {
        index,
        term: 1,
        data: vec![index as u8; 8].into(),
        ..Default::default()
    }
}

fn commit(commit: u64) -> HardState {
    HardState {
        term: 1,
        vote: 1,
        commit,
        ..Default::default()
    }
}

/// A batch appending entry `number` of shard 0 (batch `n` holds entry `n`).
fn batch(number: u64) -> Batch {
    Batch {
        number,
        must_sync: true,
        records: vec![Record::Entries {
            shard: 0,
            entries: vec![entry(number)],
        }],
        after_sync: Vec::new(),
    }
}

/// A batch whose only write is a commit index: raft lets it be lost.
fn commit_only(number: u64, index: u64) -> Batch {
    Batch {
        number,
        must_sync: false,
        records: vec![Record::HardState {
            shard: 0,
            hard_state: commit(index),
        }],
        after_sync: Vec::new(),
    }
}

/// A [`MemDurable`] that counts syncs and flushes, and whose syncs may wait for a gate.
struct Gated {
    image: MemDurable,
    flushes: u64,
    /// When set: each sync says it started, then waits for one permit.
    gate: Option<(Sender<()>, Receiver<()>)>,
    /// Every sync's count of entries written so far, in order.
    seen: Sender<(u64, usize)>,
}

impl Durable for Gated {
    fn append(&mut self, shard: u32, entries: &[Entry]) -> io::Result<()> {
        self.image.append(shard, entries)
    }
    fn set_hard_state(&mut self, shard: u32, hard_state: &HardState) -> io::Result<()> {
        self.image.set_hard_state(shard, hard_state)
    }
    fn apply_snapshot(&mut self, shard: u32, snapshot: &Snapshot) -> io::Result<()> {
        self.image.apply_snapshot(shard, snapshot)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.flushes += 1;
        self.image.flush()
    }
    fn sync(&mut self) -> io::Result<()> {
        if let Some((started, permit)) = &self.gate {
            started.send(()).expect("the test listens");
            permit.recv().expect("the test permits");
        }
        self.image.sync()?;
        let entries = self
            .image
            .recovered()
            .first()
            .map_or(0, |(_, g)| g.entries.len());
        let _ = self.seen.send((self.image.syncs(), entries));
        Ok(())
    }
}

/// The test's side of a gate: "a sync started", and permits to finish one.
type Gate = (Receiver<()>, Sender<()>);

/// A [`Gated`] durable (gated if `gate`), the syncs it reports, and the test's side of the gate.
fn gated(gate: bool) -> (Gated, Receiver<(u64, usize)>, Option<Gate>) {
    let (seen, syncs) = bounded(64);
    let (started_tx, started_rx) = bounded(64);
    let (permit_tx, permit_rx) = bounded(64);
    let durable = Gated {
        image: MemDurable::new(),
        flushes: 0,
        gate: gate.then_some((started_tx, permit_rx)),
        seen,
    };
    (durable, syncs, gate.then_some((started_rx, permit_tx)))
}

#[test]
fn a_round_writes_its_batches_in_order_and_syncs_once() {
    let (mut durable, syncs, _) = gated(false);
    let through = write_round(&mut durable, &[batch(1), batch(2), batch(3)]).expect("round");
    assert_eq!(through, 3);
    assert_eq!(syncs.try_iter().collect::<Vec<_>>(), vec![(1, 3)]);
    assert_eq!(durable.flushes, 0);
    let entries: Vec<u64> = durable.image.recovered()[0]
        .1
        .entries
        .iter()
        .map(|e| e.index)
        .collect();
    assert_eq!(entries, vec![1, 2, 3]);
}

#[test]
fn a_round_of_commit_indices_only_is_written_without_a_sync() {
    let (mut durable, syncs, _) = gated(false);
    write_round(&mut durable, &[batch(1)]).expect("round");
    let through = write_round(&mut durable, &[commit_only(2, 1)]).expect("round");
    assert_eq!(through, 2);
    assert_eq!(syncs.try_iter().count(), 1, "only the entry's round synced");
    assert_eq!(durable.flushes, 1);
    // Unsynced: a crash loses the commit index (raft allows it), never the synced entry.
    durable.image.crash();
    let recovered = &durable.image.recovered()[0].1;
    assert_eq!(
        (recovered.entries.len(), recovered.hard_state.commit),
        (1, 0)
    );
    // One batch that must be synced makes the whole round synced, commit index included.
    write_round(&mut durable, &[commit_only(3, 1), batch(2)]).expect("round");
    assert_eq!(syncs.try_iter().count(), 1);
    durable.image.crash();
    let recovered = &durable.image.recovered()[0].1;
    assert_eq!(
        (recovered.entries.len(), recovered.hard_state.commit),
        (2, 1)
    );
}

#[test]
fn failures_name_the_step() {
    let mut image = MemDurable::new();
    let gap = Batch {
        number: 1,
        must_sync: true,
        records: vec![Record::Entries {
            shard: 0,
            entries: vec![entry(5)],
        }],
        after_sync: Vec::new(),
    };
    let error = write_round(&mut image, &[gap]).expect_err("a gap");
    assert!(
        error
            .to_string()
            .starts_with("writing the write-ahead log failed"),
        "{error}"
    );
    image.set_sync_mode(SyncMode::Fail);
    let error = write_round(&mut image, &[batch(1)]).expect_err("sync fails");
    assert!(
        error
            .to_string()
            .starts_with("syncing the write-ahead log failed"),
        "{error}"
    );
    assert!(
        write_round(&mut image, &[]).is_err(),
        "an empty round is a bug"
    );
}

/// Waits (bounded) until `writer` reports `number` synced.
fn wait_synced(writer: &Writer, number: u64) {
    for _ in 0..2000 {
        if writer.synced().expect("no failure") >= number {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    panic!("batch {number} not synced within 2 s");
}

/// A writer thread over `durable` that reports each wake on the channel returned and drops the
/// messages it would send.
fn waking_writer<D: Durable + Send + 'static>(durable: D) -> (Writer, Receiver<()>) {
    let (woken_tx, woken) = bounded(64);
    let wake = move || {
        let _ = woken_tx.send(());
    };
    let writer = Writer::spawn("test-wal".into(), durable, wake, |_| {}).expect("spawn");
    (writer, woken)
}

#[test]
fn batches_queued_behind_a_slow_sync_are_synced_together_and_reported_after_it() {
    let (durable, syncs, gate) = gated(true);
    let (started, permit) = gate.expect("gated");
    let (mut writer, woken) = waking_writer(durable);
    writer.submit(batch(1)).expect("room");
    started.recv().expect("the first round syncs");
    for number in 2..=4 {
        writer.submit(batch(number)).expect("room");
    }
    // Nothing is reported while the sync has not returned.
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(writer.synced().expect("no failure"), 0);
    assert!(woken.try_recv().is_err(), "no wake before a completion");
    permit.send(()).expect("permit");
    wait_synced(&writer, 1);
    started.recv().expect("the second round syncs");
    assert_eq!(
        writer.synced().expect("no failure"),
        1,
        "2..=4 wait for their sync"
    );
    permit.send(()).expect("permit");
    wait_synced(&writer, 4);
    // Two rounds, two syncs, two wakes: 2, 3 and 4 were written together.
    assert_eq!(syncs.try_iter().collect::<Vec<_>>(), vec![(1, 1), (2, 4)]);
    assert_eq!(woken.try_iter().count(), 2);
    let latency = writer.sync_latency().expect("measured");
    assert_eq!(latency.count(), 2);
}

/// A batch like [`batch`] whose `after_sync` holds one append response to member 2, its
/// `index` the batch's number.
fn answering(number: u64) -> Batch {
    let mut message = Message::default();
    message.set_msg_type(MessageType::MsgAppendResponse);
    message.to = 2;
    message.index = number;
    Batch {
        after_sync: vec![Envelope { shard: 0, message }],
        ..batch(number)
    }
}

#[test]
fn messages_waiting_for_a_batch_are_sent_after_its_sync_and_before_it_is_reported() {
    let (durable, _syncs, gate) = gated(true);
    let (started, permit) = gate.expect("gated");
    let (sent_tx, sent) = bounded::<Vec<Envelope>>(64);
    // The send waits for the test's word, so the test can look at `synced` meanwhile.
    let (go_tx, go) = bounded::<()>(64);
    let mut writer = Writer::spawn(
        "test-wal".into(),
        durable,
        || {},
        move |batch| {
            let _ = sent_tx.send(batch);
            let _ = go.recv();
        },
    )
    .expect("spawn");
    writer.submit(answering(1)).expect("room");
    started.recv().expect("the first round syncs");
    writer.submit(answering(2)).expect("room");
    writer.submit(batch(3)).expect("room");
    // While the sync has not returned, nothing leaves.
    std::thread::sleep(Duration::from_millis(20));
    assert!(sent.try_recv().is_err(), "a response left before its sync");
    permit.send(()).expect("permit");
    let first = sent.recv_timeout(Duration::from_secs(2)).expect("sent");
    let indices: Vec<u64> = first.iter().map(|e| e.message.index).collect();
    assert_eq!(indices, vec![1]);
    assert_eq!(writer.synced().expect("healthy"), 0, "sent before reported");
    go_tx.send(()).expect("go");
    wait_synced(&writer, 1);
    started.recv().expect("the second round syncs");
    assert!(sent.try_recv().is_err(), "2 waits for its own sync");
    permit.send(()).expect("permit");
    let second = sent.recv_timeout(Duration::from_secs(2)).expect("sent");
    let indices: Vec<u64> = second.iter().map(|e| e.message.index).collect();
    assert_eq!(indices, vec![2], "one send per round, 3 has none");
    go_tx.send(()).expect("go");
    wait_synced(&writer, 3);
    // A writer thread sends them itself: the member finds none to pass on.
    let mut out = Vec::new();
    writer.take_released(&mut out);
    assert!(out.is_empty());
}

#[test]
fn a_failed_sync_stops_the_writer_and_is_reported() {
    let mut image = MemDurable::new();
    image.set_sync_mode(SyncMode::Fail);
    let (mut writer, woken) = waking_writer(image);
    writer.submit(batch(1)).expect("room");
    woken
        .recv_timeout(Duration::from_secs(2))
        .expect("woken on failure");
    let error = writer.synced().expect_err("failed");
    assert!(
        error.to_string().contains("sync failed (injected)"),
        "{error}"
    );
    // The thread is gone: later batches come back to the member.
    for _ in 0..200 {
        if writer.submit(batch(2)).is_err() {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("a failed writer kept taking batches");
}

#[test]
fn dropping_the_writer_writes_what_is_queued_then_waits_for_the_thread() {
    let (durable, syncs, gate) = gated(true);
    let (started, permit) = gate.expect("gated");
    let mut writer = Writer::spawn("test-wal".into(), durable, || {}, |_| {}).expect("spawn");
    writer.submit(batch(1)).expect("room");
    started.recv().expect("syncing 1");
    writer.submit(batch(2)).expect("room");
    for _ in 0..2 {
        permit.send(()).expect("permit");
    }
    drop(writer);
    assert_eq!(syncs.try_iter().collect::<Vec<_>>(), vec![(1, 1), (2, 2)]);
}

/// A durable whose sync panics (a broken invariant of the log).
struct Panicking(MemDurable);

impl Durable for Panicking {
    fn append(&mut self, shard: u32, entries: &[Entry]) -> io::Result<()> {
        self.0.append(shard, entries)
    }
    fn set_hard_state(&mut self, shard: u32, hard_state: &HardState) -> io::Result<()> {
        self.0.set_hard_state(shard, hard_state)
    }
    fn apply_snapshot(&mut self, shard: u32, snapshot: &Snapshot) -> io::Result<()> {
        self.0.apply_snapshot(shard, snapshot)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.0.flush()
    }
    fn sync(&mut self) -> io::Result<()> {
        panic!("an invariant broke (on purpose)");
    }
}

#[test]
fn a_panic_of_the_writer_thread_is_reported_as_a_failure() {
    let (mut writer, woken) = waking_writer(Panicking(MemDurable::new()));
    writer.submit(batch(1)).expect("room");
    woken
        .recv_timeout(Duration::from_secs(2))
        .expect("woken on the panic");
    let error = writer.synced().expect_err("failed");
    assert!(
        error.to_string().contains("writer thread panicked"),
        "{error}"
    );
}
