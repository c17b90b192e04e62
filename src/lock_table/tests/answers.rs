//! What the table's answers carry beyond the matrix: the key a grant names (inline and long
//! keys), Ping, a Cancel of several waiters, a closed session's silence, and `ends_pending`.

use super::*;

#[test]
fn grants_name_their_entry_inline_and_long_keys() {
    let mut fixture = Fixture::new(8, 2);
    let long = [b'L'; 200];
    for key in [
        &b"k"[..],
        &[b's'; 22],
        &[b'h'; 23],
        &long,
        "ключ".as_bytes(),
    ] {
        let token = fixture.grant(1, 3, 10, key);
        let answers = fixture.acquire(2, 0, 3, 11, key);
        assert_eq!(answers, vec![timeout(2, 11, false)]);
        assert_eq!(fixture.release(1, token, key).len(), 1);
    }
    // Keys compare byte for byte: a prefix is another key.
    fixture.grant(1, 3, 12, &long);
    fixture.grant(1, 3, 13, &long[..199]);
    assert_eq!(fixture.table.key_count(), 2);
}

#[test]
fn key_bytes_keep_their_bytes_inline_or_not() {
    for len in [
        1,
        INLINE_KEY_BYTES - 1,
        INLINE_KEY_BYTES,
        INLINE_KEY_BYTES + 1,
        1024,
    ] {
        let key: Vec<u8> = (0..len).map(|i| b'a' + (i % 26) as u8).collect();
        let kept = KeyBytes::new(&key);
        assert_eq!(&*kept, key.as_slice());
        assert_eq!(
            matches!(kept, KeyBytes::Inline { .. }),
            len <= INLINE_KEY_BYTES
        );
    }
}

#[test]
fn ping_is_not_the_tables_business() {
    // The reactor answers Ping; handed to a table it changes nothing and answers nothing.
    let mut fixture = Fixture::new(1, 1);
    let answers = fixture.request(3, Request::Ping { nonce: 0x0A0A });
    assert!(answers.is_empty());
    assert_eq!(fixture.table.key_count(), 0);
}

#[test]
fn cancel_withdraws_every_matching_waiter_in_order() {
    let mut fixture = Fixture::new(4, 8);
    let token = fixture.grant(1, 9, 1, KEY);
    fixture.grant(1, 9, 9, b"elsewhere");
    fixture.enqueue(2, 5, 3, 7, KEY);
    fixture.enqueue(3, 5, 3, 7, KEY);
    fixture.enqueue(2, 5, 3, 8, KEY);
    fixture.enqueue(2, 6, 4, 7, KEY);
    fixture.enqueue(2, 5, 3, 7, b"elsewhere");
    let answers = fixture.cancel(2, 7, KEY);
    assert_eq!(answers, vec![timeout(2, 7, true), timeout(2, 7, true)]);
    assert_eq!(fixture.query(KEY).2, 2);
    assert_eq!(fixture.query(b"elsewhere").2, 1);
    assert_eq!(fixture.cancel(2, 7, KEY), vec![]);
    let answers = fixture.release(1, token, KEY);
    assert_eq!(answers[1], granted(3, 7, token + 2, true, KEY));
}

#[test]
fn session_close_is_silent_and_keeps_holds() {
    let mut fixture = Fixture::new(4, 4);
    let kept = fixture.grant(2, 30, 1, b"kept");
    let token = fixture.grant(1, 30, 2, KEY);
    fixture.enqueue(3, 9, 5, 3, KEY);
    fixture.enqueue(2, 9, 5, 4, KEY);
    fixture.enqueue(2, 9, 5, 5, KEY);
    fixture.enqueue(3, 9, 5, 6, KEY);
    fixture.table.handle_session_closed(2);
    assert_eq!(drain(&mut fixture.table), vec![]);
    fixture.table.handle_session_closed(2);
    fixture.table.handle_session_closed(99);
    assert_eq!(drain(&mut fixture.table), vec![]);
    assert_eq!(fixture.query(KEY).2, 2);
    assert_eq!(fixture.query(b"kept"), (true, 30_000, 0));
    // The hold of the closed session lives on; any session may release it.
    let released = said(4, Response::Released { token: kept }, false);
    assert_eq!(fixture.release(4, kept, b"kept"), vec![released]);
    // The other session's waiters keep their order.
    assert_eq!(
        fixture.release(1, token, KEY)[1],
        granted(3, 3, kept + 2, true, KEY)
    );
}

#[test]
fn ends_pending_marks_answers_to_acquires_that_waited() {
    let mut fixture = Fixture::new(1, 1);
    let token = fixture.grant(1, 5, 1, KEY);
    let flags = |answers: Vec<Seen>| answers.iter().map(|s| s.ends_pending).collect::<Vec<_>>();
    assert_eq!(flags(fixture.acquire(2, 0, 5, 2, KEY)), vec![false]);
    assert_eq!(flags(fixture.acquire(2, 0, 5, 3, b"other")), vec![false]);
    assert_eq!(flags(fixture.acquire(2, 1, 5, 4, b"other")), vec![true]);
    fixture.enqueue(2, 1, 5, 5, KEY);
    assert_eq!(flags(fixture.acquire(2, 1, 5, 6, KEY)), vec![true]);
    assert_eq!(flags(fixture.release(1, token, KEY)), vec![false, true]);
    assert_eq!(
        flags(fixture.acquire(3, 1, 5, 7, b"free-again")),
        vec![true]
    );
}
