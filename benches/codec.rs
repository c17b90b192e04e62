//! Criterion benches of the wire codec's hot paths: parsing and encoding the frames of an
//! acquire/release cycle, one at a time and as a pipelined batch of 16, on both sides (server:
//! requests; client: responses). They guard `src/protocol.rs` against regressions.
//!
//! `cargo bench --bench codec`

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use latchkey_client::protocol::{parse_request, parse_response, Request, Response, KEY_BYTES_MAX};

const KEY: &[u8] = b"ubench0000004242";
const BATCH: usize = 16;

fn acquire(owner: u64) -> Request<'static> {
    Request::Acquire {
        wait_s: 0,
        lease_s: 30,
        owner,
        key: KEY,
    }
}

fn request_batch() -> Vec<u8> {
    let mut bytes = Vec::new();
    for owner in 0..BATCH as u64 / 2 {
        acquire(owner).encode(&mut bytes);
        Request::Release {
            token: owner + 1000,
            key: KEY,
        }
        .encode(&mut bytes);
    }
    bytes
}

fn response_batch() -> Vec<u8> {
    let mut bytes = Vec::new();
    for owner in 0..BATCH as u64 / 2 {
        Response::Acquired {
            owner,
            token: owner + 1000,
        }
        .encode(&mut bytes);
        Response::Released {
            token: owner + 1000,
        }
        .encode(&mut bytes);
    }
    bytes
}

fn requests(c: &mut Criterion) {
    let mut group = c.benchmark_group("request");
    let mut one = Vec::new();
    acquire(7).encode(&mut one);
    group.throughput(Throughput::Elements(1));
    group.bench_function("parse_acquire", |b| {
        b.iter(|| {
            parse_request(black_box(&one), KEY_BYTES_MAX)
                .unwrap()
                .unwrap()
                .1
        })
    });
    let mut out = Vec::with_capacity(64);
    group.bench_function("encode_acquire", |b| {
        b.iter(|| {
            out.clear();
            black_box(acquire(black_box(7))).encode(&mut out);
            out.len()
        })
    });
    let batch = request_batch();
    group.throughput(Throughput::Elements(BATCH as u64));
    group.bench_function("parse_batch_16", |b| {
        b.iter(|| {
            let bytes = black_box(&batch[..]);
            let mut offset = 0;
            while let Some((_, used)) = parse_request(&bytes[offset..], KEY_BYTES_MAX).unwrap() {
                offset += used;
            }
            offset
        })
    });
    group.finish();
}

fn responses(c: &mut Criterion) {
    let mut group = c.benchmark_group("response");
    let mut one = Vec::new();
    Response::Acquired { owner: 7, token: 9 }.encode(&mut one);
    group.throughput(Throughput::Elements(1));
    group.bench_function("parse_acquired", |b| {
        b.iter(|| parse_response(black_box(&one)).unwrap().unwrap().1)
    });
    let mut out = Vec::with_capacity(64);
    group.bench_function("encode_acquired", |b| {
        b.iter(|| {
            out.clear();
            black_box(Response::Acquired {
                owner: black_box(7),
                token: 9,
            })
            .encode(&mut out);
            out.len()
        })
    });
    let batch = response_batch();
    group.throughput(Throughput::Elements(BATCH as u64));
    group.bench_function("parse_batch_16", |b| {
        b.iter(|| {
            let bytes = black_box(&batch[..]);
            let mut offset = 0;
            while let Some((_, used)) = parse_response(&bytes[offset..]).unwrap() {
                offset += used;
            }
            offset
        })
    });
    group.finish();
}

criterion_group!(benches, requests, responses);
criterion_main!(benches);
