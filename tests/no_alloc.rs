//! The request path allocates nothing once warm, long keys included: a counting global
//! allocator watches a real two-core server while one session pipelines acquires and releases
//! of 100-byte keys on both partitions (so half of them cross cores).
//!
//! Before: every request for another core's partition with a key over 22 bytes boxed a copy of
//! the key, and every new long key boxed one in the table.

use common::server::{keys_on_partition, start};
use latchkey_client::protocol::{parse_response, Request, Response};
use std::alloc::{GlobalAlloc, Layout, System};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicU64, Ordering};

/// Counts every allocation of the process.
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract is passed on as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as above.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// Acquires and releases every key once, pipelined; allocation-free on the client side (the
/// buffers are the caller's and reused).
fn cycle(stream: &mut TcpStream, keys: &[Vec<u8>], out: &mut Vec<u8>, input: &mut [u8]) {
    out.clear();
    for (owner, key) in keys.iter().enumerate() {
        let acquire = Request::Acquire {
            wait_s: 0,
            lease_s: 30,
            owner: owner as u64 + 1,
            key,
        };
        acquire.encode(out);
    }
    stream.write_all(out).unwrap();
    let mut tokens = [0u64; 64];
    read_answers(
        stream,
        input,
        keys.len(),
        |owner, response| match response {
            Response::Acquired { token, .. } => tokens[owner as usize - 1] = token,
            other => panic!("expected A, got {other:?}"),
        },
    );
    out.clear();
    for (index, key) in keys.iter().enumerate() {
        let token = tokens[index];
        Request::Release { token, key }.encode(out);
    }
    stream.write_all(out).unwrap();
    read_answers(stream, input, keys.len(), |_, response| {
        assert!(
            matches!(response, Response::Released { .. }),
            "{response:?}"
        );
    });
}

fn read_answers(
    stream: &mut TcpStream,
    input: &mut [u8],
    count: usize,
    mut each: impl FnMut(u64, Response),
) {
    let (mut filled, mut answered) = (0, 0);
    while answered < count {
        filled += stream.read(&mut input[filled..]).unwrap();
        let mut used = 0;
        while let Some((response, len)) = parse_response(&input[used..filled]).unwrap() {
            used += len;
            answered += 1;
            each(response.correlation_id(), response);
        }
        input.copy_within(used..filled, 0);
        filled -= used;
    }
}

#[test]
fn long_keys_allocate_nothing_per_request_once_warm() {
    let server = start(2);
    let mut keys: Vec<Vec<u8>> = Vec::new();
    for partition in 0..2 {
        let named = keys_on_partition(&"k".repeat(90), partition, 2, 16);
        keys.extend(named.into_iter().map(String::into_bytes));
    }
    assert!(keys.iter().all(|key| key.len() > 90));
    let mut stream = TcpStream::connect(server.local_addr()).unwrap();
    stream.set_nodelay(true).unwrap();
    let mut out = Vec::with_capacity(64 * 1024);
    let mut input = vec![0u8; 64 * 1024];
    for _ in 0..500 {
        cycle(&mut stream, &keys, &mut out, &mut input);
    }
    let before = ALLOCATIONS.load(Ordering::Relaxed);
    let cycles = 2000;
    for _ in 0..cycles {
        cycle(&mut stream, &keys, &mut out, &mut input);
    }
    let allocations = ALLOCATIONS.load(Ordering::Relaxed) - before;
    let requests = cycles * keys.len() as u64 * 2;
    println!("{allocations} allocations in {requests} requests");
    // Nothing per request: a handful at most, from anything else the process does meanwhile.
    assert!(
        allocations < 50,
        "{allocations} allocations in {requests} requests"
    );
}
