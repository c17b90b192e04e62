//! The fuzz targets' committed corpus (`fuzz/corpus/`), replayed through the very checks the
//! targets run (`fuzz/fuzz_targets/frame_parser_check.rs`, `tests/common/session_driver.rs`),
//! without libFuzzer: every input the fuzzers kept stays checked by `cargo test`. Fuzzing
//! itself (new inputs) is `cargo fuzz run` in `fuzz/` (docs/testing.md).

use std::path::Path;

#[path = "../fuzz/fuzz_targets/frame_parser_check.rs"]
mod frame_parser_check;

/// Every file of `fuzz/corpus/TARGET`, name and bytes, in name order (at least one).
fn corpus(target: &str) -> Vec<(String, Vec<u8>)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|error| panic!("{}: {error}", dir.display()))
        .map(|entry| {
            let path = entry.expect("a corpus entry").path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            (name, std::fs::read(&path).expect("a corpus file"))
        })
        .collect();
    files.sort();
    assert!(!files.is_empty(), "{} is empty", dir.display());
    files
}

#[test]
fn the_frame_parser_corpus_passes_the_targets_checks() {
    for (name, data) in corpus("frame_parser") {
        println!("frame_parser/{name}: {} bytes", data.len());
        frame_parser_check::check(&data);
    }
}

#[test]
fn the_session_corpus_passes_the_targets_checks() {
    for (name, data) in corpus("session") {
        println!("session/{name}: {} bytes", data.len());
        common::session_driver::Driver::run_script(&data).check_consumed();
    }
}
