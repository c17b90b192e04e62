//! The compactors: an image encodes the state at its freeze whatever is applied after, results
//! come back (late and out of order for the late [`MemCompactor`]), and a worker that dies is
//! reported, never silent.

use super::*;
use crate::cluster::machine::Command;
use std::sync::atomic::AtomicUsize;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Shard 1 of 4 with a floor and `holds` holds, applied up to `holds + 1`.
fn machine_with(holds: u64) -> ShardMachine {
    let mut machine = ShardMachine::new(1, 4);
    machine.apply(1, &Command::Barrier { floor: 4_000 }, 0);
    for i in 0..holds {
        let command = Command::Acquire {
            key: format!("k{i}").into_bytes(),
            owner: i,
            lease_ms: 10_000,
        };
        machine.apply(2 + i, &command, 5);
    }
    machine
}

/// A snapshot worker that counts its wakes.
fn counting_worker() -> (SnapWorker, Arc<AtomicUsize>) {
    let wakes = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&wakes);
    let worker = SnapWorker::spawn("test-snap".into(), move || {
        counted.fetch_add(1, Ordering::SeqCst);
    })
    .expect("spawn");
    (worker, wakes)
}

/// A snapshot of `machine` (shard 1 of 4, as [`machine_with`] makes it) to restore, its
/// deadlines counted from `now_ms`.
fn restore_job(machine: &ShardMachine, data: bytes::Bytes, now_ms: u64) -> RestoreJob {
    RestoreJob {
        shard: 1,
        shards: 4,
        index: machine.applied(),
        data,
        now_ms,
    }
}

/// Releases every other hold and grants new keys, from index `from` on.
fn churn(machine: &mut ShardMachine, from: u64) {
    let holds: Vec<(Vec<u8>, u64)> = machine
        .holds()
        .map(|(key, hold)| (key.to_vec(), hold.token))
        .collect();
    let mut index = from;
    for (key, token) in holds.into_iter().step_by(2) {
        let command = Command::Release {
            key,
            token,
            then: None,
        };
        machine.apply(index, &command, 100);
        index += 1;
    }
    let command = Command::Acquire {
        key: b"new".to_vec(),
        owner: 9,
        lease_ms: 1,
    };
    machine.apply(index, &command, 100);
}

/// Waits (5 s at most) until `compactor` has something.
fn wait_done(compactor: &SnapWorker) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while !compactor.has_done() {
        assert!(Instant::now() < deadline, "no result within 5 s");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn the_immediate_compactor_hands_back_the_state_at_the_freeze_after_later_applies() {
    let mut machine = machine_with(100);
    let expected = machine.snapshot(50);
    let mut compactor = MemCompactor::immediate();
    assert!(!compactor.has_done());
    compactor.submit(machine.freeze(50)).expect("taken");
    churn(&mut machine, 102);
    assert!(compactor.has_done());
    let done = compactor.take_done().expect("no failure");
    assert_eq!(
        done,
        vec![Compacted {
            shard: 1,
            index: 101,
            data: expected
        }]
    );
    assert!(!compactor.has_done());
    assert!(compactor.take_done().expect("no failure").is_empty());
}

#[test]
fn the_late_compactor_delivers_every_image_within_its_bound_in_any_order() {
    let mut compactor = MemCompactor::late(7, 4);
    let mut machine = machine_with(3);
    let mut expected = BTreeMap::new();
    for round in 0..40u64 {
        let index = machine.applied() + 1;
        machine.skip(index);
        expected.insert(index, machine.snapshot(round));
        compactor.submit(machine.freeze(round)).expect("taken");
    }
    let mut order = Vec::new();
    for _ in 0..5 {
        for compacted in compactor.take_done().expect("no failure") {
            let want = expected.remove(&compacted.index).expect("each index once");
            assert_eq!(compacted.data, want);
            order.push(compacted.index);
        }
    }
    assert!(
        expected.is_empty(),
        "undelivered after 5 polls: {expected:?}"
    );
    assert_eq!(compactor.queued(), 0);
    let mut sorted = order.clone();
    sorted.sort_unstable();
    assert_ne!(order, sorted, "some image came back out of order");
}

#[test]
fn a_failed_mem_compactor_refuses_images_and_reports_the_failure() {
    let machine = machine_with(2);
    let mut compactor = MemCompactor::immediate();
    compactor.submit(machine.freeze(0)).expect("taken");
    compactor.fail("the worker died");
    assert!(compactor.has_done());
    assert!(compactor.submit(machine.freeze(0)).is_err());
    let error = compactor.take_done().expect_err("failed");
    assert!(error.to_string().contains("the worker died"), "{error}");
    compactor.retire(machine);
    assert_eq!(compactor.retired(), 1);
}

#[test]
fn the_worker_encodes_off_the_caller_wakes_it_and_the_image_is_the_freeze() {
    let (mut worker, wakes) = counting_worker();
    let mut machine = machine_with(5_000);
    let expected = machine.snapshot(70);
    worker.submit(machine.freeze(70)).expect("taken");
    // Applied meanwhile: not in the image.
    let next = machine.applied() + 1;
    churn(&mut machine, next);
    wait_done(&worker);
    let done = worker.take_done().expect("no failure");
    assert_eq!(done.len(), 1);
    assert_eq!((done[0].shard, done[0].index), (1, 5_001));
    assert!(
        done[0].data == expected,
        "the bytes of the state at the freeze"
    );
    assert!(wakes.load(Ordering::SeqCst) >= 1);
    // A replaced machine is dropped on the worker.
    worker.retire(machine);
    drop(worker);
}

#[test]
fn a_worker_that_dies_is_reported_as_a_failure_and_wakes_the_core() {
    let (woken, wakes) = mpsc::channel();
    let mut worker = SnapWorker::spawn_with(
        "test-snap".into(),
        move || {
            let _ = woken.send(());
        },
        |_frozen: &Frozen| -> Vec<u8> { panic!("a broken invariant") },
    )
    .expect("spawn");
    let machine = machine_with(3);
    worker.submit(machine.freeze(0)).expect("taken");
    wakes
        .recv_timeout(Duration::from_secs(5))
        .expect("the core is woken");
    assert!(worker.has_done());
    let error = worker.take_done().expect_err("the failure");
    assert!(error.to_string().contains("panicked"), "{error}");
    // Later images are refused (the thread is gone), and the failure stays.
    let _ = worker.submit(machine.freeze(0));
    assert!(worker.take_done().is_err());
}

#[test]
fn a_full_worker_gives_the_image_back() {
    let (release, blocked) = mpsc::channel::<()>();
    let blocked = parking_lot::Mutex::new(blocked);
    let mut worker = SnapWorker::spawn_with(
        "test-snap".into(),
        || {},
        move |frozen: &Frozen| {
            let _ = blocked.lock().recv();
            frozen.encode()
        },
    )
    .expect("spawn");
    let machine = machine_with(1);
    let mut taken = 0;
    while worker.submit(machine.freeze(0)).is_ok() {
        taken += 1;
        assert!(taken <= JOBS_IN_FLIGHT_MAX + 1, "bounded");
    }
    assert!(taken >= JOBS_IN_FLIGHT_MAX);
    drop(release);
    drop(worker);
}

use std::collections::BTreeMap;

#[test]
fn the_worker_decodes_a_received_snapshot_off_the_caller_counting_from_the_hand_over() {
    let (mut worker, wakes) = counting_worker();
    let machine = machine_with(2_000);
    // Taken at 5 ms: each lease (10 s from 5 ms) has 10,000 ms left; handed over at 1,000 ms.
    let data = bytes::Bytes::from(machine.snapshot(5));
    worker
        .submit_restore(restore_job(&machine, data, 1_000))
        .expect("taken");
    let bad = bytes::Bytes::from_static(b"not a snapshot");
    worker
        .submit_restore(restore_job(&machine, bad, 1_000))
        .expect("taken");
    let started = Instant::now();
    let mut restored = Vec::new();
    while restored.len() < 2 && started.elapsed() < Duration::from_secs(10) {
        restored.extend(worker.take_restored());
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(restored.len(), 2, "both decoded, in order");
    let decoded = restored[0].machine.as_ref().expect("restores");
    assert_eq!(
        (restored[0].shard, restored[0].index),
        (1, machine.applied())
    );
    assert_eq!(decoded.digest(), machine.digest());
    let deadlines: Vec<u64> = decoded.holds().map(|(_, hold)| hold.deadline_ms).collect();
    assert!(
        deadlines.iter().all(|&d| d == 11_000),
        "hand-over + remaining"
    );
    assert!(
        restored[1].machine.is_err(),
        "bad bytes are an error, not a panic"
    );
    assert!(wakes.load(Ordering::SeqCst) >= 2);
    assert!(worker.take_done().expect("no failure").is_empty());
}

#[test]
fn the_immediate_compactor_gives_a_restore_back_and_the_late_one_delivers_it_later() {
    let machine = machine_with(10);
    let job = restore_job(&machine, bytes::Bytes::from(machine.snapshot(5)), 5);
    let mut immediate = MemCompactor::immediate();
    assert!(
        immediate.submit_restore(job.clone()).is_err(),
        "decoded by the caller"
    );
    let mut late = MemCompactor::late(3, 4);
    late.submit_restore(job).expect("taken");
    let mut polls = 0;
    let restored = loop {
        late.take_done().expect("no failure");
        polls += 1;
        let restored = late.take_restored();
        if !restored.is_empty() || polls > 10 {
            break restored;
        }
    };
    assert!(polls <= 5, "within its bound: {polls}");
    assert_eq!(restored.len(), 1);
    let decoded = restored[0].machine.as_ref().expect("restores");
    assert_eq!(decoded.digest(), machine.digest());
}
