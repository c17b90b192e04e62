//! Output a stream holds of its own (TLS records the socket did not take) counts as unsent
//! until `flush` writes it; a plain stream never holds any.

use super::*;
use std::io::{Read, Write};

/// A stream like TLS: `write` takes everything into its own buffer and sends what the
/// "socket" (`room` bytes) takes; `flush` sends more once room is given.
#[derive(Default)]
struct HoldingStream {
    held: usize,
    room: usize,
    sent: usize,
}

impl HoldingStream {
    fn push(&mut self) -> io::Result<()> {
        let moved = self.held.min(self.room);
        self.held -= moved;
        self.room -= moved;
        self.sent += moved;
        if self.held > 0 {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(())
    }
}

impl Read for HoldingStream {
    fn read(&mut self, _: &mut [u8]) -> io::Result<usize> {
        Err(io::ErrorKind::WouldBlock.into())
    }
}

impl Write for HoldingStream {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        self.held += bytes.len();
        let _ = self.push();
        Ok(bytes.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.push()
    }
}

impl Stream for HoldingStream {
    fn shutdown_write(&mut self) -> io::Result<()> {
        Ok(())
    }

    fn peer(&self) -> Option<SocketAddr> {
        None
    }

    fn wants_write(&self) -> bool {
        self.held > 0
    }
}

#[test]
fn output_held_by_the_stream_is_unsent_until_flushed() {
    let stream = HoldingStream {
        room: 100,
        ..HoldingStream::default()
    };
    let mut session = Session::new(1, stream);
    session.push_raw(&[7; 250]);
    // The stream took every byte, but holds 150 of them: not done, still output.
    assert!(!session.flush().unwrap(), "not done");
    assert_eq!(session.unsent(), 0);
    assert!(session.has_output());
    assert!(!session.is_settled());
    // A writable event with room for part of it.
    session.socket_mut().room = 100;
    assert!(!session.flush().unwrap(), "not done");
    assert!(session.has_output());
    session.socket_mut().room = 100;
    assert!(session.flush().unwrap(), "done");
    assert!(!session.has_output());
    assert!(session.is_settled());
    assert_eq!(session.socket().sent, 250);
}
